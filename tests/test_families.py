"""Every model family against its references, from tiny random checkpoints made by `transformers` (tests/families.py):

1. the checkpoint directory: our logits equal transformers' in fp32 over 32 positions;
2. llama.cpp's own converter (the pinned source's convert_hf_to_gguf.py) to F32: the same, both ways we load a GGUF
   (its tensors directly, and the converted checkpoint directory);
3. F32, Q8_0 (the converter) and Q4_K_M (llama-quantize) against llama-server (f32 K/V) on the same file: our
   logprob of each of its greedy tokens within LOGPROB_TOL of its own, and our greedy tokens equal its own for 64
   tokens, but at a near-tie of its top two (closer than 2 LOGPROB_TOL); the same for the gemma3-270m pack;
4. speculative greedy decoding (ngram-simple, and the same-family draft model) equals plain decoding on the Q8_0
   file, with tokens drafted and accepted.

Steps 1, 2 and 4 need only Python; step 3 needs a llama-server build (`bash scripts/conformance.sh` builds it, ~20
minutes on 2 cores) and skips without one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from families import TINY, convert, llama_quantize, make_checkpoint, need_converter

TOL = 1e-4
POSITIONS = 32
GENERATED, SERVER_CONTEXT = 64, 128
# llama.cpp's arithmetic differs from transformers' and ours: on these random models (peaked logits, errors grow
# through the layers) its F32 logprobs differ from transformers' by up to ~0.02, and it quantizes activations to
# 8 bits for Q8_0 / Q4_K weights (ours stay float32): up to ~0.35; gemma3-270m (Q4_K_M) median 0.002-0.04, max 0.32
# over three prompts (measured on Zen 5)
LOGPROB_TOL = {"f32": 0.05, "q8_0": 0.4, "q4_k_m": 0.5, "real": 0.5}
# settings llama.cpp's GGUF cannot carry (read from its source): the GGUF legs use checkpoints without them
GGUF_OVERRIDES = {
    "gemma2": {"query_pre_attn_scalar": 16},  # llama.cpp scales gemma2 queries by 1/sqrt(head_dim) (but the 27B)
    "mistral": {"sliding_window": None},      # the converter writes no window for the llama arch; llama.cpp has none
}


@dataclass
class Files:
    hf: Path         # the checkpoint of TINY[case]
    gguf_hf: Path    # the checkpoint the GGUFs are converted from (GGUF_OVERRIDES applied)
    root: Path

    def gguf(self, kind: str) -> Path:
        """f32 / q8_0 from the converter, q4_k_m from llama-quantize (None where it is not built)."""
        out = self.root / f"{kind}.gguf"
        if not out.exists():
            if kind == "q4_k_m":
                return llama_quantize(self.gguf("f32"), out, "Q4_K_M")
            convert(self.gguf_hf, kind, out)
        return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    made: dict[str, Files] = {}

    def get(case: str) -> Files:
        if case not in made:
            root = tmp_path_factory.mktemp(case)
            hf = make_checkpoint(root / "hf", case)
            gguf_hf = make_checkpoint(root / "hf-gguf", case, **GGUF_OVERRIDES[case]) if case in GGUF_OVERRIDES else hf
            made[case] = Files(hf, gguf_hf, root)
        return made[case]
    return get


@pytest.fixture(scope="module", autouse=True)
def home(tmp_path_factory):
    """Conversions and tokenizers of these files go to a throwaway SPECDEC_HOME; the llama.cpp source and build stay
    where they are cached."""
    from specdec.bench import llama_build

    mp = pytest.MonkeyPatch()
    mp.setattr(llama_build, "root", lambda cached=llama_build.root(): cached)
    mp.setenv("SPECDEC_HOME", str(tmp_path_factory.mktemp("home")))
    yield
    mp.undo()


def _ids(directory: Path) -> list[int]:
    import json

    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    return torch.randint(0, vocab, (POSITIONS,), generator=torch.Generator().manual_seed(1)).tolist()


def _transformers(directory: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _ours(model, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] over `ids` in two chunks (the second reads the first's K/V from the cache)."""
    from specdec.runtime.runner import ModelRunner

    runner = ModelRunner(model, num_slots=1, context=2 * POSITIONS)
    split = 20
    return torch.cat([runner.forward([ids[:split]], [0], [0])[0], runner.forward([ids[split:]], [split], [0])[0]])


@pytest.mark.parametrize("case", list(TINY))
def test_checkpoint_logits_equal_transformers(files, case):
    from specdec.models.loader import load_checkpoint

    d = files(case).hf
    ids = _ids(d)
    model, _ = load_checkpoint(d, torch.float32)
    diff = (_ours(model, ids) - _transformers(d, ids)).abs().max()
    assert diff <= TOL, (case, float(diff))


@pytest.mark.parametrize("case", list(TINY))
def test_f32_gguf_logits_equal_transformers(files, case):
    from specdec.models.gguf_quantized import load_gguf_quantized
    from specdec.models.loader import converted_gguf, load_checkpoint

    need_converter()
    f = files(case)
    path, ids = f.gguf("f32"), _ids(f.gguf_hf)
    ref = _transformers(f.gguf_hf, ids)
    direct, _ = load_gguf_quantized(path, torch.float32)
    via_dir, _ = load_checkpoint(converted_gguf(path, progress=False), torch.float32)
    for how, model in (("gguf", direct), ("converted", via_dir)):
        diff = (_ours(model, ids) - ref).abs().max()
        assert diff <= TOL, (case, how, float(diff))


def _llama_greedy(gguf: Path, ids: list[int], n: int) -> list[tuple[int, list[tuple[int, float]]]]:
    """llama-server's greedy tokens for prompt `ids`, each with its top two (id, logprob) (empty for a token its
    probabilities leave out: it holds back a token that ends inside a UTF-8 character)."""
    from specdec.bench.llama import LlamaServer, ServerConfig, server_help
    from specdec.bench.llama_build import cache_key, cmake_cpu_options, installed

    binary = installed(cache_key(cmake_cpu_options(Path("/proc/cpuinfo").read_text())))
    if binary is None:
        pytest.skip("no llama-server built for this CPU (bash scripts/conformance.sh builds it)")
    cfg = ServerConfig(str(binary), gguf, None, 1, 2 * SERVER_CONTEXT, 0.0, 0, 0, 0.0, 0, 0,
                       extra=("-ctk", "f32", "-ctv", "f32"))
    server = LlamaServer("llama-none", cfg, server_help(str(binary)), gguf.with_suffix(".log"))
    try:
        resp = server.complete({"prompt": ids, "n_predict": n, "temperature": 0.0, "n_probs": 2,
                                "cache_prompt": False, "return_tokens": True, "ignore_eos": True})
    finally:
        server.close()
    probs, out = iter(resp["completion_probabilities"]), []
    p = next(probs, None)
    for token in resp["tokens"]:
        top = []
        if p is not None and p["id"] == token:
            top = [(e["id"], e["logprob"]) for e in p["top_logprobs"][:2]]
            p = next(probs, None)
        out.append((token, top))
    return out


@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("case", list(TINY))
def test_gguf_greedy_equals_llama_cpp(files, case, kind):
    """Our logprobs and greedy tokens against llama-server's on the same file (`_check_against_llama`)."""
    import specdec

    need_converter()
    f = files(case)
    path = f.gguf(kind)
    if path is None:
        pytest.skip("no llama-quantize built for this CPU (bash scripts/conformance.sh builds it)")
    llm = specdec.LLM(str(path), spec_type="none", context=SERVER_CONTEXT, progress=False)
    _check_against_llama(llm, path, _ids(f.gguf_hf)[:8], GENERATED, LOGPROB_TOL[kind])


@pytest.mark.real
def test_gemma3_270m_greedy_equals_llama_cpp():
    """The gemma3-270m pack (Gemma 3 270M, Q4_K_M, real weights): three prompts, 128 tokens each."""
    import specdec
    from specdec.models.packs import pack_gguf

    path = pack_gguf("gemma3-270m", progress=False)
    llm = specdec.LLM("gemma3-270m", spec_type="none", context=SERVER_CONTEXT * 2, progress=False)
    for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"):
        _check_against_llama(llm, path, llm.encode(text), 128, LOGPROB_TOL["real"])


def _check_against_llama(llm, path: Path, prompt: list[int], n: int, tol: float) -> None:
    """On llama-server's greedy tokens for `prompt` (teacher-forced), our logprob of each is within `tol` of its own,
    and our greedy tokens equal its own up to a near-tie (its top two closer than 2 `tol`)."""
    theirs = _llama_greedy(path, prompt, n)
    llm.engine.stop_ids = set()
    tokens = [t for t, _ in theirs]
    logprobs = torch.log_softmax(llm.runner.forward([prompt + tokens], [0], [0])[0], -1)[len(prompt) - 1:]
    worst = max((abs(float(logprobs[i, top[0][0]]) - top[0][1]), i) for i, (_, top) in enumerate(theirs) if top)
    assert worst[0] <= tol, (path.name, "position", worst[1], worst[0])
    ours = llm.generate(prompt, max_tokens=n).token_ids
    split = next((i for i, (a, b) in enumerate(zip(ours, tokens)) if a != b), None)
    if split is not None:  # a near-tie by llama.cpp's logprobs, or ours where it left them out
        top = theirs[split][1] or [(t, float(logprobs[split, t])) for t in (ours[split], tokens[split])]
        assert abs(top[0][1] - top[1][1]) < 2 * tol, (path.name, split, top)


@pytest.mark.parametrize("case", list(TINY))
def test_speculative_greedy_equals_plain(files, case):
    import specdec

    need_converter()
    f = files(case)
    path = str(f.gguf("q8_0"))
    llm = specdec.LLM(path, draft=path, spec_type="none", context=128, progress=False, ngram_n=1)
    llm.engine.stop_ids = set()
    llm.engine.spec.adaptive, llm.engine.spec.draft_max = False, 4
    prompt, drafted = _ids(f.gguf_hf)[:6] * 3, {}
    for _ in range(4):  # a prompt holding its own first greedy token, so that a 1-gram matches at once
        base = llm.generate(prompt, max_tokens=40).token_ids
        for spec in ("ngram-simple", "draft"):
            r = llm.generate(prompt, max_tokens=40, spec_type=spec)
            assert r.token_ids == base, (case, spec)
            drafted[spec] = drafted.get(spec, 0) + r.stats.drafted
            assert spec != "draft" or r.stats.accepted > 0, case  # the target as its own draft: all accepted
        if drafted["ngram-simple"]:
            break
        prompt = base[:1] + prompt
    assert drafted["ngram-simple"] > 0 and drafted["draft"] > 0, (case, drafted)
