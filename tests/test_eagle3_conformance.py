"""EAGLE-3 conformance with other implementations of the same head.

speculators 0.9.0 (a test-only dependency, see scripts/test.sh): with the same random fp32 weights, our head and
`speculators.Eagle3DraftModel` give the same draft logits, for heads exported by `save_speculators` and loaded by
`SpeculatorModel.from_pretrained`, and for checkpoints written by speculators' own `save_pretrained` and loaded by
`load_head`. Inputs map one to one:
- their `hidden_states` [1, n, 3 * H] = our aux features [n, 3, H] flattened layer-major (`Eagle3Head.fuse`);
- their `input_ids[i]` goes with `hidden_states[i]` (after `shift_batch`: token P+1 with the feature of P), our pair
  (token[P+1], g[P]) likewise;
- their default `position_ids` are 1 + i (the token's position), ours P = i: RoPE is relative, so logits agree to
  rounding;
- their TTT step s at row i (keys: step-0 rows 0..i and its own rows of steps 1..s, position +s, token ids[i+s], the
  previous step's pre-norm output) is our chain drafting from i through the KV cache, s steps on.

llama.cpp (the pinned source, when cached): its `convert_hf_to_gguf.py` converts our `save_head` and
`save_speculators` directories, and `save_gguf` writes the same tensors (bit for bit) and `eagle3.*` keys.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specdec.bench.llama_build import SOURCE_TAG, root
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, load_head, save_head, save_speculators
from specdec.models.eagle3_gguf import gguf_tensors, permute, save_gguf
from specdec.models.gguf_convert import unpermute
from specdec.models.loader import load_checkpoint
from specdec.models.transformer import Batch
from specdec.runtime.kv_cache import KVCache


def _llama_cpp_source() -> Path | None:
    """The pinned llama.cpp source when `specdec bench --llama-server auto` has unpacked it."""
    src = root() / "src" / SOURCE_TAG
    return src / "vendor" / "llama.cpp" if (src / ".complete").is_file() else None


LLAMA_CPP = _llama_cpp_source()
needs_speculators = pytest.mark.skipif(
    importlib.util.find_spec("speculators") is None,
    reason="speculators==0.9.0 not installed (test-only: scripts/test.sh)",
)
N, STEPS, DRAFT_VOCAB = 128, 3, 80  # N: one block of flex attention (its TTT mask extension is per 128 rows)
CHAIN_ROWS = (*range(0, N - 2, 9), N - 2)  # rows our chains start from (steps past the end are skipped)


def random_head(c: Eagle3Config, seed: int = 0) -> Eagle3Head:
    """Every weight random (norms around 1), a scattered draft vocabulary (so d2t offsets matter)."""
    head = Eagle3Head(c)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    head.set_vocab(torch.randperm(c.vocab_size, generator=g)[: c.draft_vocab_size])
    return head.eval()


def head_for(target: Path, rope_theta: float = 50000.0) -> tuple[Eagle3Head, torch.nn.Embedding]:
    """A random head for the checkpoint in `target` (aux layers 0, 1, 2) and the target's embeddings."""
    model, _ = load_checkpoint(target, torch.float32)
    c = dataclasses.replace(
        Eagle3Config.for_target(model.config, DRAFT_VOCAB, aux_layers=(0, 1, 2)), rope_theta=rope_theta
    )
    return random_head(c), model.model.embed_tokens


def inputs(c: Eagle3Config, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Target features aux [N, 3, Ht] and the tokens paired with them [N]."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(N, len(c.aux_layers), c.target_hidden_size, generator=g)
    return aux, torch.randint(0, c.vocab_size, (N,), generator=g)


def _feed(head: Eagle3Head, cache: KVCache, emb: torch.Tensor, g: torch.Tensor, start: int):
    """Pairs (emb[j], g[j]) [n, H] at positions start.. into slot 0 (causal) -> (logits [n, Vd], h [n, H])."""
    n = len(emb)
    positions = torch.arange(start, start + n)[None]  # [1, n]
    cos, sin = head.rotary.tables(positions, torch.float32)
    mask = (torch.arange(start + n)[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [1, 1, n, S]
    slots = torch.tensor([0])
    batch = Batch(slots, positions, cos, sin, mask, start + n, KVCache.span(slots, positions))
    logits, h = head(emb[None], g[None], batch, cache)
    return logits[0], h[0]


@torch.no_grad()
def our_logits(head: Eagle3Head, embed: torch.nn.Embedding, aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[STEPS, N, Vd]: step 0 teacher-forced over all rows (causal), step s the chain drafted from row i in
    CHAIN_ROWS (rows 0..i fed, then ids[i+s] with the recycled pre-norm state); NaN elsewhere."""
    c = head.config
    cache = KVCache.allocate(1, 1, c.num_kv_heads, N + STEPS, c.head_dim, torch.float32)
    g, emb = head.fuse(aux), embed(ids)  # [N, H] each
    out = torch.full((STEPS, N, c.draft_vocab_size), float("nan"))
    out[0] = _feed(head, cache, emb, g, 0)[0]
    for i in CHAIN_ROWS:
        logits, h = _feed(head, cache, emb[: i + 1], g[: i + 1], 0)
        h = h[-1:]
        for s in range(1, min(STEPS, N - i)):
            logits, h = _feed(head, cache, emb[i + s : i + s + 1], h, i + s)
            out[s, i] = logits[-1]
    return out


@torch.no_grad()
def speculators_logits(model, aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[STEPS, N, Vd] from `Eagle3DraftModel.forward` (TTT steps, its default positions), read at its lm_head."""
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out[0]))
    try:
        model(
            hidden_states=aux.flatten(-2)[None],
            input_ids=ids[None],
            document_ids=torch.zeros(1, N, dtype=torch.long),
            ttt_steps=STEPS,
        )
    finally:
        hook.remove()
    return torch.stack(seen)


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    valid = ~ours.isnan()
    assert valid[0].all() and valid[1:].any(-1).sum() > len(CHAIN_ROWS)  # step 0 everywhere, chains from each row
    torch.testing.assert_close(ours[valid], theirs[valid], rtol=1e-4, atol=1e-4)


@needs_speculators
def test_speculators_loads_our_export_with_the_same_logits(tiny_dir, tmp_path):
    from speculators import Eagle3DraftModel, SpeculatorModel

    target = tiny_dir("llama", layers=3)
    head, embed = head_for(target)
    save_speculators(head, tmp_path / "head", str(target), speculative_tokens=STEPS, embeddings=embed.weight)
    model = SpeculatorModel.from_pretrained(str(tmp_path / "head")).eval()
    assert isinstance(model, Eagle3DraftModel) and model.target_layer_ids == [0, 1, 2]
    assert torch.equal(model.d2t, head.d2t) and torch.equal(model.t2d, head.t2d)
    torch.testing.assert_close(model.embed_tokens.weight, embed.weight, rtol=0, atol=0)
    cfg = model.config
    assert cfg.speculators_config.proposal_methods[0].speculative_tokens == STEPS
    assert cfg.transformer_layer_config.rope_parameters["rope_theta"] == head.config.rope_theta
    aux, ids = inputs(head.config)
    assert_same_logits(our_logits(head, embed, aux, ids), speculators_logits(model, aux, ids))


@needs_speculators
def test_speculators_checkpoint_loads_as_our_head(tmp_path):
    """A checkpoint speculators itself writes (transformers 5 `rope_parameters`, its own embed_tokens, d2t/t2d)."""
    from speculators import Eagle3DraftModel, Eagle3SpeculatorConfig, SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=20000.0,
        tie_word_embeddings=False,
    )
    spec = SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=DRAFT_VOCAB,
        eagle_aux_hidden_state_layer_ids=[1, 4, 7],
        speculators_config=spec,
    )
    model = Eagle3DraftModel(config).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    vocab = torch.randperm(96, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(96, dtype=torch.bool).index_fill(0, vocab, True)
    model.load_vocab_mappings(t2d, vocab - torch.arange(DRAFT_VOCAB))  # d2t: offsets
    model.save_pretrained(str(tmp_path / "spec"))
    head = load_head(tmp_path / "spec")
    c = head.config
    assert (c.aux_layers, c.rope_theta, c.rms_norm_eps, c.draft_vocab_size) == ((1, 4, 7), 20000.0, 1e-5, DRAFT_VOCAB)
    assert torch.equal(head.draft_to_target, vocab) and torch.equal(head.t2d, t2d)
    aux, ids = inputs(c)
    assert_same_logits(our_logits(head, model.embed_tokens, aux, ids), speculators_logits(model, aux, ids))


def test_speculators_layout(tiny_dir, tmp_path):
    """What save_speculators writes (checked against speculators 0.9.0 by the tests above) and that it loads back."""
    target = tiny_dir("llama", layers=3)
    head, _ = head_for(target)
    save_speculators(head, tmp_path / "head", str(target))
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]}
    names = set(load_file(str(tmp_path / "head" / "model.safetensors")))
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.hidden_norm.weight", "d2t", "t2d"} <= names
    assert not any(n.startswith("midlayer.") for n in names)
    loaded = load_head(tmp_path / "head")
    for k, v in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0, msg=k)


def test_gguf_layout(tiny_dir, tmp_path):
    """save_gguf: llama.cpp's names, GGUF shapes, q/k interleaved, d2t absolute I64, keys, the target's tokenizer."""
    import gguf

    target = tiny_dir("llama", layers=3)
    head, _ = head_for(target)
    c = head.config
    target_gguf = _target_gguf(tmp_path / "target.gguf", c)
    save_gguf(head, tmp_path / "head.gguf", target_gguf)
    r = gguf.GGUFReader(str(tmp_path / "head.gguf"))
    tensors = {t.name: t for t in r.tensors}
    H, Q, KV = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    want = {
        "fc.weight": [3 * c.target_hidden_size, H],
        "blk.0.attn_norm.weight": [H],
        "blk.0.attn_norm_2.weight": [H],
        "blk.0.attn_q.weight": [2 * H, Q],
        "blk.0.attn_k.weight": [2 * H, KV],
        "blk.0.attn_v.weight": [2 * H, KV],
        "blk.0.attn_output.weight": [Q, H],
        "blk.0.ffn_norm.weight": [H],
        "blk.0.ffn_gate.weight": [H, c.intermediate_size],
        "blk.0.ffn_up.weight": [H, c.intermediate_size],
        "blk.0.ffn_down.weight": [c.intermediate_size, H],
        "output_norm.weight": [H],
        "output.weight": [H, c.draft_vocab_size],
        "d2t": [c.draft_vocab_size],
    }
    assert {n: [int(x) for x in t.shape] for n, t in tensors.items()} == want
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert np.array_equal(tensors["d2t"].data, head.draft_to_target.numpy())
    q = head.midlayer.self_attn.qkv_proj.weight[:Q].detach().numpy()
    assert np.array_equal(unpermute(np.asarray(tensors["blk.0.attn_q.weight"].data), c.num_heads), q)
    assert np.array_equal(unpermute(permute(q, c.num_heads), c.num_heads), q)
    keys = {k: f.contents() for k, f in r.fields.items()}
    assert keys["general.architecture"] == "eagle3" and keys["eagle3.target_layers"] == [0, 1, 2]
    assert (
        keys["eagle3.target_hidden_size"],
        keys["eagle3.block_count"],
        keys["eagle3.embedding_length"],
        keys["eagle3.attention.head_count_kv"],
        keys["eagle3.vocab_size"],
    ) == (H, 1, H, c.num_kv_heads, 96)
    assert keys["eagle3.rope.freq_base"] == c.rope_theta
    assert keys["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(96)]


def test_gguf_refuses_another_target(tiny_dir, tmp_path):
    from specdec.errors import SpecdecError

    head, _ = head_for(tiny_dir("llama", layers=3))
    other = _target_gguf(tmp_path / "other.gguf", dataclasses.replace(head.config, vocab_size=90))
    with pytest.raises(SpecdecError, match="not the target"):
        save_gguf(head, tmp_path / "head.gguf", other)
    assert not list(tmp_path.glob("head.gguf*"))


def _target_gguf(path: Path, c: Eagle3Config) -> Path:
    """A target GGUF with only what save_gguf reads: architecture, hidden size, layer count, a tokenizer."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.embedding_length", c.target_hidden_size)
    w.add_uint32("llama.block_count", max(c.aux_layers) + 1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_token_types([1] * c.vocab_size)
    w.add_eos_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _convert(source: Path, head_dir: Path, target_dir: Path, out: Path) -> None:
    cmd = [
        sys.executable,
        str(source / "convert_hf_to_gguf.py"),
        str(head_dir),
        "--target-model-dir",
        str(target_dir),
        "--outfile",
        str(out),
        "--outtype",
        "f32",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.real
@pytest.mark.skipif(LLAMA_CPP is None, reason="llama.cpp source not cached (specdec bench --llama-server auto)")
def test_llama_cpp_converter_matches_save_gguf(smollm_dir, tmp_path):
    """The pinned llama.cpp converter on our HF and speculators layouts (target: the SmolLM2 pack's checkpoint
    directory, for its config.json and tokenizer) gives the tensors and eagle3 keys save_gguf writes."""
    from specdec.models.config import ModelConfig
    from specdec.models.gguf_convert import fast_reader_class
    from specdec.models.packs import gguf_path

    c = Eagle3Config.for_target(ModelConfig.from_file(smollm_dir / "config.json"), 512, intermediate=256)
    head = random_head(c)
    save_head(head, tmp_path / "hf")
    save_speculators(head, tmp_path / "spec", str(smollm_dir))
    save_gguf(head, tmp_path / "ours.gguf", gguf_path("smollm2-135m"))
    ours = fast_reader_class()(tmp_path / "ours.gguf")  # gguf.GGUFReader: the pack's 49K vocabulary in 0.36 s, not 2.3
    want = gguf_tensors(head)
    for layout in ("hf", "spec"):
        _convert(LLAMA_CPP, tmp_path / layout, smollm_dir, tmp_path / f"{layout}.gguf")
        theirs = fast_reader_class()(tmp_path / f"{layout}.gguf")
        assert {t.name: t.data.shape for t in theirs.tensors} == {n: a.shape for n, a in want.items()}, layout
        for a, b in zip(sorted(theirs.tensors, key=lambda t: t.name), sorted(ours.tensors, key=lambda t: t.name)):
            assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data), (layout, a.name)
        for key, field in theirs.fields.items():
            if key.startswith("eagle3.") or key in ("general.architecture", "tokenizer.ggml.tokens"):
                assert field.contents() == ours.fields[key].contents(), (layout, key)
