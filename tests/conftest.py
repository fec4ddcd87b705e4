"""Fixtures: tiny random checkpoints of every family (in process), the family conformance files (tests/families.py)
and the real SmolLM2-135M pack."""

from __future__ import annotations

import json
from pathlib import Path

import families
import pytest
import torch

VOCAB = 96


def word_tokenizer(directory: Path, vocab: int = VOCAB, prefix: str = "t") -> None:
    """A word-level tokenizer over tokens t0..t{vocab-1}; t0 is EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"{prefix}{i}": i for i in range(vocab)}, unk_token=f"{prefix}1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"{prefix}0"}))


FAMILIES = {
    "llama": dict(model_type="llama", attention_bias=False, tie_word_embeddings=True),
    "llama3-rope": dict(
        model_type="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-linear-bias": dict(
        model_type="llama", attention_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen2-yarn": dict(
        model_type="qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    ),
    "qwen3": dict(model_type="qwen3", head_dim=24),
    # two layers: sliding (head size 16), full (32, one K/V head: the keys); no per-layer inputs; logits capped at
    # 1.5, so that a vocabulary of 8 samples more than one token
    "gemma4": dict(
        model_type="gemma4_text",
        final_logit_softcapping=1.5,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=4,
        hidden_size_per_layer_input=0,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def make_tiny(directory: Path, family: str, seed: int = 0, layers: int = 2, vocab: int = VOCAB) -> Path:
    """Save a random `transformers` model of `family` with our word tokenizer; return the directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(FAMILIES[family])
    model_type = extra.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=0,
        bos_token_id=None,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # peaked logits, so greedy argmax is far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    word_tokenizer(directory, vocab)
    return directory


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """family -> checkpoint directory (built once per session)."""
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[str, Path] = {}

    def get(family: str, seed: int = 0, layers: int = 2) -> Path:
        key = f"{family}-{seed}-{layers}"
        if key not in cache:
            cache[key] = make_tiny(root / key, family, seed, layers)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The real SmolLM2-135M pack (downloaded and converted once, cached under SPECDEC_HOME)."""
    from specdec.models.packs import pull

    return pull("smollm2-135m", progress=False)


def untrained_spec_types() -> list[str]:
    """Lossless spec types that need no trained head ('none' included); heads are tested with heads of their own."""
    from specdec.drafters import spec_types

    return list(spec_types(lossy=False, heads=False))


def head_llm(kind: str, target, head_dir, **kw):
    """An fp32 `LLM` drafting with the trained-head spec type `kind` from `head_dir`: fixed draft length, no EOS
    stop (random heads on tiny targets)."""
    import specdec

    llm = specdec.LLM(
        str(target),
        spec_type=kind,
        dtype="fp32",
        adaptive=False,
        progress=False,
        **{f"{kind}_head": str(head_dir)},
        **kw,
    )
    llm.engine.stop_ids = set()
    return llm


def randomize(module: torch.nn.Module, seed: int, scale: float, matrices_only: bool = False) -> None:
    """Every parameter (or only the matrices) of `module` drawn from N(0, scale^2), seeded."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() > 1 or not matrices_only:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory, request) -> Path:
    """A folder every test worker of this run shares (xdist's workers' base folders sit in one per-run folder)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(request.config, "workerinput") else base


@pytest.fixture(scope="session")
def family_files(shared_tmp):
    """case -> its `Files` (tests/families.py), made once per run: the first worker to ask makes them, under a lock
    per case, and the others use them (as they do the conversions `Files.gguf` makes)."""
    from specdec.paths import file_lock

    root = shared_tmp / "families"

    def get(case: str) -> families.Files:
        d = root / case
        over = families.GGUF_OVERRIDES.get(case)
        with file_lock(root / f"{case}.lock"):
            if not (d / ".made").exists():
                families.make_checkpoint(d / "hf", case)
                if over:
                    families.make_checkpoint(d / "hf-gguf", case, **over)
                (d / ".made").touch()
        return families.Files(d / "hf", d / ("hf-gguf" if over else "hf"), d)

    return get


@pytest.fixture(scope="module")
def family_home(shared_tmp):
    """Conversions and tokenizers of these files go to a SPECDEC_HOME of this run, shared by its workers (specdec
    publishes each atomically); the llama.cpp source and build stay where they are cached."""
    from specdec.bench import llama_build

    mp = pytest.MonkeyPatch()
    mp.setattr(llama_build, "root", lambda cached=llama_build.root(): cached)
    mp.setenv("SPECDEC_HOME", str(shared_tmp / "family-home"))
    yield
    mp.undo()


@pytest.fixture
def fast_prefill():
    """The opt-in fast prefill arithmetic (`kernels.set_fast_prefill`) for one test, off again after it."""
    from specdec.runtime import kernels

    kernels.set_fast_prefill(True)
    yield
    kernels.set_fast_prefill(False)
