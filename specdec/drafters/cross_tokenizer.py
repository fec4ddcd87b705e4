"""`draft` across tokenizers (Universal Assisted Decoding): a draft model whose vocabulary differs from the target's.

The draft keeps its own token sequence and KV cache; text is what the two sides share.

- Catch-up: the target's newly committed tokens are decoded (in context, so a leading space or a character split
  across tokens comes out right) and the draft re-encodes them together with a window of its own last tokens, so
  merges across the join come out as its tokenizer makes them; the cached draft tokens that agree are kept and the
  cache rolls back (length pointer) to the first that differs. That is also how a rejected draft is rolled back:
  the accepted text re-encodes to the drafted tokens it covers.
- Proposal: the draft's new tokens are decoded and re-encoded with the target's tokenizer after a window of the
  target's last tokens; the tokens that start at the join are proposed (a token straddling it ends the draft).
- `propose_batch` drafts several sequences at once: their catch-ups in one ragged forward (a new prompt alone),
  then one forward per draft position over the sequences still drafting.

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

WINDOW = 4  # tokens before a join that are decoded / re-encoded with what follows it
LOOKBACK = 4  # tokens decoded before a span so that its own text comes out as it reads in context
UTF8_MAX = 4  # a character split across tokens is complete within this many of them


def text(tok: Tokenizer, ids: list[int]) -> str:
    """Token ids -> text, special tokens kept (both sides must see a chat template's markers)."""
    return tok.fast.decode(ids, skip_special_tokens=False)


def span_text(tok: Tokenizer, ids: list[int], start: int, end: int) -> str | None:
    """The text of ids[start:end] as it reads after ids[:start]; None when either end splits a character."""
    ctx = ids[max(0, start - LOOKBACK) : start]
    before, after = text(tok, ctx), text(tok, ctx + ids[start:end])
    if not after.startswith(before) or after.endswith("\ufffd"):
        return None
    return after[len(before) :]


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
        pairs = [
            (d, tv[s])
            for s, d in draft_tok.fast.get_vocab(with_added_tokens=True).items()
            if s in tv and d < draft_vocab and tv[s] < target_vocab
        ]
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

    seq: Sequence  # whose it is (a new sequence in the slot starts afresh)
    cached: list[int] = field(default_factory=list)  # draft tokens whose K/V the draft cache holds, in order
    committed: int = 0  # how many of `cached` spell committed text (the rest: the last draft)
    synced: int = 0  # target tokens whose text the draft has (a character boundary)


@dataclass
class _Drafting:
    """One sequence's draft in progress: twins drawn directly (exact q), then free draft tokens (through text)."""

    seq: Sequence
    max_tokens: int  # target tokens asked for
    min_path_prob: float
    budget: int = 0  # draft tokens to draw at most
    logits: torch.Tensor | None = None  # [V_draft] the draft's logits for the next position; None: no draft
    setup_s: float = 0.0
    direct: list[int] = field(default_factory=list)  # target ids of twins drawn among twins
    probs: list[torch.Tensor] = field(default_factory=list)  # [V_target] q of each direct token (sampling)
    drafted: list[int] = field(default_factory=list)  # every draft token, in order (the direct ones first)
    path_prob: float = 1.0


class CrossTokenizerDrafter(Drafter):
    """A draft model with its own tokenizer: catch-up and proposals through text (see the module docstring)."""

    name = "draft"
    confidence_stop = True
    batched = True

    def __init__(
        self, runner: ModelRunner, target_tok: Tokenizer, draft_tok: Tokenizer, target_vocab: int, p_min: float = 0.0
    ):
        self.runner, self.target_tok, self.draft_tok = runner, target_tok, draft_tok
        self.target_vocab, self.p_min = target_vocab, p_min
        self.twins = Twins(draft_tok, target_tok, runner.vocab_size, target_vocab)
        self.slots: dict[int, _Slot] = {}

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        return self.propose_batch([seq], [max_tokens], [min_path_prob])[0]

    def propose_batch(self, seqs: list[Sequence], max_tokens: list[int], min_path_probs: list[float]) -> list[Draft]:
        """Drafts for several sequences (distinct slots), each draft-model forward one ragged batch over them."""
        states = [_Drafting(s, k, m) for s, k, m in zip(seqs, max_tokens, min_path_probs)]
        self._catch_up(states)
        feed = [(st, tok) for st in states if st.logits is not None and (tok := self._advance(st)) is not None]
        while feed:
            slots = [st.seq.slot for st, _ in feed]
            out = self.runner.forward(
                [[tok] for _, tok in feed],
                [len(self.slots[s].cached) for s in slots],
                slots,
                last_only=True,
                settle=False,  # drafted tokens: a rejection rolls back to any of them
            )  # per sequence [1, V_draft]
            for (st, tok), logits in zip(feed, out):
                self.slots[st.seq.slot].cached.append(tok)
                st.logits = logits[-1]
            feed = [(st, tok) for st, _ in feed if (tok := self._advance(st)) is not None]
        return [self._draft(st) for st in states]

    def pending_setup(self, seq: Sequence) -> int:
        """Target tokens whose text the draft has not seen (its own tokens for them: about as many)."""
        slot = self.slots.get(seq.slot)
        n = len(seq.tokens) - (slot.synced if slot is not None and slot.seq is seq else 0)
        return n if n > SETUP_TOKENS else 0

    def _catch_up(self, states: list[_Drafting]) -> None:
        """Bring each sequence's draft to the target's committed text and set its next-position logits (a new
        prompt alone, timed as setup; the short rests in one ragged forward)."""
        short = []
        for st in states:
            plan = self._resync(st)
            if plan is None:
                continue
            ids, keep, end = plan
            if len(ids) - keep <= SETUP_TOKENS:
                short.append((st, ids, keep, end))
                continue
            t = time.perf_counter()
            self._synced(st, ids, end, self.runner.prefill(ids[keep:], st.seq.slot, start=keep))
            st.setup_s = time.perf_counter() - t
        if short:
            out = self.runner.forward(
                [ids[keep:] for _, ids, keep, _ in short],
                [keep for _, _, keep, _ in short],
                [st.seq.slot for st, *_ in short],
                last_only=True,
            )  # per sequence [1, V_draft]
            for (st, ids, _, end), logits in zip(short, out):
                self._synced(st, ids, end, logits[-1])

    def _resync(self, st: _Drafting) -> tuple[list[int], int, int] | None:
        """(the draft tokens spelling the committed text, how many of the cached ones stay, target tokens whose
        text they spell), or None when the draft's context has no room."""
        seq = st.seq
        slot = self.slots.get(seq.slot)
        if slot is None or slot.seq is not seq:
            slot = self.slots[seq.slot] = _Slot(seq)
        end, new = clean_tail(self.target_tok, seq.tokens, slot.synced)
        start, tail = window(self.draft_tok, slot.cached[: slot.committed])
        ids = slot.cached[:start] + self.draft_tok.encode(tail + new, add_special_tokens=False)
        if not ids or len(ids) + st.max_tokens >= self.runner.context:
            return None
        keep = start
        while keep < min(len(ids), len(slot.cached)) and ids[keep] == slot.cached[keep]:
            keep += 1
        return ids, min(keep, len(ids) - 1), end  # nothing new: the last token is fed again for its logits

    def _synced(self, st: _Drafting, ids: list[int], end: int, logits: torch.Tensor) -> None:
        """Record a catch-up; draft only when the committed text does not end inside a character."""
        slot = self.slots[st.seq.slot]
        slot.cached, slot.committed, slot.synced = ids, len(ids), end
        if end == len(st.seq.tokens):
            st.logits = logits  # [V_draft]
            # as many draft tokens per target token as the draft's tokenizer spends on the text so far
            st.budget = min(math.ceil(st.max_tokens * max(1.0, len(ids) / max(1, end))), self.runner.context - len(ids))

    def _advance(self, st: _Drafting) -> int | None:
        """Draw the next draft token from `st.logits` (the cut decided before the draw, from q's top and the path);
        the token whose logits the next position needs, or None when the draft is done."""
        if len(st.drafted) >= st.budget:
            return None
        q = draft_distribution(st.logits, st.seq, self.p_min > 0 or st.min_path_prob > 0)  # [V_draft] or None
        top = 1.0 if q is None else float(q.max())
        if top < self.p_min or (st.drafted and st.path_prob * top < st.min_path_prob):
            return None
        tok = self._draw(st, q)
        st.path_prob *= 1.0 if q is None else float(q[tok])
        st.drafted.append(tok)
        return tok if len(st.drafted) < st.budget else None

    def _draw(self, st: _Drafting, q: torch.Tensor | None) -> int:
        """The next draft token: among twins (recorded as a target id with its q) while sampling and the top token
        has a twin; else the draft's own choice."""
        seq, logits = st.seq, st.logits
        position = len(seq.tokens) + len(st.drafted)
        direct = len(st.direct) == len(st.drafted) and not seq.params.greedy
        if direct and bool(self.twins.has[int(logits.argmax())]):
            mapped = self.twins.to_target(logits)  # [V_target]
            qt = draft_distribution(mapped, seq, True)  # [V_target]
            x, _ = draw(mapped, qt, seq, position, False)
            st.direct.append(x)
            if not seq.seeded:
                st.probs.append(qt)
            return int(self.twins.draft_of[x])
        tok, _ = draw(logits, q, seq, position, False)
        return tok

    def _draft(self, st: _Drafting) -> Draft:
        """The target tokens: the direct twins, then the rest through text, cut to max_tokens."""
        if st.logits is None:
            return Draft([], setup_s=st.setup_s)
        tokens = (st.direct + self._through_text(st))[: st.max_tokens]
        return Draft(tokens, self._probs(st, tokens), setup_s=st.setup_s)

    def _through_text(self, st: _Drafting) -> list[int]:
        """Target tokens spelling the draft tokens after the direct ones, continuing seq.tokens + st.direct."""
        slot, n = self.slots[st.seq.slot], len(st.direct)
        if len(st.drafted) == n:
            return []
        _, new = clean_tail(self.draft_tok, slot.cached[: slot.committed] + st.drafted, slot.committed + n)
        _, before = window(self.target_tok, st.seq.tokens + st.direct)
        return (encode_after(self.target_tok, before, new) or []) if new else []

    def _probs(self, st: _Drafting, tokens: list[int]) -> torch.Tensor | None:
        """[k, V_target]: q of the direct tokens, one-hot for those through text; None when all are one-hot."""
        if not st.probs:
            return None
        exact = st.probs[: len(tokens)]  # a long run of twins may be cut to max_tokens
        rest = torch.tensor(tokens[len(exact) :], dtype=torch.long)  # [k - n]
        one_hot = torch.zeros(len(rest), self.target_vocab).scatter_(1, rest.view(-1, 1), 1.0)  # [k - n, V_target]
        return torch.cat([torch.stack(exact), one_hot])

    def release(self, seq: Sequence) -> None:
        self.slots.pop(seq.slot, None)


def build(
    runner: ModelRunner, tokenizers: tuple[Tokenizer, Tokenizer], target_vocab: int, p_min: float, branch_p: float
) -> CrossTokenizerDrafter:
    """The cross-tokenizer draft (chains only: `--draft-branch-p` needs a shared vocabulary)."""
    if branch_p > 0:
        raise SpecdecError("--draft-branch-p needs a draft model with the target's tokenizer")
    return CrossTokenizerDrafter(runner, *tokenizers, target_vocab, p_min)
