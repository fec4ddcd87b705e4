"""Every model family against llama.cpp on the same GGUF: F32, Q8_0 (llama.cpp's converter) and Q4_K_M
(llama-quantize; at the tiny shapes of tests/families.py it writes Q5_0/Q8_0 blocks) against llama-server (f32 K/V):
our logprob of each of its greedy tokens within LOGPROB_TOL of its own, and our greedy tokens equal its own for 64
tokens but at a near-tie of its top two (closer than 2 LOGPROB_TOL); the same for the gemma3-270m pack (real weights).

Needs a llama-server build for this CPU (`bash scripts/conformance.sh` builds it, ~20-30 minutes on 2 cores) and skips
without one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from families import TINY, need_converter, prompt_ids

GENERATED, SERVER_CONTEXT = 64, 128
# llama.cpp's arithmetic differs from transformers' and ours: on these random models (peaked logits, errors grow
# through the layers) its F32 logprobs differ from transformers' by up to ~0.02 (ours: 1e-4), and on Q8_0 / Q4_K
# weights, where both quantize activations to 8 bits (its Q8_0 activation scales in fp16), from ours by up to ~0.35;
# gemma3-270m (Q4_K_M) median 0.002-0.04, max 0.32 over three prompts (measured on Zen 5)
LOGPROB_TOL = {"f32": 0.05, "q8_0": 0.4, "q4_k_m": 0.5, "real": 0.5}
# A mixture of experts routes each token to its top-k experts: where the k-th and the next expert's router logits are
# this close in any layer, the two arithmetics may choose differently, and the token's logits differ by far more
# than the tolerance (qwen3_moe, F32: a logit gap of 3e-5 flipped; Q4_K_M, Q5_0 blocks: a gap of 0.035 flipped, and
# with llama.cpp's choice forced our logprob came within 0.08 of its own). Those positions are excused.
ROUTE_TIE = {"f32": 1e-3, "q8_0": 0.05, "q4_k_m": 0.1, "real": 0.1}
# gpt-oss's experts as MXFP4 (llama-quantize MXFP4_MOE), through llama.cpp's MXFP4 kernels and ours (the same weights:
# tests/test_gguf_kernels.py), each with its own activation rounding. Its coarse weights flip routes up to a
# router-logit gap of ~0.3 (a flip at a gap of 0.2-0.3 put that position 1.98 off), and a flip in the first layer
# changes the K/V later positions read (0.71 off two positions on); the other positions agree within 0.23
MXFP4_TOL, MXFP4_TIE = 1.0, 0.3
# Qwen3.5-MoE, quantized: a route flip also moves the recurrent state that every later position reads (attention
# dilutes a flipped key among the others; a delta-rule state carries it on), so flips weigh more and further on: on
# Q8_0 a flip at a router gap of 0.081 put that position 1.13 off, one at 0.015 the next position 0.49 off
RECURRENT_MOE = {"qwen3_5_moe": (1.0, {"q8_0": 0.1, "q4_k_m": 0.15})}


@contextmanager
def llama_server(gguf: Path, method: str = "llama-none", draft_max: int = 0, draft: Path | None = None) -> Iterator:
    """A `LlamaServer` (specdec/bench/llama.py) on `gguf` with f32 K/V, one slot, greedy; `method` one of its
    LLAMA_METHODS at `draft_max` tokens a step (`draft`: its -md GGUF); skips without a llama-server built for this
    CPU."""
    from specdec.bench.llama import LlamaServer, ServerConfig, server_help
    from specdec.bench.llama_build import cache_key, cmake_cpu_options, installed

    binary = installed(cache_key(cmake_cpu_options(Path("/proc/cpuinfo").read_text())))
    if binary is None:
        pytest.skip("no llama-server built for this CPU (bash scripts/conformance.sh builds it)")
    cfg = ServerConfig(
        str(binary),
        gguf,
        draft,
        1,
        2 * SERVER_CONTEXT,
        0.0,
        draft_max,
        0,
        0.0,
        0,
        0,
        extra=("-ctk", "f32", "-ctv", "f32"),
    )
    server = LlamaServer(method, cfg, server_help(str(binary)), gguf.with_suffix(f".{method}.log"))
    try:
        yield server
    finally:
        server.close()


def _llama_greedy(gguf: Path, ids: list[int], n: int) -> list[tuple[int, list[tuple[int, float]]]]:
    """llama-server's greedy tokens for prompt `ids`, each with its top two (id, logprob) (empty for a token its
    probabilities leave out: it holds back a token that ends inside a UTF-8 character)."""
    with llama_server(gguf) as server:
        resp = server.complete(
            {
                "prompt": ids,
                "n_predict": n,
                "temperature": 0.0,
                "n_probs": 2,
                "cache_prompt": False,
                "return_tokens": True,
                "ignore_eos": True,
            }
        )
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
def test_gguf_greedy_equals_llama_cpp(family_files, family_home, case, kind):
    """Our logprobs and greedy tokens against llama-server's on the same file (`_check_against_llama`)."""
    import specdec

    need_converter()
    f = family_files(case)
    path = f.gguf(kind)
    if path is None:
        pytest.skip("no llama-quantize built for this CPU (bash scripts/conformance.sh builds it)")
    llm = specdec.LLM(str(path), spec_type="none", context=SERVER_CONTEXT, progress=False)
    tol, tie = LOGPROB_TOL[kind], ROUTE_TIE[kind]
    if case in RECURRENT_MOE and kind != "f32":
        tol, tie = RECURRENT_MOE[case][0], RECURRENT_MOE[case][1][kind]
    _check_against_llama(llm, path, prompt_ids(f.gguf_hf)[:8], GENERATED, tol, tie)


def test_gpt_oss_mxfp4_greedy_equals_llama_cpp(family_files, family_home):
    """gpt-oss with its experts in MXFP4, as its released GGUFs store them."""
    import specdec

    need_converter()
    path = family_files("gpt_oss").gguf("mxfp4")
    if path is None:
        pytest.skip("no llama-quantize built for this CPU (bash scripts/conformance.sh builds it)")
    llm = specdec.LLM(str(path), spec_type="none", context=SERVER_CONTEXT, progress=False)
    _check_against_llama(llm, path, prompt_ids(family_files("gpt_oss").gguf_hf)[:8], GENERATED, MXFP4_TOL, MXFP4_TIE)


@pytest.mark.real
def test_gemma3_270m_greedy_equals_llama_cpp():
    """The gemma3-270m pack (Gemma 3 270M, Q4_K_M, real weights): three prompts, 128 tokens each."""
    import specdec
    from specdec.models.packs import pack_gguf

    path = pack_gguf("gemma3-270m", progress=False)
    llm = specdec.LLM("gemma3-270m", spec_type="none", context=SERVER_CONTEXT * 2, progress=False)
    for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"):
        _check_against_llama(llm, path, llm.encode(text), 128, LOGPROB_TOL["real"])


def _check_against_llama(
    llm, path: Path, prompt: list[int], n: int, tol: float, route_tie: float = ROUTE_TIE["real"]
) -> None:
    """On llama-server's greedy tokens for `prompt` (teacher-forced), our logprob of each is within `tol` of its own,
    and our greedy tokens equal its own up to a near-tie (its top two closer than 2 `tol`, or a routing tie)."""
    theirs = _llama_greedy(path, prompt, n)
    llm.engine.stop_ids = set()
    tokens = [t for t, _ in theirs]
    with _routing_ties(llm, route_tie) as ties:
        logprobs = torch.log_softmax(llm.runner.forward([prompt + tokens], [0], [0])[0], -1)[len(prompt) - 1 :]
    tied = {p - len(prompt) + 1 for p in ties}
    checked = [(i, top) for i, (_, top) in enumerate(theirs) if top and i not in tied]
    assert len(checked) >= n // 2, (path.name, "routing ties at", sorted(tied))
    worst = max((abs(float(logprobs[i, top[0][0]]) - top[0][1]), i) for i, top in checked)
    assert worst[0] <= tol, (path.name, "position", worst[1], worst[0])
    ours = llm.generate(prompt, max_tokens=n).token_ids
    split = next((i for i, (a, b) in enumerate(zip(ours, tokens)) if a != b), None)
    if split is not None and split not in tied:  # a near-tie by llama.cpp's logprobs, or ours where it left them out
        top = theirs[split][1] or [(t, float(logprobs[split, t])) for t in (ours[split], tokens[split])]
        assert abs(top[0][1] - top[1][1]) < 2 * tol, (path.name, split, top)


@contextmanager
def _routing_ties(llm, gap: float) -> Iterator[set[int]]:
    """Positions of the next forward (its only sequence) where a mixture-of-experts layer's k-th and next router
    logits (bias included) are within `gap`; empty for a dense model. Each layer's `route` is wrapped, and the layers
    run their Python path, which calls it (the C layers route inside C, to the same bits)."""
    from specdec.models.transformer import MoE, row_by_row
    from specdec.runtime.layer_kernel import LayerKernel, LayerStack

    ties: set[int] = set()
    c_paths = LayerKernel.run, LayerStack.run

    def watch(moe: MoE):
        route = moe.route

        def traced(rows: torch.Tensor):
            logits = row_by_row(moe.gate, rows).sort(-1, descending=True).values
            ties.update((logits[:, moe.top_k - 1] - logits[:, moe.top_k] < gap).nonzero()[:, 0].tolist())
            return route(rows)

        return traced

    moes = [m for m in llm.runner.model.modules() if isinstance(m, MoE)]
    for m in moes:
        m.route = watch(m)
    if moes:
        LayerKernel.run = LayerStack.run = lambda *args: None
    try:
        yield ties
    finally:
        LayerKernel.run, LayerStack.run = c_paths
        for m in moes:
            del m.route
