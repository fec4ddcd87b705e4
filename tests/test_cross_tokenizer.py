"""`draft` with a draft model whose tokenizer differs from the target's (drafters/cross_tokenizer.py).

The target's tiny models use the word tokenizer (t0..t95, words joined by spaces); the draft's spell the same text
with characters and a few merges ("t", digits, " ", and t0..t9 as tokens: twins of the target's t0..t9), so a
target token is one to three draft tokens and the spaces between words are draft tokens of their own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny, word_tokenizer
from test_lossless_sampling import BATCH, MarkovRunner, rejected, run_engine
from test_lossless_sampling import _engine as markov_engine

import specdec
from specdec.drafters.cross_tokenizer import CrossTokenizerDrafter, clean_tail, encode_after, span_text, text, window
from specdec.engine.engine import SpecConfig
from specdec.errors import SpecdecError
from specdec.models.tokenizer import Tokenizer
from specdec.sampling import SamplingParams
from specdec.sequence import Sequence

PROMPT_TEXT = "t3 t17 t42 t5 t88 t13 t9 t61"


def char_tokenizer(directory: Path, digits: int = 10) -> Tokenizer:
    """Characters 't', '0'..'9' (up to `digits`), ' ', and the merges t0.. as tokens; id 0 is 't0' (EOS)."""
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models

    chars = ["t", " "] + [str(i) for i in range(digits)]
    vocab = {f"t{i}": i for i in range(digits)} | {c: digits + j for j, c in enumerate(chars)}
    fast = Fast(models.BPE(vocab, [("t", str(i)) for i in range(digits)]))
    fast.decoder = decoders.Fuse()
    directory.mkdir(parents=True, exist_ok=True)
    fast.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t0"}))
    return Tokenizer(directory)


def byte_tokenizer(directory: Path) -> Tokenizer:
    """A byte-level BPE trained on a few lines: 'hello' is one token, '😀' four byte tokens."""
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, pre_tokenizers, trainers

    fast = Fast(models.BPE())
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    fast.train_from_iterator(["hello world, hello there", "hello hello help"] * 20, trainer)
    fast.save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft) checkpoint directories: different vocabularies, sizes and families."""
    root = tmp_path_factory.mktemp("cross")
    target = make_tiny(root / "target", "llama", seed=0)
    draft = make_tiny(root / "draft", "qwen2", seed=1, vocab=32)
    char_tokenizer(draft)
    return target, draft


def _llm(target: Path, draft: Path) -> specdec.LLM:
    llm = specdec.LLM(
        str(target), draft=str(draft), spec_type="draft", dtype="fp32", adaptive=False, draft_max=4, progress=False
    )
    llm.engine.stop_ids = set()
    return llm


def test_helpers_at_character_and_merge_boundaries(tmp_path):
    tok = byte_tokenizer(tmp_path)
    ids = tok.encode("hello 😀", add_special_tokens=False)
    assert span_text(tok, ids, 0, len(ids) - 1) is None  # ends inside the emoji
    assert tok.fast.encode("hello 😀").tokens == ["hello", "Ġ", "ð", "Ł", "ĺ", "Ģ"]
    assert clean_tail(tok, ids[:-1], 0) == (2, "hello ")  # backs off to the last whole character
    assert clean_tail(tok, ids, 2) == (6, "😀")
    ids = tok.encode("hello hello 😀 hello", add_special_tokens=False)
    assert window(tok, ids) == (3, "😀 hello")  # the last 4 tokens would start inside the emoji
    assert encode_after(tok, "hel", "lo") is None  # 'hello' would straddle the join
    assert tok.fast.decode(encode_after(tok, "hello", " there")) == " there"


def test_drafter_is_chosen_and_greedy_equals_plain(pair):
    llm = _llm(*pair)
    assert isinstance(llm.drafter, CrossTokenizerDrafter)
    plain = llm.generate(PROMPT_TEXT, max_tokens=24, spec_type="none")
    spec = llm.generate(PROMPT_TEXT, max_tokens=24)
    # drafted only: the random draft's text seldom spells the target's words (test_rollback_to_accepted_text and
    # test_smollm2_drafts_for_qwen_coder_1_5b get drafts accepted)
    assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0


def test_draft_vocab_is_refused_across_tokenizers(pair):
    with pytest.raises(SpecdecError, match="draft-vocab"):
        specdec.LLM(str(pair[0]), draft=str(pair[1]), spec_type="draft", dtype="fp32", draft_vocab=16, progress=False)


def test_batched_steps_chains_and_a_full_context(pair):
    """Three sequences stepped together, chains with model-free drafters, and a draft context that fills up (the
    draft spends ~3 tokens per target word): all equal plain decoding."""
    llm = specdec.LLM(
        str(pair[0]),
        draft=str(pair[1]),
        spec_type="draft",
        dtype="fp32",
        adaptive=False,
        draft_max=4,
        parallel=3,
        context=64,
        progress=False,
    )
    llm.engine.stop_ids = set()
    prompts = [PROMPT_TEXT, "t7 t7 t1 t2", "t50 t51 t52 t53 t50 t51 t52"]
    plain = [llm.generate(p, max_tokens=200, spec_type="none").token_ids for p in prompts]
    seqs = [
        llm.engine.new_sequence(llm.encode(p), SamplingParams(max_tokens=200), slot=i, drafter=llm.drafter)
        for i, p in enumerate(prompts)
    ]
    for s in seqs:
        llm.engine.prefill(s)
    while live := [s for s in seqs if s.finish_reason is None]:
        llm.engine.step(live)
    assert [s.output_ids for s in seqs] == plain
    assert all(len(p) == 64 - len(llm.encode(q)) for p, q in zip(plain, prompts))  # ran into the context
    assert sum(s.stats.drafted for s in seqs) > 0  # drafted only: the random draft seldom spells the target's words
    repeat = "t1 t1 t1 t1 t1 t1"  # the target repeats t1: the model-free members' drafts are accepted
    plain.append(llm.generate(repeat, max_tokens=200, spec_type="none").token_ids)
    for spec in ("ngram-simple,draft", "suffix,draft"):
        drafted = accepted = 0
        for p, want in ((prompts[2], plain[2]), (repeat, plain[3])):
            r = llm.generate(p, max_tokens=200, spec_type=spec)
            assert r.token_ids == want, (spec, p)
            drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
        assert drafted > 0 and accepted > 0, spec


class OracleRunner:
    """A draft 'model' over the character tokenizer that knows the text to come: it predicts the next draft token
    of `reference` after what its cache holds, and a wrong one ('9') at every `wrong_every`-th position."""

    def __init__(self, tok: Tokenizer, reference: str, wrong_every: int, context: int = 256):
        self.tok, self.reference, self.wrong_every, self.context = tok, reference, wrong_every, context
        self.vocab_size = tok.vocab_size
        self.hist: dict[int, list[int]] = {}

    def _logits(self, ids: list[int]) -> torch.Tensor:
        """[V_draft]: a peak on the predicted token."""
        seen = self.tok.fast.decode(ids, skip_special_tokens=False)
        rest = self.reference[len(seen) :] if self.reference.startswith(seen) else ""
        nxt = self.tok.encode(rest, add_special_tokens=False)[:1] or [0]
        tok = self.tok.token_id("9") if len(ids) % self.wrong_every == 0 else nxt[0]
        return torch.zeros(self.vocab_size).index_fill_(0, torch.tensor([tok]), 10.0)

    def prefill(self, tokens: list[int], slot: int, start: int = 0) -> torch.Tensor:
        h = self.hist.setdefault(slot, [])
        h[start:] = tokens
        return self._logits(h)

    def forward(self, chunks, starts, slots, last_only=False, settle=True):
        return [self.prefill(c, slot, s)[None] for c, s, slot in zip(chunks, starts, slots)]


class Checked(CrossTokenizerDrafter):
    """Checks at every catch-up that the draft's cache now holds tokens spelling exactly the committed text, up to
    a character split across the last target tokens."""

    checked = 0

    def _synced(self, st, ids, end, logits):
        super()._synced(st, ids, end, logits)
        assert self.slots[st.seq.slot].cached == ids and len(st.seq.tokens) - end < 4
        assert text(self.draft_tok, ids) == text(self.target_tok, st.seq.tokens[:end])
        self.checked += 1


def test_rollback_to_accepted_text(pair, tmp_path):
    """A draft that is right except at every 17th position (about every 5th word): output equals plain, most drafts
    are accepted, and after a rejection the draft's cache holds the re-encoded accepted text (a rolled-back tail)."""
    llm = _llm(*pair)
    dtok = char_tokenizer(tmp_path / "chars")
    plain = llm.generate(PROMPT_TEXT, max_tokens=32, spec_type="none")
    reference = llm.tokenizer.decode(llm.encode(PROMPT_TEXT) + plain.token_ids)
    drafter = Checked(OracleRunner(dtok, reference, 17), llm.tokenizer, dtok, llm.runner.vocab_size)
    llm.drafter = drafter
    spec = llm.generate(PROMPT_TEXT, max_tokens=32)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted >= 0.5 * spec.stats.drafted > 0
    assert spec.stats.accepted < spec.stats.drafted and drafter.checked > 5  # some were rejected and rolled back


class DraftMarkov(MarkovRunner):
    """MarkovRunner over the draft's own vocabulary (its table's width)."""

    @property
    def vocab_size(self) -> int:
        return self.table.shape[-1]


class Recording(CrossTokenizerDrafter):
    """Counts drafted tokens by how they are verified: with the draft's exact q, one-hot after exact ones (through
    text), or in a draft with no q at all."""

    exact = one_hot_after = deterministic = accepted = 0

    def _draft(self, st):
        draft = super()._draft(st)
        if draft.probs is None:
            self.deterministic += len(draft.tokens)
        else:
            exact = int((draft.probs.max(-1).values < 1).sum())
            self.exact, self.one_hot_after = self.exact + exact, self.one_hot_after + len(draft.tokens) - exact
        return draft

    def update(self, seq, drafted, accepted):
        super().update(seq, drafted, accepted)
        self.accepted += accepted


@pytest.fixture(scope="module")
def markov_tokenizers(tmp_path_factory) -> tuple[Tokenizer, Tokenizer]:
    """(target, draft) for the Markov tables: words t0..t5, and characters with merges t0..t5."""
    d = tmp_path_factory.mktemp("markov-words")
    word_tokenizer(d, 6)
    return Tokenizer(d), char_tokenizer(tmp_path_factory.mktemp("markov-chars"), digits=6)


def _markov_drafter(tokenizers: tuple[Tokenizer, Tokenizer]) -> Recording:
    """A random second-order Markov draft over the character vocabulary, drafting for the 6-word target."""
    target_tok, draft_tok = tokenizers
    n, twins, t, space, digits = draft_tok.vocab_size, slice(1, 6), 6, 7, slice(8, 14)  # t0 (EOS) left out
    table = torch.randn(n, n, n, generator=torch.Generator().manual_seed(3))  # [prev, cur, next] logits
    table[:, :6, space] += 2.0  # after a word or a digit: a space (no twin: through text), or a twin
    table[:, digits, space] += 2.0
    table[:, :6, twins] += 1.0
    table[:, space, t] += 2.0  # then 't' and a digit: a word spelled in characters
    table[:, t, digits] += 2.0
    drafter = Recording(DraftMarkov(table, BATCH, context=128), target_tok, draft_tok, 6)
    return drafter


@pytest.mark.parametrize(
    "params,adaptive", [(SamplingParams(temperature=1.0), False), (SamplingParams(temperature=1.0, top_p=0.9), True)]
)
def test_sampling_matches_plain(markov_tokenizers, params, adaptive):
    """Rejection sampling with exact q on twins and one-hot through text: the first six output tokens are distributed
    as plain sampling (each position, consecutive pairs and triples: `rejected`; 4,000 runs). Fixed drafts of 6
    (budget 12 draft tokens) mix both kinds in one draft; adaptive lengths and the confidence stop cut them."""
    torch.set_num_threads(1)
    engine = markov_engine(markov_tokenizers[0])
    engine.spec = SpecConfig(draft_max=6, adaptive=adaptive)
    drafter = _markov_drafter(markov_tokenizers)
    samples = list(run_engine(engine, drafter, params, runs=4000).values())
    assert not rejected(samples, params)
    kinds = (drafter.exact, drafter.deterministic) + (() if adaptive else (drafter.one_hot_after,))
    assert min(kinds) > 300, vars(drafter)


def test_seeded_equals_plain(markov_tokenizers):
    """Seeded sampling: token-identical to plain decoding with the same seed."""
    torch.set_num_threads(1)
    params = SamplingParams(temperature=1.0)
    plain = run_engine(markov_engine(markov_tokenizers[0]), None, params, runs=500, seeds=True)
    drafter = _markov_drafter(markov_tokenizers)
    assert run_engine(markov_engine(markov_tokenizers[0]), drafter, params, runs=500, seeds=True) == plain
    assert drafter.exact + drafter.deterministic > 200 and drafter.accepted > 0, vars(drafter)


class NullRunner:
    """A draft runner with no model: flat logits, any context."""

    context = 1 << 20

    def __init__(self, vocab: int):
        self.vocab_size = vocab

    def forward(self, chunks, starts, slots, last_only=False, settle=True):
        return [torch.zeros(1, self.vocab_size) for _ in chunks]

    def prefill(self, tokens: list[int], slot: int, start: int = 0) -> torch.Tensor:
        return torch.zeros(self.vocab_size)


@pytest.mark.real
def test_catch_up_keeps_the_draft_on_the_target_text(smollm_dir):
    """Qwen2.5's tokens committed two at a time (code, accents, CJK split across byte tokens, an emoji, ChatML
    markers): at every catch-up the draft's tokens spell exactly the target's text, lagging by at most a split
    character, and in the end they are the draft tokenizer's own encoding of the whole text."""
    from specdec.models.packs import pull

    target_tok, draft_tok = Tokenizer(pull("qwen2.5-coder-0.5b", progress=False)), Tokenizer(smollm_dir)
    drafter = Checked(NullRunner(49152), target_tok, draft_tok, 151936)
    full = "<|im_start|>user\ndef café():\n    return '東京 😀'  # naïve\n<|im_end|>\n"
    ids = target_tok.encode(full, add_special_tokens=False)
    seq = Sequence(ids[:3], 3, 0, SamplingParams())
    for n in [*range(3, len(ids), 2), len(ids)]:
        seq.tokens = ids[:n]
        drafter.propose(seq, 4)
    slot = drafter.slots[0]
    assert slot.synced == len(ids) and slot.cached[: slot.committed] == draft_tok.encode(full, add_special_tokens=False)
    assert drafter.checked == len(ids) // 2


@pytest.mark.real
def test_smollm2_drafts_for_qwen_coder_1_5b(smollm_dir):
    """SmolLM2-135M (49k vocabulary) drafting for Qwen2.5-Coder-1.5B (151k), fp32: greedy output equals plain
    decoding and drafts are accepted."""
    from specdec.models.packs import pull

    llm = specdec.LLM(
        str(pull("qwen2.5-coder-1.5b", progress=False)),
        draft=str(smollm_dir),
        spec_type="draft",
        dtype="fp32",
        quant="none",
        draft_quant="none",
        adaptive=False,
        draft_max=4,
        progress=False,
    )
    assert isinstance(llm.drafter, CrossTokenizerDrafter)
    accepted = 0
    for prompt in ("def fibonacci(n):\n", "The capital of France is"):
        plain = llm.generate(prompt, max_tokens=12, spec_type="none")
        spec = llm.generate(prompt, max_tokens=12)
        assert spec.token_ids == plain.token_ids, prompt
        accepted += spec.stats.accepted
    assert accepted >= 4
