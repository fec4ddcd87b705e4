"""`draft` across tokenizers (Universal Assisted Decoding): a draft model whose vocabulary differs from the target's.

The draft keeps its own token sequence and KV cache; text is what the two sides share.

- Catch-up: the target's newly committed tokens are decoded (in context, so a leading space or a character split
  across tokens comes out right) and the draft re-encodes them together with a window of its own last tokens, so
  merges across the join come out as its tokenizer makes them; the cached draft tokens that agree are kept and the
  cache rolls back (length pointer) to the first that differs. That is also how a rejected draft is rolled back:
  the accepted text re-encodes to the drafted tokens it covers.
- Proposal: the draft's new tokens are decoded and re-encoded with the target's tokenizer after a window of the
  target's last tokens; the tokens that start at the join are proposed (a token straddling it ends the draft).

Greedy is lossless because the target verifies its own tokens. Sampling uses the draft's q only where it is exact:
while the draft's most likely token has a twin in the target's vocabulary (the same token string), the draft draws
among twins only and proposes the twin itself, so q mapped onto the target's ids is the distribution the token was
drawn from. From the first position whose top token has no twin on, the draft draws freely and its tokens go through
text, verified as one-hot (a draw independent of the verifier's leaves the target's distribution intact). Seeded
sampling draws twins under the target's noise for each position, like the same-tokenizer draft.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from specdec.drafters.base import SETUP_TOKENS, Draft, Drafter, draft_distribution, draw
from specdec.errors import SpecdecError
from specdec.models.tokenizer import Tokenizer
from specdec.runtime.runner import ModelRunner
from specdec.sequence import Sequence

WINDOW = 4    # tokens before a join that are decoded / re-encoded with what follows it
LOOKBACK = 4  # tokens decoded before a span so that its own text comes out as it reads in context
UTF8_MAX = 4  # a character split across tokens is complete within this many of them


def text(tok: Tokenizer, ids: list[int]) -> str:
    """Token ids -> text, special tokens kept (both sides must see a chat template's markers)."""
    return tok.fast.decode(ids, skip_special_tokens=False)


def span_text(tok: Tokenizer, ids: list[int], start: int, end: int) -> str | None:
    """The text of ids[start:end] as it reads after ids[:start]; None when either end splits a character."""
    ctx = ids[max(0, start - LOOKBACK):start]
    before, after = text(tok, ctx), text(tok, ctx + ids[start:end])
    if not after.startswith(before) or after.endswith("\ufffd"):
        return None
    return after[len(before):]


def clean_tail(tok: Tokenizer, ids: list[int], start: int) -> tuple[int, str]:
    """(end, text of ids[start:end]) for the largest end that does not split a character (from `start`, clean)."""
    for end in range(len(ids), max(start, len(ids) - UTF8_MAX), -1):
        t = span_text(tok, ids, start, end)
        if t is not None:
            return end, t
    return start, ""


def window(tok: Tokenizer, ids: list[int]) -> tuple[int, str]:
    """(start, text of ids[start:]) for about the last WINDOW tokens, from a character boundary; (len, '') if none."""
    first = max(0, len(ids) - WINDOW)
    for start in range(first, max(-1, first - UTF8_MAX), -1):
        t = span_text(tok, ids, start, len(ids))
        if t is not None:
            return start, t
    return len(ids), ""


def encode_after(tok: Tokenizer, before: str, new: str) -> list[int] | None:
    """The tokens of `before + new` that spell `new`; None when a token straddles the join."""
    enc = tok.fast.encode_batch([before + new], add_special_tokens=False)[0]
    cut = len(before)
    if any(s < cut < e for s, e in enc.offsets):
        return None
    return [i for i, (s, _) in zip(enc.ids, enc.offsets) if s >= cut]


class Twins:
    """Tokens spelled the same in both vocabularies: one-to-one between draft and target ids."""

    def __init__(self, draft_tok: Tokenizer, target_tok: Tokenizer, draft_vocab: int, target_vocab: int):
        tv = target_tok.fast.get_vocab(with_added_tokens=True)
        pairs = [(d, tv[s]) for s, d in draft_tok.fast.get_vocab(with_added_tokens=True).items()
                 if s in tv and d < draft_vocab and tv[s] < target_vocab]
        self.d_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)  # [n]
        self.t_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)  # [n]
        self.target_vocab = target_vocab
        self.has = torch.zeros(draft_vocab, dtype=torch.bool)  # [V_draft]
        self.has[self.d_ids] = True
        self.draft_of = torch.full((target_vocab,), -1, dtype=torch.long)  # [V_target]
        self.draft_of[self.t_ids] = self.d_ids

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [V_draft] -> [V_target]: each twin's logit at its target id, -inf elsewhere."""
        out = logits.new_full((self.target_vocab,), float("-inf"))
        out[self.t_ids] = logits[self.d_ids]
        return out


@dataclass
class _Slot:
    """One sequence's draft side."""
    seq: Sequence       # whose it is (a new sequence in the slot starts afresh)
    cached: list[int] = field(default_factory=list)  # draft tokens whose K/V the draft cache holds, in order
    committed: int = 0  # how many of `cached` spell committed text (the rest: the last draft)
    synced: int = 0     # target tokens whose text the draft has (a character boundary)


@dataclass
class _Drafting:
    """One draft in progress: twins drawn directly (exact q), then free draft tokens (through text)."""
    direct: list[int] = field(default_factory=list)   # target ids of twins drawn among twins
    probs: list[torch.Tensor] = field(default_factory=list)  # [V_target] q of each direct token (sampling)
    drafted: list[int] = field(default_factory=list)  # every draft token, in order (the direct ones first)
    path_prob: float = 1.0


class CrossTokenizerDrafter(Drafter):
    """A draft model with its own tokenizer: catch-up and proposals through text (see the module docstring)."""
    name = "draft"
    confidence_stop = True

    def __init__(self, runner: ModelRunner, target_tok: Tokenizer, draft_tok: Tokenizer, target_vocab: int,
                 p_min: float = 0.0):
        self.runner, self.target_tok, self.draft_tok = runner, target_tok, draft_tok
        self.target_vocab, self.p_min = target_vocab, p_min
        self.twins = Twins(draft_tok, target_tok, runner.vocab_size, target_vocab)
        self.slots: dict[int, _Slot] = {}

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        t = time.perf_counter()
        logits, fed = self._catch_up(seq, max_tokens)  # [V_draft] or None
        setup_s = time.perf_counter() - t if fed > SETUP_TOKENS else 0.0  # a new prompt: setup, not drafting
        if logits is None:
            return Draft([], setup_s=setup_s)
        d = self._draw_all(seq, logits, self._budget(seq, max_tokens), min_path_prob)
        tokens = (d.direct + self._through_text(seq, d))[:max_tokens]
        return Draft(tokens, self._probs(d, tokens), setup_s=setup_s)

    def _catch_up(self, seq: Sequence, max_tokens: int) -> tuple[torch.Tensor | None, int]:
        """Bring the draft to the target's committed text: (its logits [V_draft] for the next position, or None
        when that text ends inside a character or the draft's context has no room; draft tokens fed)."""
        st = self.slots.get(seq.slot)
        if st is None or st.seq is not seq:
            st = self.slots[seq.slot] = _Slot(seq)
        end, new = clean_tail(self.target_tok, seq.tokens, st.synced)
        start, tail = window(self.draft_tok, st.cached[:st.committed])
        ids = st.cached[:start] + self.draft_tok.encode(tail + new, add_special_tokens=False)
        if not ids or len(ids) + max_tokens >= self.runner.context:
            return None, 0
        keep = start
        while keep < min(len(ids), len(st.cached)) and ids[keep] == st.cached[keep]:
            keep += 1
        keep = min(keep, len(ids) - 1)  # nothing new: the last token is fed again, its logits are needed
        logits = self.runner.prefill(ids[keep:], seq.slot, start=keep)  # [V_draft]
        st.cached, st.committed, st.synced = ids, len(ids), end
        return (logits if end == len(seq.tokens) else None), len(ids) - keep

    def _budget(self, seq: Sequence, max_tokens: int) -> int:
        """Draft tokens for about `max_tokens` target tokens: as many more as the draft's tokenizer spends on the
        sequence's text so far."""
        st = self.slots[seq.slot]
        budget = math.ceil(max_tokens * max(1.0, st.committed / max(1, st.synced)))
        return min(budget, self.runner.context - len(st.cached))

    def _draw_all(self, seq: Sequence, logits: torch.Tensor, max_tokens: int, min_path_prob: float) -> _Drafting:
        """Draw draft tokens one forward at a time (the cut decided before each draw, from q's top and the path)."""
        st, d = self.slots[seq.slot], _Drafting()
        needed = self.p_min > 0 or min_path_prob > 0
        while len(d.drafted) < max_tokens:
            q = draft_distribution(logits, seq, needed)  # [V_draft] or None (greedy, nothing reads it)
            top = 1.0 if q is None else float(q.max())
            if top < self.p_min or (d.drafted and d.path_prob * top < min_path_prob):
                break
            tok = self._draw(seq, d, logits, q)
            d.path_prob *= 1.0 if q is None else float(q[tok])
            d.drafted.append(tok)
            if len(d.drafted) == max_tokens:
                break
            logits = self.runner.forward([[tok]], [len(st.cached)], [seq.slot], last_only=True)[0][-1]
            st.cached.append(tok)
        return d

    def _draw(self, seq: Sequence, d: _Drafting, logits: torch.Tensor, q: torch.Tensor | None) -> int:
        """The next draft token: among twins (recorded as a target id with its q) while sampling and the top token
        has a twin; else the draft's own choice."""
        position = len(seq.tokens) + len(d.drafted)
        direct = len(d.direct) == len(d.drafted) and not seq.params.greedy
        if direct and bool(self.twins.has[int(logits.argmax())]):
            mapped = self.twins.to_target(logits)  # [V_target]
            qt = draft_distribution(mapped, seq, True)  # [V_target]
            x, _ = draw(mapped, qt, seq, position, False)
            d.direct.append(x)
            if not seq.seeded:
                d.probs.append(qt)
            return int(self.twins.draft_of[x])
        tok, _ = draw(logits, q, seq, position, False)
        return tok

    def _through_text(self, seq: Sequence, d: _Drafting) -> list[int]:
        """Target tokens spelling the draft tokens after the direct ones, continuing seq.tokens + d.direct."""
        st, n = self.slots[seq.slot], len(d.direct)
        if len(d.drafted) == n:
            return []
        ctx = st.cached[:st.committed] + d.drafted
        _, new = clean_tail(self.draft_tok, ctx, st.committed + n)
        _, before = window(self.target_tok, seq.tokens + d.direct)
        return (encode_after(self.target_tok, before, new) or []) if new else []

    def _probs(self, d: _Drafting, tokens: list[int]) -> torch.Tensor | None:
        """[k, V_target]: q of the direct tokens, one-hot for those through text; None when all are one-hot."""
        if not d.probs:
            return None
        exact = d.probs[:len(tokens)]  # a long run of twins may be cut to max_tokens
        rest = torch.tensor(tokens[len(exact):], dtype=torch.long)  # [k - n]
        one_hot = torch.zeros(len(rest), self.target_vocab).scatter_(1, rest.view(-1, 1), 1.0)  # [k - n, V_target]
        return torch.cat([torch.stack(exact), one_hot])

    def release(self, seq: Sequence) -> None:
        self.slots.pop(seq.slot, None)


def build(runner: ModelRunner, tokenizers: tuple[Tokenizer, Tokenizer], target_vocab: int, p_min: float,
          branch_p: float) -> CrossTokenizerDrafter:
    """The cross-tokenizer draft (chains only: `--draft-branch-p` needs a shared vocabulary)."""
    if branch_p > 0:
        raise SpecdecError("--draft-branch-p needs a draft model with the target's tokenizer")
    return CrossTokenizerDrafter(runner, *tokenizers, target_vocab, p_min)
