"""Layer placement in the runtime (-ngl): a model split across devices gives the same logits. Without a GPU
both "devices" are the CPU, and the split path (hidden states and batch tensors moved per split) is forced."""

import torch

from specdec.models.loader import load_checkpoint
from specdec.runtime.placement import place_layers
from specdec.runtime.runner import ModelRunner


def test_split_model_matches_whole_model(tiny_dir):
    d = tiny_dir("qwen2", layers=3)
    whole, _ = load_checkpoint(d, torch.float32)
    split, _ = load_checkpoint(d, torch.float32)
    split.place(place_layers(3, 2).module_devices(gpu="cpu"))
    split.split = True  # as if layers 0-1 and embeddings sat on a GPU: every crossing is taken
    assert (
        split.lm_head.weight is not split.model.embed_tokens.weight
        or not split.config.tie_word_embeddings
        or split.lm_head.weight.device == split.model.embed_tokens.weight.device
    )
    ra, rb = ModelRunner(whole, 2, 32), ModelRunner(split, 2, 32)
    assert len(rb.cache.k) == 3 and all(t.device.type == "cpu" for t in rb.cache.k)
    chunks, starts, slots = [[5, 9, 12, 5], [33, 2]], [0, 0], [0, 1]
    for a, b in zip(ra.forward(chunks, starts, slots), rb.forward(chunks, starts, slots)):
        torch.testing.assert_close(a, b)
    tree_a = ra.verify_tree(0, 4, [7, 8, 9, 10], [-1, 0, -1])
    tree_b = rb.verify_tree(0, 4, [7, 8, 9, 10], [-1, 0, -1])
    torch.testing.assert_close(tree_a, tree_b)
