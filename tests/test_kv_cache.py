"""KV cache: rollback is a length pointer; ragged batches equal single-sequence runs."""

import torch

from specdec.models.loader import load_checkpoint
from specdec.runtime.runner import ModelRunner


def _runner(tiny_dir, slots=1):
    model, _ = load_checkpoint(tiny_dir("qwen2"), torch.float32)
    return ModelRunner(model, num_slots=slots, context=128)


def test_rollback_overwrites_rejected_entries(tiny_dir):
    ids = list(range(3, 23))
    fresh = _runner(tiny_dir).forward([ids], [0], [0])[0]
    r = _runner(tiny_dir)
    r.forward([ids[:12]], [0], [0])
    r.forward([[50, 51, 52, 53, 54]], [12], [0])  # drafts that get rejected...
    again = r.forward([ids[12:]], [12], [0])[0]  # ...rolled back by simply writing from 12 again
    assert torch.allclose(again, fresh[12:], atol=1e-5)


def test_ragged_batch_matches_single(tiny_dir):
    a, b = list(range(5, 25)), list(range(40, 48))
    single = _runner(tiny_dir)
    ref_a = single.forward([a], [0], [0])[0]
    ref_b = _runner(tiny_dir).forward([b], [0], [0])[0]
    r = _runner(tiny_dir, slots=2)
    r.forward([a[:15], b[:3]], [0, 0], [0, 1])  # different prefix lengths per sequence
    out_a, out_b = r.forward([a[15:], b[3:]], [15, 3], [0, 1])  # different chunk lengths (padded)
    assert torch.allclose(out_a, ref_a[15:], atol=1e-5)
    assert torch.allclose(out_b, ref_b[3:], atol=1e-5)


def test_cache_size(tiny_dir):
    r = _runner(tiny_dir, slots=2)
    cfg = r.model.config
    per_slot = cfg.num_layers * 2 * cfg.num_kv_heads * r.cache.max_len * cfg.head_dim * 4
    assert r.cache.nbytes() == 2 * per_slot
