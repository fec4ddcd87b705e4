"""Lossless verification of a drafted chain against the target's logits.

Greedy: keep the longest prefix equal to the target's argmax, then the target's own token.
Sampling: rejection sampling (Leviathan et al. 2023, Chen et al. 2023); a drafter without
probabilities counts as one-hot. Either way the result is k' accepted drafts + one token.
"""
from __future__ import annotations

import torch

from specdec.sampling import SamplingParams, probs_from_logits, sample


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> list[int]:
    """draft [k], target_logits [k+1, V] -> accepted drafts followed by the bonus token."""
    target = target_logits.argmax(-1)  # [k+1]
    k = draft.shape[0]
    mismatch = (draft != target[:k]).nonzero()
    m = int(mismatch[0]) if mismatch.numel() else k
    return target[:m + 1].tolist()


def verify_sampling(draft: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                    params: SamplingParams, generator: torch.Generator | None) -> list[int]:
    """Rejection sampling.

    draft [k]; draft_probs [k, V] (the distributions the drafts were sampled from) or None for a
    deterministic drafter; target_logits [k+1, V]. Returns accepted drafts + one sampled token.
    """
    k = draft.shape[0]
    p = probs_from_logits(target_logits, params)  # [k+1, V]
    rows = torch.arange(k)
    p_tok = p[rows, draft]  # [k]
    q_tok = draft_probs[rows, draft] if draft_probs is not None else torch.ones(k)  # [k]
    u = torch.rand(k, generator=generator)  # [k]
    rejected = (u * q_tok >= p_tok).nonzero()  # accept iff u < p/q
    m = int(rejected[0]) if rejected.numel() else k
    if m == k:
        bonus = sample(p[k:k + 1], generator)
    else:
        q = draft_probs[m] if draft_probs is not None else torch.nn.functional.one_hot(draft[m], p.shape[-1]).float()
        residual = (p[m] - q).clamp_min(0)  # [V]
        residual = residual if residual.sum() > 0 else p[m]
        bonus = sample((residual / residual.sum())[None], generator)
    return draft[:m].tolist() + bonus.tolist()
