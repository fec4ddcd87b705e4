"""Tiny random checkpoints of every model family, and llama.cpp's own converter to turn them into GGUF.

`make_checkpoint(dir, case)` saves a `transformers` model (safetensors, fp32) of one `TINY` case together with a
tokenizer that both `AutoTokenizer` and llama.cpp's `convert_hf_to_gguf.py` accept:

* "llama" / "gemma": a SentencePiece BPE model of SPM_VOCAB pieces trained here (`tokenizer.model`) in Llama's /
  Gemma's layout, plus the equivalent tokenizer.json (Llama 2's pipeline / a `GemmaTokenizer`) built from it (no
  protobuf needed); `AutoTokenizer` encodes exactly as SentencePiece does. The converter reads the SentencePiece
  model, so no BPE pre-tokenizer hash is involved.
* "gpt2" / "qwen2": the real GPT-2 (50257) / Qwen2 (151646) byte-level BPE, rebuilt from the vocab-only GGUFs of
  the pinned llama.cpp source, whose pre-tokenizer hashes the converter knows. For families whose converter takes
  no SentencePiece model (OLMo2), and for Qwen2, which `AutoTokenizer` always loads as a `Qwen2Tokenizer`.

The tokenizers do not depend on the seed (a draft and a target built with different seeds share one vocabulary).
`convert()` runs the converter of the llama.cpp source pinned by `specdec.bench.llama_build` with that source's own
gguf-py; `llama_quantize()` runs the `llama-quantize` built beside `llama-server`.
"""

from __future__ import annotations

import functools
import io
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# hidden 64, 4 heads (head_dim 16), 2 KV heads; cases override what they need
BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

QWEN3_5 = {  # Qwen3.5's linear-attention sizes, tied as the small Qwen3.5 models
    "num_hidden_layers": 4,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "tie_word_embeddings": True,
}
GEMMA4 = {  # alternating sliding (head size 16, 2 K/V heads) and full layers (32, 1 K/V head: the keys)
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "sliding_window": 8,
    "final_logit_softcapping": 5.0,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": None,  # the vocabulary's size (set by `make_checkpoint`)
}
TINY: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    # rope_freqs.weight: wavelengths of head_dim 16 / theta 1e4 straddle [64/4, 64/1], so factors are 1, smooth, 8
    "llama3": {
        "model_type": "llama",
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"model_type": "mistral", "sliding_window": 8},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},  # q/k/v biases; tied like Qwen2.5-0.5B
    "qwen3": {"model_type": "qwen3", "head_dim": 32},  # head_dim != hidden / heads; a multiple of 16: the C layer
    # 8 experts of width 32, 2 per token, renormalised (llama.cpp always renormalises qwen3moe's); Qwen2's BPE (the
    # converter takes no SentencePiece model for it), tied as in the smaller Qwen3 models
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "tie_word_embeddings": True,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    # layers [sliding, full]; caps small enough to bind on these logits
    "gemma2": {
        "model_type": "gemma2",
        "head_dim": 16,
        "query_pre_attn_scalar": 32,
        "sliding_window": 8,
        "attn_logit_softcapping": 10.0,
        "final_logit_softcapping": 5.0,
    },
    # llama.cpp's gemma3 assumes 5 sliding layers then 1 full (the GGUF has no pattern): 6 layers, HF's default
    # pattern 6; query_pre_attn_scalar == head_dim because llama.cpp always scales by 1/sqrt(head_dim)
    "gemma3_text": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
    # no sliding window: llama.cpp disables Phi-3 SWA
    "phi3": {"model_type": "phi3", "original_max_position_embeddings": 256, "sliding_window": None},
    # llama.cpp takes the long factors once its context (rounded up to 256) exceeds the original one
    "phi3-longrope": {
        "model_type": "phi3",
        "original_max_position_embeddings": 256,
        "max_position_embeddings": 512,
        "sliding_window": None,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [1.0 + 0.9 * i for i in range(8)],
        },
    },
    # Phi-4-mini's partial rotary (half of each head), and a context past the original one: the long factors
    "phi4-mini": {
        "model_type": "phi3",
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 16,
        "max_position_embeddings": 512,
        "sliding_window": None,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(4)],
            "long_factor": [1.0 + 2.5 * i for i in range(4)],
        },
    },
    # 8 experts of width 64, 2 per token; layers [sliding, full]; yarn as the released config (factor 32 over an
    # original context of 4096); gpt-oss's own BPE is not in llama.cpp's vocab files, so Qwen2's; untied, as
    # llama.cpp's gpt-oss requires an output matrix
    "gpt_oss": {
        "model_type": "gpt_oss",
        "head_dim": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "tie_word_embeddings": False,
    },
    # layers [linear, linear, linear, full] (HF's full_attention_interval 4); 2 key heads over 4 value heads
    "qwen3_5": {"model_type": "qwen3_5_text", **QWEN3_5},
    # Qwen3.5's layers with 8 experts of width 32, 2 per token, and a shared expert of width 48
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe_text",
        **QWEN3_5,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    # layers [sliding, full] x 3, the last two reading the K/V of the two before; full layers with their own head
    # size (32) and one K/V head whose values are the keys; per-layer inputs of 32 (a Q8_0 row: the GGUF's per-layer
    # projection goes through the kernels, as a released model's 256 does); the MLPs of the sharing layers doubled
    "gemma4": {
        "model_type": "gemma4_text",
        **GEMMA4,
        "num_hidden_layers": 6,
        "hidden_size_per_layer_input": 32,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
    },
    # Gemma 4's MoE layers: 8 experts of width 32, 2 per token, beside each layer's dense MLP
    "gemma4_moe": {
        "model_type": "gemma4_text",
        **GEMMA4,
        "num_hidden_layers": 4,
        "enable_moe_block": True,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    },
    "granite": {
        "model_type": "granite",
        "embedding_multiplier": 4.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 8.0,
    },
    "olmo2": {"model_type": "olmo2"},
    # HF's default no_rope_layers for 4 layers is [1, 1, 1, 0]: llama.cpp hard-codes "no RoPE on every 4th layer"
    "smollm3": {"model_type": "smollm3", "num_hidden_layers": 4},
}

# case -> tokenizer kind: "llama", "gemma" (SentencePiece, SPM_VOCAB) or "gpt2", "qwen2" (real byte-level BPE)
_KINDS = {
    "gemma2": "gemma",
    "gemma3_text": "gemma",
    "gemma4": "gemma",
    "gemma4_moe": "gemma",
    "olmo2": "gpt2",
    "qwen2": "qwen2",
    "qwen3_moe": "qwen2",
    "gpt_oss": "qwen2",
    "qwen3_5": "qwen2",
    "qwen3_5_moe": "qwen2",
}
TOKENIZER: dict[str, str] = {case: _KINDS.get(case, "llama") for case in TINY}

SPM_VOCAB = 768
MATRIX_STD, VECTOR_STD = 0.3, 0.1  # 2-D weights ~ N(0, 0.3^2) (peaked logits); 1-D ones get N(0, 0.1^2) added
CONVERT_TIMEOUT = 600

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "it",
    "an",
    "are",
    "were",
    "which",
    "be",
    "this",
    "had",
    "not",
    "or",
    "but",
    "have",
    "first",
    "one",
    "their",
    "its",
    "new",
    "after",
    "who",
    "they",
    "has",
    "two",
    "been",
    "all",
    "more",
    "when",
    "time",
    "she",
    "would",
    "there",
    "into",
    "other",
    "during",
    "where",
    "only",
    "some",
    "can",
    "most",
    "then",
    "such",
    "these",
    "years",
    "him",
    "over",
    "also",
    "used",
    "city",
    "world",
    "water",
    "house",
    "light",
    "night",
    "river",
    "stone",
    "music",
    "paper",
    "number",
    "system",
    "people",
    "model",
    "token",
    "speed",
    "draft",
    "target",
    "accept",
    "reject",
    "sample",
    "greedy",
    "cache",
    "layer",
    "head",
    "query",
    "key",
    "value",
]


class ConverterError(RuntimeError):
    """The converter or llama-quantize failed (the message ends with its last output lines)."""


# ---------------------------------------------------------------- checkpoints


def make_checkpoint(
    directory: Path | str, case: str, seed: int = 0, tokenizer: str | None = None, **overrides: Any
) -> Path:
    """Save a random fp32 `transformers` model of TINY[case] (plus config `overrides`, e.g. hidden_size=256,
    intermediate_size=512 for real K-quant blocks) and its tokenizer into `directory`; return `directory`.

    `tokenizer` picks another kind than TOKENIZER[case] (e.g. "llama" for an OLMo2 that is never converted: a
    768-token vocabulary instead of 50257)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    kind = tokenizer or TOKENIZER[case]
    extra = {**BASE, **TINY[case], **overrides}
    model_type = extra.pop("model_type")
    n_vocab, ids = _write_tokenizer(directory, kind)
    if "vocab_size_per_layer_input" in extra:  # Gemma 4's per-layer table: a row per token
        extra["vocab_size_per_layer_input"] = n_vocab
    if model_type == "gemma4_text":  # sliding and full layers alternating, as many of each
        extra["layer_types"] = ["sliding_attention", "full_attention"] * (extra["num_hidden_layers"] // 2)
    cfg = AutoConfig.for_model(model_type, **{"vocab_size": n_vocab, **ids, **extra})  # overrides may pad the vocab
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(str(directory))
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        _add_qwen3_5_mtp(directory, model, seed)
    return directory


def _add_qwen3_5_mtp(directory: Path, model: torch.nn.Module, seed: int) -> None:
    """One MTP block in Qwen3.5's released layout (`mtp.fc` over [embedding; hidden], its norms, a full-attention
    decoder layer `mtp.layers.0.*`, `mtp.norm`), random like the rest; transformers skips `mtp.*` when loading."""
    import json

    from safetensors.torch import load_file, save_file

    h = model.config.hidden_size
    full = model.config.layer_types.index("full_attention")
    layer = {f"layers.0.{n}": p for n, p in model.model.layers[full].state_dict().items()}
    shapes = {"fc.weight": (h, 2 * h), "pre_fc_norm_embedding.weight": (h,), "pre_fc_norm_hidden.weight": (h,)}
    shapes |= {"norm.weight": (h,)} | {n: tuple(p.shape) for n, p in layer.items()}
    g = torch.Generator().manual_seed(seed + 1)
    mtp = {
        f"mtp.{n}": torch.randn(shape, generator=g) * (MATRIX_STD if len(shape) > 1 else VECTOR_STD)
        for n, shape in sorted(shapes.items())
    }
    path = directory / "model.safetensors"
    save_file({**load_file(str(path)), **mtp}, str(path), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}, indent=2))


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Matrices ~ N(0, MATRIX_STD^2); vectors (norms, biases) get N(0, VECTOR_STD^2) added to their init, so norm
    weights and Gemma's zero-centred ones differ from their defaults."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(noise * MATRIX_STD)
            else:
                p.add_(noise * VECTOR_STD)


def _write_tokenizer(directory: Path, kind: str) -> tuple[int, dict[str, int | None]]:
    """Write tokenizer files of `kind` into `directory`; return (vocab size, config special-token ids)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = hf_tokenizer(kind)
    tok.save_pretrained(str(directory))
    if kind in ("llama", "gemma"):
        (directory / "tokenizer.model").write_bytes(spm_model(kind))
    ids = {
        f"{name}_token_id": tok.convert_tokens_to_ids(getattr(tok, f"{name}_token"))
        for name in ("bos", "eos", "pad")
        if getattr(tok, f"{name}_token", None) is not None
    }
    return len(tok), {"bos_token_id": None, "pad_token_id": None, **ids}


@functools.cache
def hf_tokenizer(kind: str):
    """The `transformers` tokenizer of `kind` (built once per process; only saved, never changed)."""
    if kind in ("llama", "gemma"):
        return _hf_from_spm(kind, spm_model(kind))
    if kind in ("gpt2", "qwen2"):
        return _hf_from_llama_vocab(kind)
    raise ValueError(f"unknown tokenizer kind {kind!r} (llama, gemma, gpt2, qwen2)")


def corpus(n: int = 3000) -> list[str]:
    """Fixed pseudo-English sentences (words, capitals, digits, punctuation) to train the SentencePiece models."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        words = []
        for _ in range(rng.randint(3, 14)):
            r = rng.random()
            if r < 0.08:
                words.append(str(rng.randint(0, 9999)))
            elif r < 0.12:
                words.append(rng.choice(",.;:!?()-'\""))
            elif r < 0.2:
                words.append(rng.choice(_WORDS).capitalize())
            else:
                words.append(rng.choice(_WORDS))
        out.append(" ".join(words))
    return out


@functools.cache
def spm_model(kind: str) -> bytes:
    """A SentencePiece BPE model (serialized) in Llama's ("llama") or Gemma's ("gemma") layout: byte fallback,
    split digits, identity normalisation; Llama: <unk>=0 <s>=1 </s>=2, dummy prefix; Gemma: <pad>=0 <eos>=1 <bos>=2
    <unk>=3 <mask>=4 <start_of_turn>=5 <end_of_turn>=6, no dummy prefix."""
    import sentencepiece as spm

    if kind == "llama":
        layout: dict[str, Any] = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1, "add_dummy_prefix": True}
    else:
        layout = {
            "pad_id": 0,
            "eos_id": 1,
            "bos_id": 2,
            "unk_id": 3,
            "pad_piece": "<pad>",
            "eos_piece": "<eos>",
            "bos_piece": "<bos>",
            "unk_piece": "<unk>",
            "add_dummy_prefix": False,
            "user_defined_symbols": ["<mask>", "<start_of_turn>", "<end_of_turn>"],
        }
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_writer=buf,
        vocab_size=SPM_VOCAB,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
        **layout,
    )
    return buf.getvalue()


def _hf_from_spm(kind: str, proto: bytes):
    """The `transformers` tokenizer equivalent to SentencePiece model `proto`: its pieces as a BPE vocabulary, merges
    ordered by the merged piece's score (what transformers' own converter does, without needing protobuf)."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import GemmaTokenizer, PreTrainedTokenizerFast

    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    normal = {
        sp.id_to_piece(i)
        for i in range(sp.get_piece_size())
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))
    }
    merges = []
    for piece in normal:
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                merges.append((-sp.get_score(vocab[piece]), vocab[piece], vocab[left], left, right))
    merges = [(left, right) for *_, left, right in sorted(merges)]
    if kind == "llama":
        # Llama 2's tokenizer.json pipeline: always one "▁" prepended, spaces -> "▁". Saved as a plain
        # TokenizersBackend: transformers 5's LlamaTokenizer would rebuild a Metaspace(prepend_scheme="first")
        # pipeline on load, which gives text starting with a space one "▁" less than SentencePiece and llama.cpp.
        backend = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
        )
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            unk_token="<unk>",
            bos_token="<s>",
            eos_token="</s>",
            add_bos_token=True,
            add_eos_token=False,
        )
    turns = [AddedToken(t, special=True, normalized=False) for t in ("<start_of_turn>", "<end_of_turn>")]
    return GemmaTokenizer(
        vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False, extra_special_tokens=turns
    )


def _hf_from_llama_vocab(kind: str):
    """GPT-2's or Qwen2's real byte-level BPE tokenizer, rebuilt from the vocab-only GGUF llama.cpp's tokenizer
    tests use (models/ggml-vocab-{gpt-2,qwen2}.gguf of the pinned source): the converter recognises its
    pre-tokenizer hash, and it encodes llama.cpp's own test strings to llama.cpp's expected ids."""
    import gguf
    from tokenizers import AddedToken
    from transformers import GPT2Tokenizer, Qwen2Tokenizer

    from specdec.models.gguf_convert import fast_reader_class

    name = {"gpt2": "gpt-2", "qwen2": "qwen2"}[kind]
    reader = fast_reader_class()(source() / "models" / f"ggml-vocab-{name}.gguf")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    normal, control = int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL)
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (normal, control)}  # not [PAD...]
    specials = [t for t, ty in zip(tokens, types) if ty == control]
    if kind == "gpt2":  # <|endoftext|> is BOS, EOS and UNK
        return GPT2Tokenizer(
            vocab=vocab,
            merges=merges,
            unk_token=specials[0],
            bos_token=specials[0],
            eos_token=specials[0],
            add_prefix_space=False,
        )
    # Qwen2: <|endoftext|> is EOS, PAD and UNK, no BOS; <|im_start|>, <|im_end|> are special
    return Qwen2Tokenizer(
        vocab=vocab, merges=merges, extra_special_tokens=[AddedToken(t, special=True) for t in specials[1:]]
    )


# ---------------------------------------------------------------- llama.cpp converter


def source() -> Path:
    """The unpacked pinned llama.cpp source (downloaded and unpacked once)."""
    from specdec.bench.llama_build import source_dir

    return source_dir(progress=False)


@functools.cache
def converter_available() -> tuple[bool, str]:
    """(True, "") when `convert()` can run; else (False, why), for `pytest.skip`."""
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        return False, "sentencepiece is not installed"
    from specdec.errors import SpecdecError

    try:
        script = source() / "convert_hf_to_gguf.py"
    except (SpecdecError, OSError) as e:
        return False, f"llama.cpp source unavailable: {e}"
    if not script.is_file() or not (script.parent / "gguf-py" / "gguf").is_dir():
        return False, f"{script} or its gguf-py is missing"
    return True, ""


def need_converter() -> Path:
    """The llama.cpp source, or skip the calling test."""
    import pytest

    ok, why = converter_available()
    if not ok:
        pytest.skip(why)
    return source()


def converter_env() -> dict[str, str]:
    """The environment of a converter run: the source's gguf-py first on PYTHONPATH, no hub access."""
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(source() / "gguf-py"), env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def convert(hf_dir: Path | str, outtype: str, out_path: Path | str, timeout: float = CONVERT_TIMEOUT) -> Path:
    """Convert checkpoint `hf_dir` to GGUF `out_path` ("f32", "f16", "bf16" or "q8_0") with the pinned converter."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(source() / "convert_hf_to_gguf.py"),
        str(hf_dir),
        "--outtype",
        outtype,
        "--outfile",
        str(out_path),
    ]
    _run(cmd, converter_env(), timeout, f"convert_hf_to_gguf.py {Path(hf_dir).name} --outtype {outtype}")
    if not out_path.is_file():
        raise ConverterError(f"convert_hf_to_gguf.py wrote no {out_path}")
    return out_path


def llama_quantize(src: Path | str, out: Path | str, qtype: str = "Q4_K_M", timeout: float = 300) -> Path | None:
    """Quantize GGUF `src` (f32/f16) to `out` with the `llama-quantize` built beside llama-server; None when that
    is not built (yet). Rows whose length is not a multiple of 256 fall back to 32-block types (Q4_K -> Q5_0,
    Q6_K -> Q8_0): K-quant blocks need hidden and intermediate sizes that are multiples of 256."""
    from specdec.bench.llama_build import cache_key, cmake_cpu_options, installed

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    server = installed(cache_key(cmake_cpu_options(cpuinfo)))
    tool = server.with_name("llama-quantize") if server is not None else None
    if tool is None or not tool.is_file():
        return None
    out = Path(out)
    _run([str(tool), str(src), str(out), qtype, "2"], dict(os.environ), timeout, f"llama-quantize {qtype}")
    if not out.is_file():
        raise ConverterError(f"llama-quantize wrote no {out}")
    return out


def _run(cmd: list[str], env: dict[str, str], timeout: float, what: str) -> None:
    try:
        res = subprocess.run(
            cmd,
            check=False,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise ConverterError(f"{what}: timed out after {timeout:.0f}s\n{tail}") from None
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-15:])
        raise ConverterError(f"{what}: exit {res.returncode}\n{tail}")


# ---------------------------------------------------------------- shared by the family tests (fixtures: conftest.py)

POSITIONS = 32
# settings llama.cpp's GGUF cannot carry (read from its source): the GGUF legs use checkpoints without them
GGUF_OVERRIDES = {
    "gemma2": {"query_pre_attn_scalar": 16},  # llama.cpp scales gemma2 queries by 1/sqrt(head_dim) (but the 27B)
    "mistral": {"sliding_window": None},  # the converter writes no window for the llama arch; llama.cpp has none
    # llama.cpp's yarn always rounds the correction dims (ggml_rope_yarn_corr_dims); gpt-oss's config says not to
    "gpt_oss": {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": True,
            "original_max_position_embeddings": 4096,
            "rope_theta": 150000.0,
        }
    },
}


@dataclass
class Files:
    hf: Path  # the checkpoint of TINY[case]
    gguf_hf: Path  # the checkpoint the GGUFs are converted from (GGUF_OVERRIDES applied)
    root: Path

    def gguf(self, kind: str) -> Path | None:
        """f32 / q8_0 from the converter, q4_k_m and mxfp4 (experts only, `MXFP4_MOE`) from llama-quantize (None
        where it is not built); made once, under a lock per file, by whichever test worker asks first."""
        from specdec.paths import file_lock

        out, part = self.root / f"{kind}.gguf", self.root / f"{kind}.partial.gguf"
        with file_lock(self.root / f"{kind}.lock"):
            if not out.exists():
                if kind not in ("q4_k_m", "mxfp4"):
                    convert(self.gguf_hf, kind, part)
                elif llama_quantize(self.gguf("f32"), part, {"q4_k_m": "Q4_K_M", "mxfp4": "MXFP4_MOE"}[kind]) is None:
                    return None
                part.replace(out)
        return out


def prompt_ids(directory: Path, n: int = POSITIONS) -> list[int]:
    """`n` token ids drawn from a fixed seed over the checkpoint's vocabulary."""
    import json

    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1)).tolist()
