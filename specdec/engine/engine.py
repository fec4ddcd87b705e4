"""The speculative step loop: prefill, then draft -> verify in one batched target forward -> commit."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from specdec.constraint import Constraint
from specdec.drafters.registry import VerifyHook
from specdec.engine.adaptive import CostModel
from specdec.engine.planner import DraftPlanner, Proposal, SpecConfig, source
from specdec.engine.stops import StopScan
from specdec.errors import SpecdecError
from specdec.models.tokenizer import Detokenizer, Tokenizer
from specdec.runtime.runner import PREFILL_CHUNK, Features, ModelRunner
from specdec.runtime.small_ops import top2
from specdec.sampling import SamplingParams, probs_from_logits, sample, seeded_pick
from specdec.sequence import Draft, RequestOptions, Sequence, StreamCallback
from specdec.trace import step_trace
from specdec.verify import Relaxed, chain, verify_tree_greedy, verify_tree_sampling, verify_tree_seeded

__all__ = ["Engine", "PromptTooLong", "SpecConfig", "StepInfo", "StreamCallback"]


@dataclass
class Verdict:
    """What verification decided for one sequence's draft."""

    new: list[int]  # tokens to commit: the accepted draft tokens, then the target's own
    path: list[int]  # accepted draft nodes, in order
    rows: torch.Tensor  # [>= len(new), V] target logits each new token was chosen from
    seconds: float  # time verification took (beyond the forward)


@dataclass
class StepInfo:
    """What one batched step did and cost (the load controller's measurements)."""

    batch: int  # sequences stepped
    committed: int  # tokens added over all sequences
    drafted: int  # draft tokens over all sequences
    forward_tokens: int  # tokens the target forward processed
    forward_s: float
    draft_s: float  # drafting, setup excluded
    seconds: float  # the whole step, setup excluded
    setup_s: float = 0.0  # drafters catching up on new prompts (one-off per sequence)
    cap: int | None = None  # the draft cap it ran with: 0 also where it ran plain to measure plain decoding


class PromptTooLong(SpecdecError):
    """A prompt that leaves no free position in the context."""

    def __init__(self, tokens: int, context: int):
        super().__init__(
            f"prompt has {tokens} tokens but the context is {context} (at least one free position is needed; raise -c)"
        )
        self.tokens, self.context = tokens, context


class Engine:
    """Drives sequences through a target runner: prefill, then steps that draft for every running
    sequence, verify all of them in one batched target forward, and commit each on its own."""

    def __init__(
        self,
        target: ModelRunner,
        tokenizer: Tokenizer,
        spec: SpecConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.target, self.tokenizer = target, tokenizer
        self.spec = spec or SpecConfig()
        self.clock = clock  # seconds; `bench replay` passes a virtual one
        self.cost = CostModel()  # measured target/draft costs, shared by every sequence
        self.verify_hooks: dict[str, VerifyHook] = {}  # opt-in lossy drafters' verification, by spec type
        self.stop_ids = tokenizer.stop_ids(target.model.config.eos_token_ids)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """What new_sequence refuses, as SpecdecError: bad sampling parameters, an empty prompt, a prompt
        with no free position left in the context (PromptTooLong)."""
        params.validate()
        if not prompt_ids:
            raise SpecdecError("empty prompt")
        if len(prompt_ids) >= self.target.context:
            raise PromptTooLong(len(prompt_ids), self.target.context)

    def new_sequence(
        self,
        prompt_ids: list[int],
        options: RequestOptions | SamplingParams,
        slot: int = 0,
        on_text: StreamCallback | None = None,
        **fields: Any,
    ) -> Sequence:
        """A sequence ready to prefill in `slot`, running with the request's `options` (or sampling parameters and
        other RequestOptions `fields`: `RequestOptions.of`), the engine's relaxed acceptance where they have none;
        bad prompts and parameters raise SpecdecError."""
        options = RequestOptions.of(options, **fields)
        self.check(prompt_ids, options.params)
        if options.drafter is not None and options.drafter.features is not None:  # every forward captures them now
            self.target.capture = options.drafter.features.union(self.target.capture)
        if options.accept_threshold is None:
            options = replace(options, accept_threshold=self.spec.accept_threshold)
        params = options.params
        unseeded = not params.greedy and params.seed is None  # the only sequences that draw from a generator
        grammar = options.grammar
        vocab = self.target.vocab_size
        return Sequence(
            list(prompt_ids),
            len(prompt_ids),
            slot,
            options,
            generator=params.generator() if unseeded else None,
            on_text=on_text,
            detok=Detokenizer(self.tokenizer),
            started=self.clock(),
            constraint=None if grammar is None else Constraint(grammar, self.tokenizer, vocab, self.stop_ids),
        )

    def generate(
        self,
        prompt_ids: list[int],
        options: RequestOptions | SamplingParams,
        on_text: StreamCallback | None = None,
        **fields: Any,
    ) -> Sequence:
        """One sequence from prompt to finish (slot 0), with `options` as `new_sequence` takes them."""
        seq = self.new_sequence(prompt_ids, options, on_text=on_text, **fields)
        self.prefill(seq)
        while seq.finish_reason is None:
            self.step([seq])
        self.finish(seq)
        if seq.error:
            raise SpecdecError(seq.error)
        return seq

    def prefill(self, seq: Sequence, chunk: int | None = None) -> bool:
        """Feed the next `chunk` prompt tokens (all with None); after the last, sample the first output
        token. Returns True once the prompt is in."""
        t = self.clock()
        self._reuse_prefix(seq)
        end = len(seq.tokens) if chunk is None else min(len(seq.tokens), seq.prefilled + chunk)
        logits = self.target.prefill(seq.tokens[seq.prefilled : end], seq.slot, start=seq.prefilled)  # [V]
        feats = self.target.features
        return self._prefilled(seq, end, logits[None], feats[0] if feats else None, self.clock() - t)

    def prefill_together(self, seqs: list[Sequence]) -> None:
        """Prefill the rest of each sequence's prompt in one ragged target forward (each rest at most
        PREFILL_CHUNK tokens; longer ones go through `prefill`), then sample each first output token."""
        for s in seqs:
            self._reuse_prefix(s)
        short = [s for s in seqs if len(s.tokens) - s.prefilled <= PREFILL_CHUNK]
        for s in seqs:
            if len(s.tokens) - s.prefilled > PREFILL_CHUNK:
                self.prefill(s)
        if not short:
            return
        t = self.clock()
        logits = self.target.forward(
            [s.tokens[s.prefilled :] for s in short],
            [s.prefilled for s in short],
            [s.slot for s in short],
            last_only=True,
        )  # per sequence [1, V]
        feats = self.target.features
        share = (self.clock() - t) / len(short)
        for i, s in enumerate(short):
            self._prefilled(s, len(s.tokens), logits[i], feats[i] if feats else None, share)

    def _prefilled(self, seq: Sequence, end: int, logits: torch.Tensor, feats: Features | None, seconds: float) -> bool:
        """After a prefill forward up to `end`: hand the drafter its features, count the time and, once the
        prompt is in, sample the first output token from logits [1, V]. Returns whether the prompt is in."""
        self._hand_features(seq, [feats] if feats is not None else None)
        seq.prefilled = end
        seq.stats.prefill_s += seconds
        if end < len(seq.tokens):
            return False
        self._keep_prefix(seq, end)
        seq.stats.target_forwards = 1
        if seq.constraint is not None:
            logits = seq.constraint.mask(logits, [[]])
        self._commit(seq, [self._sample(logits, seq)], logits)
        return True

    def step(self, seqs: list[Sequence], draft_cap: int | None = None, light: bool = False) -> StepInfo:
        """One speculative step for every (prefilled, unfinished) sequence: draft up to `draft_cap` tokens each
        (`light`: only the parts of its drafter that run no model), run one target forward over each sequence's
        last token plus its draft (ragged chains batched; trees one forward each), then verify, roll back and
        commit each on its own.
        A failure in one sequence ends that sequence ("error"), not the batch. With adaptive lengths, a step runs
        plain where plain decoding at this batch is due a measurement (engine/adaptive.py)."""
        t0 = self.clock()
        if self.spec.adaptive and draft_cap != 0 and self.cost.plain_due(len(seqs)):
            draft_cap = 0
        # 1. propose: each sequence's drafter drafts (timed; its catch-up on a new prompt counted apart)
        proposals = DraftPlanner(self.spec, self.cost, self.target.context, self.clock).propose(seqs, draft_cap, light)
        seqs = [s for s in seqs if s.error is None]
        props = [_constrained(s, proposals[id(s)]) for s in seqs]
        if self.target.recurrent:  # one state per sequence: chains only
            props = [replace(p, draft=p.draft.as_chain()) for p in props]
        before = sum(len(s.tokens) for s in seqs)
        t1 = self.clock()
        # 2. forward: one target pass over every sequence's last token + draft
        logits, feats = self._forward(seqs, [p.draft for p in props])
        forward_s = self.clock() - t1
        drafted = sum(len(p.draft.tokens) for p in props)
        if len(seqs) == 1 or all(p.draft.parents is None and not self._resumed(p.draft) for p in props):
            self.cost.observe_verify(drafted + len(seqs), forward_s)  # one forward over that many tokens
        for seq, prop, seq_logits, seq_feats in zip(seqs, props, logits, feats):
            # 3. verify: the accepted path and the tokens to commit; 4. commit them, roll back the rest
            verdict = seq.guarded(self._verify, seq, prop.draft, seq_logits)
            if verdict is not None:
                seq.guarded(self._commit_step, seq, prop, verdict, forward_s, seq_feats)
        setup_s = sum(p.draft.setup_s for p in props)
        return StepInfo(
            batch=len(seqs),
            committed=sum(len(s.tokens) for s in seqs) - before,
            drafted=drafted,
            forward_tokens=drafted + len(seqs),
            forward_s=forward_s,
            draft_s=t1 - t0 - setup_s,
            seconds=self.clock() - t0 - setup_s,
            setup_s=setup_s,
            cap=draft_cap,
        )

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Close a sequence (finished, or cancelled with `reason`): flush its stream, free drafter state."""
        if reason:
            seq.finish_reason = reason
        self._stream(seq, final=True)
        if seq.drafter:
            seq.drafter.release(seq)
        if seq.finish_reason in ("stop", "length") and seq.error is None:
            self._keep_prefix(seq, seq.last_position)  # the last token has no K/V yet
        if self.target.prefix is not None:
            self.target.prefix.release(seq.prefix_held)
            seq.prefix_held = None
        seq.stats.total_s = self.clock() - seq.started

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Before a sequence's first prefill forward: copy the target K/V of its longest cached prompt prefix into
        its slot and prefill only the rest. Not for drafters that read target features: they need the features
        of every prompt token, which the cache does not keep."""
        store = self.target.prefix
        reads_features = seq.drafter is not None and seq.drafter.features is not None
        if store is None or seq.prefilled or not seq.options.cache_prompt or reads_features:
            return
        seq.cached_tokens, seq.prefix_held = store.reuse(seq.slot, seq.tokens, seq.options.cache_salt)
        seq.prefilled = seq.cached_tokens

    def _keep_prefix(self, seq: Sequence, end: int) -> None:
        """Keep the target K/V of seq.tokens[:end] (all in its slot) in the prefix cache."""
        if self.target.prefix is not None and seq.options.cache_prompt:
            self.target.prefix.keep(seq.slot, seq.tokens[:end], seq.options.cache_salt)

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> int:
        if seq.params.greedy:
            return top2(logits[:1])[0][0]
        if seq.seeded:
            return seeded_pick(logits[0], seq.params, len(seq.tokens))
        return int(sample(probs_from_logits(logits, seq.params), seq.generator)[0])

    def _forward(self, seqs: list[Sequence], drafts: list[Draft]) -> tuple[list[torch.Tensor], list[Features | None]]:
        """Per sequence, target logits [1 + nodes, V] over its last committed token and its draft, and their
        features (None unless a drafter asked for them)."""
        out: list[torch.Tensor | None] = [None] * len(seqs)
        feats: list[Features | None] = [None] * len(seqs)
        groups: dict[int, list[int]] = {}  # chains by the layer their forward starts at (resumed drafts: not 0)
        for i, d in enumerate(drafts):
            if d.parents is None:
                groups.setdefault(d.resume_layer if self._resumed(d) else 0, []).append(i)
        for layer, chains in groups.items():
            inputs = [
                ([seqs[i].tokens[-1]] + drafts[i].tokens)[: len(drafts[i].resume) if layer else None] for i in chains
            ]
            resumed = {"resume": [drafts[i].resume for i in chains], "resume_layer": layer} if layer else {}
            res = self.target.forward(
                inputs, [seqs[i].last_position for i in chains], [seqs[i].slot for i in chains], **resumed
            )
            for j, i in enumerate(chains):
                out[i] = _no_bonus_row(res[j], len(drafts[i].tokens))
                feats[i] = self.target.features[j] if self.target.features else None
        for i, d in enumerate(drafts):
            if d.parents is not None:
                s = seqs[i]
                out[i] = self.target.verify_tree(s.slot, s.last_position, [s.tokens[-1]] + d.tokens, d.parents)
                feats[i] = self.target.features[0] if self.target.features else None
        return out, feats

    def _resumed(self, draft: Draft) -> bool:
        """Whether the target's forward over this draft starts where the drafter's left off (`Draft.resume`);
        not while features of every layer are captured."""
        return draft.parents is None and draft.resume is not None and self.target.capture is None

    def _verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor) -> Verdict:
        """Which draft nodes the target accepts and what to commit, from its logits [N+1, V] (lossless; an opt-in
        lossy drafter's hook may decide instead)."""
        t = self.clock()
        if seq.constraint is not None:
            logits = seq.constraint.mask(logits, draft.paths())
        decided = next((d for d in (h(seq, draft, logits) for h in self.verify_hooks.values()) if d is not None), None)
        parents = chain(len(draft.tokens)) if draft.parents is None else draft.parents
        threshold = seq.options.accept_threshold
        relax = Relaxed(draft.tokens, logits, seq.params, threshold) if threshold else None
        if decided is not None:
            new, path = decided
        elif seq.params.greedy:
            new, path = verify_tree_greedy(draft.tokens, parents, logits, relax)
        elif seq.seeded:
            new, path = verify_tree_seeded(draft.tokens, parents, logits, seq.params, len(seq.tokens), relax)
        else:
            new, path = verify_tree_sampling(
                draft.tokens, parents, draft.probs, logits, seq.params, seq.generator, relax
            )
        if self._resumed(draft) and len(draft.resume) == len(draft.tokens) == len(path):
            new = new[:-1]  # a resumed verify without the last token's row has no bonus token
        seq.stats.relaxed += relax.count if relax else 0
        rows = logits if draft.parents is None else logits[[0] + [i + 1 for i in path]]
        return Verdict(new, path, rows, self.clock() - t)

    def _commit_step(
        self, seq: Sequence, prop: Proposal, verdict: Verdict, forward_s: float, feats: Features | None
    ) -> None:
        """Keep the accepted path's KV (trees: compacted), record the step, commit its tokens, tell the drafter
        (and hand it the accepted rows' target features when it reads them)."""
        draft, path = prop.draft, verdict.path
        self._hand_features(seq, None if feats is None else [feats.accepted(path)])
        if draft.parents is not None:
            self.target.keep_path(seq.slot, seq.last_position, path)
        seq.stats.verify_s += forward_s + verdict.seconds
        seq.stats.record_step(prop.asked, len(draft.tokens), len(path), draft.depth)
        if draft.tokens:
            seq.acceptance_of(source(seq, draft)).observe(draft.depth, len(path))
            self.cost.acceptance(source(seq, draft)).observe(draft.depth, len(path))
        self._commit(seq, verdict.new, verdict.rows, draft, path)
        if seq.drafter:
            seq.drafter.update(seq, len(draft.tokens), len(path))

    def _hand_features(self, seq: Sequence, feats: list[Features] | None) -> None:
        """Give a drafter that reads target features its own layers of `feats[0]` (rows of committed tokens)."""
        d = seq.drafter
        if feats and d is not None and d.features is not None:
            d.observe_features(seq, feats[0].columns(d.features.layers, self.target.capture.layers))

    def _commit(
        self,
        seq: Sequence,
        new: list[int],
        logits: torch.Tensor,
        draft: Draft | None = None,
        path: list[int] | None = None,
    ) -> None:
        """Append verified tokens one by one, stopping at EOS, stop strings, max tokens or the context.

        logits [>= len(new), V]: row i is the target distribution token i was chosen from; draft and path (the
        accepted nodes): what the step drafted, for the sequence's trace when it keeps one.
        """
        before = len(seq.tokens)
        rows = logits[: len(new)]
        gaps = top2(rows)[1]  # [n]
        if seq.logprobs is not None:
            lps = _logprobs(rows, new, seq.options.top_logprobs)
        stops = StopScan(seq.params.stop, seq.text[seq.streamed :])
        pieces: list[str] = []  # the text each committed token added (for the trace)
        for i, (tok, gap) in enumerate(zip(new, gaps)):
            if tok in self.stop_ids:
                seq.finish_reason = "stop"
                break
            seq.tokens.append(tok)
            seq.top2_gaps.append(gap)
            if seq.logprobs is not None:
                seq.logprobs.append(lps[i])
            seq.stats.new_tokens += 1
            pieces.append(seq.detok.push([tok]))
            text = seq.text + pieces[-1]
            cut = stops.find(text, len(seq.text))
            if cut is not None:
                seq.finish_reason, text = "stop", text[:cut]
            seq.text = text
            if seq.finish_reason:
                break
            if len(seq.output_ids) >= seq.params.max_tokens or len(seq.tokens) >= self.target.context:
                seq.finish_reason = "length"
                break
        if seq.constraint is not None:
            seq.constraint.commit(seq.tokens[before:])
        if seq.trace is not None:
            who = (draft.source if draft else None) or (seq.drafter.name if seq.drafter else None)
            seq.trace += step_trace(
                seq.stats.target_forwards - 1,
                new[: len(seq.tokens) - before],
                rows,
                gaps,
                draft,
                path or [],
                who,
                pieces,
            )
        self._stream(seq, final=seq.finish_reason is not None, held=stops.held)

    @staticmethod
    def _stream(seq: Sequence, final: bool, held: int = 0) -> None:
        """Hand new text to on_text, holding back `held` characters at the end that could still grow into a
        stop string (what the next commit's StopScan resumes from)."""
        end = len(seq.text) if final else len(seq.text) - held
        if seq.on_text and end > seq.streamed:
            seq.on_text(seq.text[seq.streamed : end])
        seq.streamed = max(seq.streamed, end)


def _constrained(seq: Sequence, prop: Proposal) -> Proposal:
    """The proposal without the drafted tokens the sequence's grammar rejects, where cutting them keeps the output
    distribution: greedy, seeded, or one-hot drafts (a sampled draft's rejections need its probabilities)."""
    draft = prop.draft
    if seq.constraint is None or not draft.tokens or not (seq.params.greedy or seq.seeded or draft.probs is None):
        return prop
    keep = seq.constraint.valid(draft.paths()[1:])
    return prop if len(keep) == len(draft.tokens) else replace(prop, draft=draft.subset(keep))


def _no_bonus_row(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits [k, V] of a resumed verify without the last draft token's row -> [k + 1, V], the last row a stand-in
    (its bonus token is dropped); [k + 1, V] as they are."""
    return logits if len(logits) > k else torch.cat([logits, logits[-1:]])


def _logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """logits [n, V] -> per row, the log-probability of tokens[i] and the `top` best (token, log-probability)."""
    lp = logits.float().log_softmax(-1)  # [n, V]
    chosen = lp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()  # [n]
    if top <= 0:
        return [(c, []) for c in chosen]
    best = lp.topk(top, dim=-1)  # [n, top]
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, best.indices.tolist(), best.values.tolist())]
