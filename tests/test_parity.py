"""Logits equal the `transformers` reference implementation (fp32)."""

import pytest
import torch
from conftest import FAMILIES

from specdec.models.loader import load_checkpoint
from specdec.runtime.runner import ModelRunner

TOL = 1e-4


def _reference(directory, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _ours_in_two_chunks(directory, ids, split):
    model, _ = load_checkpoint(directory, torch.float32)
    runner = ModelRunner(model, num_slots=1, context=128)
    first = runner.forward([ids[:split]], [0], [0])[0]
    second = runner.forward([ids[split:]], [split], [0])[0]
    return torch.cat([first, second])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_parity(tiny_dir, family):
    d = tiny_dir(family)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _reference(d, ids)
    ours = _ours_in_two_chunks(d, ids, 25)
    assert (ours - ref).abs().max() < TOL * max(1.0, ref.abs().max())


@pytest.mark.real
def test_smollm_parity(smollm_dir):
    from specdec.models.tokenizer import Tokenizer

    ids = Tokenizer(smollm_dir).encode('def quicksort(xs):\n    """Sort a list."""\n')
    ref = _reference(smollm_dir, ids)
    ours = _ours_in_two_chunks(smollm_dir, ids, len(ids) // 2)
    assert (ours - ref).abs().max() < TOL * ref.abs().max()
