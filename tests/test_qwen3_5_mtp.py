"""Qwen3.5's own MTP layer (`--spec-type mtp`, models/mtp.py) on tiny checkpoints of tests/families.py:

1. its logits equal a reference made of transformers' Qwen3.5 modules (transformers loads no MTP layer: a one-layer
   full-attention `Qwen3_5TextModel` holding `mtp.layers.0` and `mtp.norm`, fed fc([enorm(e); hnorm(h)]));
2. a block that copies the target's full-attention layer (the linear layer before it zeroed) is mostly accepted,
   from the HF directory and from llama.cpp's GGUF (nextn block), and the output is the plain one;
3. at the same draft length, greedy, llama-server's `--spec-type draft-mtp` drafts and accepts as many tokens
   (`timings.draft_n` / `draft_n_accepted`) on a copy whose attention adds nothing (a bigram model): llama.cpp
   pairs token P+1 with state P at position P+1 and also feeds token 0 with a zero state at position 0
   (common/speculative.cpp, draft-mtp `process`), where we, like vLLM and the MTP training layout, start at
   (token 1, state 0); with attention the two differ by that first entry (on the copy below: 28 of 30 accepted
   there, 20 of 56 here);
4. `specdec models list FILE` says that a model ships MTP layers;
5. sampling through the engine with its MTP layer samples the target's distribution (rollbacks included).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from families import make_checkpoint, need_converter, prompt_ids

import specdec

DRAFT_MAX, TOKENS = 3, 40


@pytest.fixture(autouse=True)
def _home(family_home):
    pass


def test_mtp_logits_equal_a_transformers_reference(family_files):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5TextModel

    from specdec.models.mtp import load_native

    d = family_files("qwen3_5").hf
    ids = prompt_ids(d, 16)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    mtp = {
        k.removeprefix("mtp."): v for k, v in load_file(str(d / "model.safetensors")).items() if k.startswith("mtp.")
    }
    cfg = copy.deepcopy(hf.config)
    cfg.num_hidden_layers, cfg.layer_types = 1, ["full_attention"]
    block = Qwen3_5TextModel(cfg).eval()
    block.load_state_dict(
        {"embed_tokens.weight": hf.model.embed_tokens.weight, "norm.weight": mtp["norm.weight"]}
        | {k: v for k, v in mtp.items() if k.startswith("layers.")}
    )
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        norms[name] = Qwen3_5RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norms[name].weight.data = mtp[f"{name}.weight"]
    with torch.no_grad():
        g = hf.model(torch.tensor([ids[:-1]])).last_hidden_state  # [1, T, H] post-norm states of tokens 0..T-1
        e = hf.model.embed_tokens(torch.tensor([ids[1:]]))  # the embeddings of tokens 1..T
        x = torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](g)], dim=-1) @ mtp["fc.weight"].T
        ref = hf.lm_head(block(inputs_embeds=x).last_hidden_state)[0]
        head = load_native(d).share(hf.lm_head)
        ours = head.packed(e, g)[0][0]
    assert (ours - ref).abs().max() <= 1e-4


def _copy_checkpoint(directory: Path, attention: bool = True) -> Path:
    """A [linear, full] Qwen3.5 whose linear layer adds nothing (out_proj and down_proj zero) and whose embeddings
    have RMS 1, with an MTP block copying its full-attention layer: fc passes the embedding through and drops h, the
    norms before it scale by 1, mtp.norm is the final norm. At position P the block runs the target's computation for
    token P+1 over tokens 1..P+1 (rotary is relative): it guesses the target's next token but for the missing token 0,
    if pairs and positions line up. Without `attention` the full-attention layer's o_proj is zero too: a bigram
    model, whose copy guesses right wherever pairs line up."""
    from safetensors.torch import load_file, save_file

    make_checkpoint(directory, "qwen3_5", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    path = directory / "model.safetensors"
    state = load_file(str(path))
    emb = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = emb * emb.pow(2).mean(-1, keepdim=True).rsqrt()
    zeroed = ["model.layers.0.linear_attn.out_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    for name in zeroed + ([] if attention else ["model.layers.1.self_attn.o_proj.weight"]):
        state[name] = torch.zeros_like(state[name])
    H = emb.shape[1]
    for k in [k for k in state if k.startswith("mtp.")]:
        del state[k]
    state |= {k.replace("model.layers.1.", "mtp.layers.0."): v for k, v in state.items() if ".layers.1." in k}
    state |= {
        "mtp.fc.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(H),  # zero-centred: a scale of 1
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(H),
        "mtp.norm.weight": state["model.norm.weight"],
    }
    save_file({k: v.clone() for k, v in state.items()}, str(path), {"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def copied(tmp_path_factory) -> Path:
    return _copy_checkpoint(tmp_path_factory.mktemp("qwen35-mtp") / "hf")


def _ours(model: str, ids: list[int]) -> tuple[list[int], int, int]:
    """(plain greedy tokens, drafted, accepted) with --spec-type mtp at DRAFT_MAX tokens a step."""
    llm = specdec.LLM(model, spec_type="mtp", context=128, progress=False, adaptive=False, draft_max=DRAFT_MAX)
    llm.engine.stop_ids = set()
    plain = llm.generate(ids, max_tokens=TOKENS, spec_type="none").token_ids
    r = llm.generate(ids, max_tokens=TOKENS)
    assert r.token_ids == plain, model
    return plain, r.stats.drafted, r.stats.accepted


def test_a_copy_of_the_target_layer_is_accepted(copied, tmp_path):
    from families import convert

    need_converter()
    ids = prompt_ids(copied, 8)
    for model in (copied, convert(copied, "f32", tmp_path / "f32.gguf")):
        _, drafted, accepted = _ours(str(model), ids)
        assert accepted > 0.3 * drafted > 0, (model, drafted, accepted)


def test_drafted_and_accepted_as_llama_cpp_draft_mtp(tmp_path):
    from families import convert
    from test_families_llama_cpp import llama_server

    need_converter()
    bigram = _copy_checkpoint(tmp_path / "hf", attention=False)
    gguf = convert(bigram, "f32", tmp_path / "f32.gguf")
    ids = prompt_ids(bigram, 8)
    plain, drafted, accepted = _ours(str(gguf), ids)
    with llama_server(gguf, "llama-mtp", DRAFT_MAX) as server:
        body = {"prompt": ids, "n_predict": TOKENS, "temperature": 0.0, "cache_prompt": False, "ignore_eos": True}
        resp = server.complete({**body, "return_tokens": True})
    timings = resp["timings"]
    assert resp["tokens"] == plain
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (drafted, accepted), timings
    assert accepted > 0, timings


def test_models_list_shows_the_mtp_layers(family_files, capsys):
    from specdec.cli import main

    need_converter()
    f = family_files("qwen3_5")
    assert main(["models", "list", str(f.hf), str(f.gguf("q8_0"))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all("qwen3_5, 4 layers (3 linear-attention), 1 MTP layer (--spec-type mtp)" in line for line in lines), lines


def test_sampling_through_the_engine_matches_plain(tmp_path):
    """Rejection sampling with the MTP layer of a [linear, full] Qwen3.5 (vocabulary 8) samples the target's
    distribution, its recurrent state rolled back on each rejection (the EAGLE-3 test's runs and bounds)."""
    from conftest import word_tokenizer
    from families import QWEN3_5, _add_qwen3_5_mtp
    from test_eagle3 import V, engine_fit
    from transformers import AutoConfig, AutoModelForCausalLM

    layers = ["linear_attention", "full_attention"]
    sizes = {**QWEN3_5, "num_hidden_layers": 2, "layer_types": layers}
    cfg = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        eos_token_id=0,
        **sizes,
    )
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # peaked logits, as tests/conftest.py's tiny models
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(str(tmp_path))
    word_tokenizer(tmp_path, V)
    _add_qwen3_5_mtp(tmp_path, model, 3)
    drafted, p_value, tv, bound = engine_fit(tmp_path, spec_type="mtp")
    assert drafted > 0 and p_value > 1e-3 and tv < bound, (drafted, p_value, tv)
