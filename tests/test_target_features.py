"""Target features for drafters: `ModelRunner.capture` returns the hidden states entering chosen decoder layers
and the final norm's input, equal to what forward pre-hooks see in a plain forward, on every forward path."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.models.config import ModelConfig
from specdec.models.transformer import Transformer
from specdec.runtime import runner as runner_mod
from specdec.runtime.placement import place_layers
from specdec.runtime.runner import Features, FeatureSpec, ModelRunner

LAYERS = 4
SPEC = FeatureSpec((0, 1, 3))  # embeddings, output of layer 0, output of layer 2
PREFIX = [5, 9, 12, 5, 9, 12, 7]
TREE = [40, 41, 42, 43, 44, 45]  # node tokens
PARENTS = [-1, -1, 0, 0, 2, 1]  # two roots (40, 41); 40 -> 42, 43; 42 -> 44; 41 -> 45
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model() -> Transformer:
    """A tiny random Qwen3-style model (qk-norm), fp32, with non-trivial norm weights."""
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        qk_norm=True,
    )
    torch.manual_seed(0)
    m = Transformer(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.125) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return m.eval()


def _runner(model: Transformer, spec: FeatureSpec | None = SPEC, slots: int = 3) -> ModelRunner:
    r = ModelRunner(model, num_slots=slots, context=64)
    r.capture = spec
    return r


def _reference(model: Transformer, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain forward of `tokens` from position 0 in a fresh cache; (layers [T, L, H], final [T, H]) from
    forward pre-hooks on the decoder layers in SPEC and on the final norm."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str):
        return lambda _module, args: seen.__setitem__(name, args[0][0].clone())  # [T, H]

    mods = {f"layer{i}": model.model.layers[i] for i in SPEC.layers} | {"norm": model.model.norm}
    handles = [m.register_forward_pre_hook(hook(name)) for name, m in mods.items()]
    try:
        _runner(model, None, 1).forward([tokens], [0], [0])
    finally:
        for h in handles:
            h.remove()
    return torch.stack([seen[f"layer{i}"] for i in SPEC.layers], dim=1), seen["norm"]


def _assert_rows(f: Features, model: Transformer, tokens: list[int], rows: int) -> None:
    """`f` equals the reference features of the last `rows` tokens of a plain forward over `tokens`."""
    layers, final = _reference(model, tokens)
    assert len(f) == rows and f.layers.shape == (rows, len(SPEC.layers), 64)
    assert f.layers.device.type == "cpu" and f.layers.dtype == f.final.dtype == torch.float32
    torch.testing.assert_close(f.layers, layers[-rows:], **TOL)
    torch.testing.assert_close(f.final, final[-rows:], **TOL)


def _tree_path(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(TREE[node])
        node = PARENTS[node]
    return out[::-1]


def test_prefill_features_cover_every_chunk(model, monkeypatch):
    monkeypatch.setattr(runner_mod, "PREFILL_CHUNK", 8)
    tokens = [(7 * i + 3) % 96 for i in range(21)]  # 3 chunks, the last partial
    r = _runner(model)
    r.prefill(tokens[:4], 0)
    r.prefill(tokens[4:], 0, start=4)  # 17 tokens from position 4
    assert len(r.features) == 1
    _assert_rows(r.features[0], model, tokens, 17)


def test_ragged_chain_batch_gives_each_sequence_its_real_rows(model):
    prompts = {2: [3, 14, 15, 9, 26, 5, 35], 0: [27, 18, 28], 1: [16, 33]}  # slot -> committed tokens
    chunks = {2: [8, 9, 7], 0: [31], 1: [41, 59, 26, 53, 58]}
    r = _runner(model)
    for slot, p in prompts.items():
        r.prefill(p, slot)
    slots = [2, 0, 1]
    for last_only in (False, True):
        r.forward([chunks[s] for s in slots], [len(prompts[s]) for s in slots], slots, last_only=last_only)
        assert len(r.features) == 3
        for s, f in zip(slots, r.features):
            _assert_rows(f, model, prompts[s] + chunks[s], len(chunks[s]))


def test_tree_verify_rows_in_node_order(model):
    r = _runner(model, slots=1)
    r.prefill(PREFIX[:-1], 0)
    r.verify_tree(0, len(PREFIX) - 1, [PREFIX[-1]] + TREE, PARENTS)
    (f,) = r.features
    assert len(f) == len(TREE) + 1
    _assert_rows(f.rows([0]), model, PREFIX, 1)
    for node in range(len(TREE)):
        _assert_rows(f.rows([node + 1]), model, PREFIX + _tree_path(node), 1)


def test_accepted_rows_after_tree_verify_equal_a_chain_over_the_committed_tokens(model):
    r = _runner(model, slots=1)
    r.prefill(PREFIX[:-1], 0)
    r.verify_tree(0, len(PREFIX) - 1, [PREFIX[-1]] + TREE, PARENTS)
    path = [0, 2, 4]  # 40 -> 42 -> 44
    _assert_rows(r.features[0].accepted(path), model, PREFIX + [40, 42, 44], len(path) + 1)
    assert len(r.features[0].accepted([])) == 1  # nothing accepted: the last committed token only


def test_logits_do_not_depend_on_capture(model):
    plain, captured = _runner(model, None), _runner(model)
    for r in (plain, captured):
        r.prefill(PREFIX, 0)
        r.prefill(PREFIX[:3], 1)
    chunks, starts, slots = [[1, 2, 3], [4]], [len(PREFIX), 3], [0, 1]
    for a, b in zip(plain.forward(chunks, starts, slots), captured.forward(chunks, starts, slots)):
        assert torch.equal(a, b)
    tree = [PREFIX[-1]] + TREE
    assert torch.equal(plain.verify_tree(2, 4, tree, PARENTS), captured.verify_tree(2, 4, tree, PARENTS))
    assert torch.equal(plain.prefill(PREFIX, 2), captured.prefill(PREFIX, 2))


def test_no_capture_returns_nothing_extra(model):
    r = _runner(model, None)
    r.prefill(PREFIX, 0)
    assert r.features is None
    r.forward([[1, 2], [3]], [len(PREFIX), 0], [0, 1], last_only=True)
    assert r.features is None
    r.verify_tree(2, 0, [PREFIX[-1]] + TREE, PARENTS)
    assert r.features is None
    t = torch.tensor([PREFIX])
    _, hidden = model(t, torch.arange(len(PREFIX))[None], torch.tensor([0]), r.cache)
    assert hidden == {}


def test_split_model_features_match_whole_model(model):
    split = Transformer(model.config)
    split.load_state_dict(model.state_dict())
    split.place(place_layers(LAYERS, 2).module_devices(gpu="cpu"))
    split.split = True  # every device crossing is taken
    chunks, starts, slots = [[5, 9, 12, 5], [33, 2]], [0, 0], [0, 1]
    ra, rb = _runner(model), _runner(split)
    ra.forward(chunks, starts, slots)
    rb.forward(chunks, starts, slots)
    for a, b in zip(ra.features, rb.features):
        torch.testing.assert_close(a.layers, b.layers)
        torch.testing.assert_close(a.final, b.final)


def test_feature_spec_layers_are_checked():
    assert FeatureSpec.eagle3(32).layers == (2, 16, 29)
    r = ModelRunner(Transformer(ModelConfig("llama", 16, 8, 16, 2, 2, 2, 4, 32)), 1, 8)
    with pytest.raises(SpecdecError):
        r.capture = FeatureSpec((2,))
    r.capture = FeatureSpec((0, 1))
    r.capture = None
    assert r.capture is None and r.features is None
