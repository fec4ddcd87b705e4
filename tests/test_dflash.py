"""Block drafters (DFlash, DSpark): conformance with the reference model definitions, layouts, lossless drafting.

Conformance (test-only installs, scripts/test.sh): with the same random fp32 weights our network gives the same
block states and logits as z-lab's `dflash==0.1.0` `DFlashDraftModel` (context features + noise block, no cache) and
as `speculators==0.9.0`'s `DFlashDraftModel` / `DSparkDraftModel` (one anchored block of its training forward; DSpark's
Markov bias and confidence logits from its own heads, teacher-forced on the block's tokens). Inputs map one to one:
their context rows 0..p-1 are the features of our committed tokens before the anchor p, their block is ours at
positions p..p+B-1. Checkpoints written by each reference load here, and ours load there.

Lossless: greedy equality in fp32 against plain decoding (tiny targets and SmolLM2-135M), also with the confidence
head truncating blocks; the statistical sampling test through the engine; the draft KV cache of injected context
equals a fresh injection of every committed token's features at every propose.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from conftest import make_tiny
from test_eagle3 import engine_fit
from test_eagle3_conformance import needs_speculators
from test_train_data import chat_dir, rules  # noqa: F401 (fixtures)

import specdec
from specdec.drafters.dflash import DFlashDrafter
from specdec.models.config import ModelConfig
from specdec.models.dflash import BlockConfig, BlockDraft, load_block_drafter, save_speculators, save_zlab
from specdec.models.transformer import Batch
from specdec.runtime.kv_cache import KVCache

needs_dflash = pytest.mark.skipif(
    importlib.util.find_spec("dflash") is None, reason="dflash==0.1.0 not installed (test-only: scripts/test.sh)"
)
QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "rope_theta": 20000.0,
    "tie_word_embeddings": False,
}
FEATURES, BLOCK, MASK, N = (1, 2, 3), 4, 5, 12  # feature layers, block size, mask token, context rows
RUNS = 6000  # sampled runs through the engine (the EAGLE-3 test runs 8,000)


def random_net(c: BlockConfig, seed: int = 0, scale: float = 0.3) -> BlockDraft:
    """Every weight random (norms around 1)."""
    net = BlockDraft(c)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if p.dim() == 1 else 0.0))
    return net.eval()


def config(dspark: bool = False, **kw) -> BlockConfig:
    layer = ModelConfig.from_hf_dict(QWEN3)
    return BlockConfig(
        layer, FEATURES, BLOCK, MASK, sample_from_anchor=dspark, markov_rank=8 if dspark else 0, confidence=dspark, **kw
    )


def our_block(net: BlockDraft, feats: torch.Tensor, block: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """Context features [n, F, H] at positions 0..n-1, block tokens [B] at n.. -> post-norm block states [B, H]."""
    n, B = feats.shape[0], block.shape[0]
    cache = net.allocate_cache(1, n + B)
    slots = torch.tensor([0])

    def batch(start: int, count: int) -> Batch:
        pos = torch.arange(start, start + count)[None]
        cos, sin = net.rotary.tables(pos, torch.float32)
        return Batch(slots, pos, cos, sin, None, start + count, KVCache.span(slots, pos))

    with torch.no_grad():
        net.inject(net.context(feats)[None], batch(0, n), cache)
        return net.block(embed[block][None], batch(n, B), cache)[0]


def _inputs(seed: int = 1, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, len(FEATURES), QWEN3["hidden_size"], generator=g), torch.randint(0, 96, (n,), generator=g)


# --- z-lab dflash 0.1.0 ---


def zlab_model(c: BlockConfig):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        **{k: v for k, v in QWEN3.items() if k != "model_type"},
        num_target_layers=6,
        block_size=c.block_size,
        dflash_config={"target_layer_ids": [i - 1 for i in c.feature_layers], "mask_token_id": c.mask_token_id},
    )
    cfg._attn_implementation = "sdpa"
    return DFlashDraftModel(cfg).eval()


def zlab_block(model, feats: torch.Tensor, block: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    n, B = feats.shape[0], block.shape[0]
    with torch.no_grad():
        return model(
            position_ids=torch.arange(n + B)[None],
            noise_embedding=embed[block][None],
            target_hidden=feats.flatten(1)[None],
        )[0]


@needs_dflash
def test_zlab_dflash_gives_the_same_block(tmp_path):
    """Their checkpoint loads as ours with the same block states; ours (save_zlab) loads there likewise."""
    model = zlab_model(config())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(str(tmp_path / "theirs"))
    net = load_block_drafter(tmp_path / "theirs")
    assert net.config == config()
    feats, ids = _inputs()
    embed, lm_head = torch.randn(96, 64, generator=g), torch.randn(96, 64, generator=g)
    block = torch.tensor([int(ids[-1])] + [MASK] * (BLOCK - 1))
    ours, theirs = our_block(net, feats, block, embed), zlab_block(model, feats, block, embed)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1:] @ lm_head.T, theirs[1:] @ lm_head.T, rtol=1e-4, atol=1e-4)
    from dflash.model import DFlashDraftModel

    mine = random_net(config(), seed=4)
    save_zlab(mine, tmp_path / "ours", num_target_layers=6)
    back = DFlashDraftModel.from_pretrained(str(tmp_path / "ours")).eval()
    torch.testing.assert_close(
        our_block(mine, feats, block, embed), zlab_block(back, feats, block, embed), rtol=1e-5, atol=1e-5
    )


# --- speculators 0.9.0 dflash / dspark ---


def speculators_model(c: BlockConfig):
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    proposal = GreedyTokenProposalConfig(speculative_tokens=c.drafts)
    spec = SpeculatorsConfig(
        algorithm=c.kind,
        proposal_methods=[proposal],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
    )
    layer = Qwen3Config(**{k: v for k, v in QWEN3.items() if k != "model_type"})
    layer._attn_implementation = "eager"
    common = dict(
        transformer_layer_config=layer,
        draft_vocab_size=96,
        block_size=c.block_size,
        aux_hidden_state_layer_ids=list(c.feature_layers),
        mask_token_id=c.mask_token_id,
        sample_from_anchor=c.sample_from_anchor,
        speculators_config=spec,
    )
    if c.kind == "dspark":
        model = DSparkDraftModel(DSparkSpeculatorConfig(**common, markov_rank=c.markov_rank))
    else:
        model = DFlashDraftModel(DFlashSpeculatorConfig(**common))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 and "norm" in name else 0.0))
        model.verifier_lm_head.weight.copy_(model.lm_head.weight)
    return model.eval()


def speculators_block(model, feats: torch.Tensor, ids: torch.Tensor, p: int):
    """Their training forward for one anchored block at p -> (states [B, H], logits [B, V], Markov-biased logits,
    confidence logits [B]; the last two None for DFlash)."""
    T = feats.shape[0]
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, p] = 1
    with torch.no_grad():
        hidden, logits, *_ = model._backbone_forward(
            feats.flatten(1)[None],
            ids[None],
            loss_mask,
            torch.randn(1, T, 64),
            torch.zeros(1, T, dtype=torch.long),
            max_anchors=1,
        )
        hidden, logits = hidden[0], logits[0]
        if getattr(model, "markov_head", None) is None:
            return hidden, logits, None, None
        prev = ids[p : p + hidden.shape[0]][None]
        emb = model.markov_head.prev_embeddings(prev)
        biased = logits + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden[None], prev_emb=emb)[0]
        return hidden, logits, biased, model.confidence_head(torch.cat([hidden[None], emb], dim=-1))[0]


@needs_speculators
@pytest.mark.parametrize("dspark", [False, True])
def test_speculators_gives_the_same_block(tmp_path, dspark):
    """speculators' own checkpoint loads as ours: same block states and logits, DSpark's Markov-biased logits and
    confidence logits; our save_speculators loads into their model with the same weights."""
    c = config(dspark)
    model = speculators_model(c)
    model.save_pretrained(str(tmp_path / "theirs"))
    net = load_block_drafter(tmp_path / "theirs")
    assert net.config == c
    feats, ids = _inputs(2, n=N + BLOCK + 1)
    p = N
    hidden, logits, biased, conf = speculators_block(model, feats, ids, p)
    embed, lm_head = model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    block = torch.tensor([int(ids[p])] + [MASK] * (BLOCK - 1))
    ours = our_block(net, feats[:p], block, embed)
    torch.testing.assert_close(ours, hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours @ lm_head.T, logits, rtol=1e-4, atol=1e-4)
    if dspark:
        prev = ids[p : p + BLOCK]
        with torch.no_grad():
            torch.testing.assert_close(ours @ lm_head.T + net.markov_bias(prev), biased, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(net.confidence(ours, prev), conf, rtol=1e-4, atol=1e-4)
    save_speculators(net, tmp_path / "ours", verifier="none")
    back = speculators_model(c)
    state = load_file_state(tmp_path / "ours")
    missing, unexpected = back.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {
        "embed_tokens.weight",
        "lm_head.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }
    for name, t in model.state_dict().items():
        if name not in missing:
            torch.testing.assert_close(back.state_dict()[name], t, rtol=0, atol=0, msg=name)


def load_file_state(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_packed_training_forward_equals_the_cached_one():
    """Two anchored blocks of one packed row (queries: context before their anchor + their own block) give the
    states the drafter's cached forward gives each block."""
    net = random_net(config(True), seed=6)
    feats, ids = _inputs(3, n=20)
    embed = torch.randn(96, 64, generator=torch.Generator().manual_seed(8))
    anchors = torch.tensor([7, 15])
    blocks = torch.full((2, BLOCK), MASK)
    blocks[:, 0] = ids[anchors]
    a = anchors.repeat_interleave(BLOCK)  # [M]
    own = torch.arange(2 * BLOCK) // BLOCK
    mask = torch.cat([torch.arange(20)[None] < a[:, None], own[:, None] == own[None]], dim=1)[None, None]
    positions = (anchors[:, None] + torch.arange(BLOCK)).reshape(1, -1)
    with torch.no_grad():
        h = net.packed(net.context(feats)[None], torch.arange(20)[None], embed[blocks.reshape(1, -1)], positions, mask)[
            0
        ].reshape(2, BLOCK, -1)
    for j, p in enumerate(anchors.tolist()):
        torch.testing.assert_close(h[j], our_block(net, feats[:p], blocks[j], embed), rtol=1e-5, atol=1e-5)


# --- drafting through the engine ---


def drafter_dir(tmp_path, target, dspark: bool, seed: int = 1, scale: float = 0.3, **kw):
    """A random drafter for `target` in the layout its kind ships in, with a manifest."""
    t = ModelConfig.from_file(target / "config.json")
    c = BlockConfig.for_target(
        t,
        num_layers=kw.pop("layers", 2),
        block_size=kw.pop("block", BLOCK),
        mask_token_id=MASK,
        dspark=dspark,
        markov_rank=kw.pop("rank", 8),
    )
    net = random_net(c, seed, scale)
    kind, out = c.kind, tmp_path / c.kind
    manifest = {"kind": kind, "target": target.name}
    if dspark:
        save_speculators(net, out, str(target), manifest)
    else:
        save_zlab(net, out, t.num_layers, manifest)
    return out


def llm_for(target, kind: str, head, **kw) -> specdec.LLM:
    llm = specdec.LLM(
        str(target), spec_type=kind, dtype="fp32", adaptive=False, progress=False, **{f"{kind}_head": str(head)}, **kw
    )
    llm.engine.stop_ids = set()
    return llm


PROMPTS = ["t5 t9 t12 t5 t9 t12 t5 t9", "t8 " * 20 + "t4"]


@pytest.mark.parametrize("kind,threshold", [("dflash", 0.0), ("dspark", 0.0), ("dspark", 0.9)])
def test_greedy_equals_plain(tiny_dir, tmp_path, kind, threshold):
    """Any block drafter is lossless greedy in fp32; the confidence head's truncation (threshold > 0) too."""
    target = tiny_dir("qwen3", seed=2, layers=4)
    head = drafter_dir(tmp_path, target, kind == "dspark")
    llm = llm_for(
        target,
        kind,
        head,
        context=128,
        draft_max=BLOCK,
        **({"dspark_threshold": threshold} if kind == "dspark" else {}),
    )
    for prompt in PROMPTS:
        plain = llm.generate(prompt, max_tokens=24, spec_type="none")
        r = llm.generate(prompt, max_tokens=24)
        # drafted only: a random drafter is all but never right over 96 tokens (accepted blocks:
        # test_same_steps_as_zlab_dflash_generate, vocabulary 8)
        assert r.token_ids == plain.token_ids and r.stats.drafted > 0, prompt
    assert max(llm.drafter.block_lens) == (BLOCK if kind == "dspark" else BLOCK - 1)


def test_confidence_head_ends_the_block(tiny_dir, tmp_path):
    """The block ends before the first draft whose confidence is below the threshold (drafts after it that the
    head is confident in are dropped too); threshold 0 keeps the whole block."""
    from specdec.sampling import SamplingParams

    target = tiny_dir("qwen3", seed=2, layers=4)
    llm = llm_for(
        target, "dspark", drafter_dir(tmp_path, target, True), context=64, draft_max=BLOCK, dspark_threshold=0.5
    )
    drafter, H = llm.drafter, 64
    with torch.no_grad():  # confidence = sigmoid(h[0]): slot 2 unlikely
        drafter.net.confidence_head.proj.weight.zero_()
        drafter.net.confidence_head.proj.weight[0, 0] = 1.0
        drafter.net.confidence_head.proj.bias.zero_()
    h = torch.zeros(BLOCK, H)
    h[:, 0] = torch.tensor([5.0, 5.0, -5.0, 5.0])
    logits = torch.randn(BLOCK, drafter.vocab)
    seq = llm.engine.new_sequence([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8), slot=0, drafter=drafter)
    assert len(drafter._draft(seq, logits, h, BLOCK, 0.0, 0.0).tokens) == 2
    drafter.threshold = 0.0
    assert len(drafter._draft(seq, logits, h, BLOCK, 0.0, 0.0).tokens) == BLOCK
    assert drafter.block_lens == {2: 1, BLOCK: 1}


class Checked(DFlashDrafter):
    """Also recomputes every block from scratch: all committed tokens' features injected into a fresh cache."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: list[torch.Tensor] = []
        self.checked = 0

    def observe_features(self, seq, feats):
        super().observe_features(seq, feats)
        self.log.append(feats.layers)

    def _step(self, seq, tokens, g, start, depth):
        logits, h = super()._step(seq, tokens, g, start, depth)
        feats = torch.cat(self.log)  # [P, F, H]
        assert len(feats) == len(seq.tokens) - 1
        block = torch.tensor([seq.tokens[-1]] + [MASK] * (BLOCK - 1))
        fresh = our_block(self.net, feats, block, self.embed.weight)[self.net.config.first_slot :]
        torch.testing.assert_close(h, fresh, rtol=1e-5, atol=1e-5)
        self.checked += 1
        return logits, h


def test_draft_cache_follows_the_accepted_tokens(tiny_dir, tmp_path):
    """At every propose the incremental draft cache gives the block a fresh injection of all committed features
    gives (accepted, rejected and bonus tokens alike)."""
    target = tiny_dir("qwen3", seed=2, layers=4)
    llm = llm_for(target, "dflash", drafter_dir(tmp_path, target, False), context=128, draft_max=BLOCK)
    drafter = llm.drafter = Checked(llm.drafter.net, llm.engine.target)
    plain = llm.generate(PROMPTS[0], max_tokens=20, spec_type="none")
    r = llm.generate(PROMPTS[0], max_tokens=20)
    # drafted only: the random drafter's blocks are rejected (accepted ones: test_same_steps_as_zlab_dflash_generate)
    assert r.token_ids == plain.token_ids and drafter.checked > 3 and r.stats.drafted > 0


def test_sampling_through_the_engine_matches_plain(tmp_path):
    """Rejection sampling with a DSpark drafter (Markov-conditioned q per position) samples the target's
    distribution: RUNS runs through the engine against the exact joint of plain sampling."""
    target = make_tiny(tmp_path / "t", "qwen3", seed=3, layers=3, vocab=8)
    head = drafter_dir(tmp_path, target, True, scale=1.0, block=3)
    drafted, p_value, tv, bound = engine_fit(target, RUNS, spec_type="dspark", dspark_head=str(head))
    assert drafted > RUNS and p_value > 1e-3 and tv < bound, (drafted, p_value, tv)


def test_planner_and_discovery(tiny_dir, tmp_path, monkeypatch):
    """`auto` finds the drafter trained for the target (manifest kind), and the planner counts its weights and KV."""
    from specdec.drafters.dflash import shape

    target = tiny_dir("qwen3", seed=2, layers=4)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    head = drafter_dir(tmp_path / "heads", target, True)
    r = llm_for(target, "dspark", "auto", context=64, draft_max=BLOCK).generate(PROMPTS[0], max_tokens=8)
    assert r.stats.drafted > 0
    s = shape(head)
    assert (s.kv_layers, s.kv_heads, s.head_dim) == (2, 2, 24) and s.params == sum(
        p.numel() for p in load_block_drafter(head).parameters()
    )


@pytest.mark.real
def test_smollm_block_drafter_is_lossless(smollm_dir, tmp_path):
    head = drafter_dir(tmp_path, smollm_dir, True, scale=0.02, layers=1, rank=16)
    llm = llm_for(smollm_dir, "dspark", head, context=256, draft_max=BLOCK)
    prompt = "def fib(n):\n    if n < 2:\n        return n\n"
    plain = llm.generate(prompt, max_tokens=24, spec_type="none")
    r = llm.generate(prompt, max_tokens=24)
    assert r.token_ids == plain.token_ids and r.stats.drafted > 0  # a random drafter: none accepted


class Recording(DFlashDrafter):
    """Records each block drafted and the tokens produced per verify (accepted drafts + the target's own)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.drafts: list[list[int]] = []
        self.produced: list[int] = []

    def _draft(self, *a, **kw):
        draft = super()._draft(*a, **kw)
        self.drafts.append(draft.tokens)
        return draft

    def update(self, seq, drafted, accepted):
        self.produced.append(accepted + 1)


@needs_dflash
def test_same_steps_as_zlab_dflash_generate(tmp_path, monkeypatch):
    """z-lab's own decoding loop (`dflash_generate`, greedy, a `transformers` target) with our checkpoint drafts the
    same blocks and accepts as many of them at every step as our engine: target features, the anchor, positions and
    the cache of injected context line up with the reference's."""
    import time

    import dflash.model as zlab
    from transformers import AutoModelForCausalLM

    target = make_tiny(tmp_path / "t", "qwen3", seed=4, layers=6, vocab=8)
    head = drafter_dir(tmp_path, target, False, scale=1.0)
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its stats time with CUDA events otherwise
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    model, theirs = zlab.DFlashDraftModel.from_pretrained(str(head)).eval(), []
    logits_of = model.compute_logits
    monkeypatch.setattr(
        model, "compute_logits", lambda *a: theirs.append(logits_of(*a)[0].argmax(-1).tolist()) or logits_of(*a)
    )
    ref = zlab.dflash_generate(
        model, hf, torch.tensor([prompt]), max_new_tokens=48, stop_token_ids=None, return_stats=True
    )
    llm = llm_for(target, "dflash", head, context=128, draft_max=BLOCK - 1)
    drafter = llm.drafter = Recording(llm.drafter.net, llm.engine.target)
    r = llm.generate(prompt, max_tokens=48)
    assert r.token_ids == ref.output_ids[0, len(prompt) :].tolist()
    steps = 30  # the last steps are cut short by the token limit differently
    assert len(ref.acceptance_lengths) > steps
    assert drafter.produced[:steps] == ref.acceptance_lengths[:steps] and max(drafter.produced) > 1
    assert drafter.drafts[:steps] == theirs[:steps]


# --- training (specdec/train/dflash.py) ---


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_training_lowers_the_loss_resumes_and_drafts_losslessly(chat_dir, rules, tmp_path, kind):
    """Both objectives on a 12-conversation cache of a tiny chat target: the loss falls, a run resumes, the drafter
    saves in its layout (z-lab / speculators) and decodes as plain greedy."""
    from test_train_data import _build

    from specdec.train.dflash import DFlashTrainer, DSparkTrainer, TrainConfig

    cache = _build(chat_dir, rules, tmp_path / "cache", n=12, max_new_tokens=24)
    cfg = TrainConfig(
        epochs=3,
        lr=1e-2,
        max_len=32,
        batch_tokens=64,
        autocast="fp32",
        val_share=0.25,
        anchors=8,
        block_size=4,
        markov_rank=8,
        progress=False,
    )
    out, trainer_type = tmp_path / kind, DSparkTrainer if kind == "dspark" else DFlashTrainer
    trainer = trainer_type(str(chat_dir), cache, out, cfg, command="test")

    def train_loss() -> float:
        with torch.no_grad():
            return sum(trainer.loss(b).value.item() for b in trainer.plan[0]) / len(trainer.plan[0])

    before = train_loss()
    trainer.loss(trainer.plan[0][0]).value.backward()  # through the context K/V: fc and q/k/v learn
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.head.parameters())
    trainer.opt.zero_grad(set_to_none=True)
    m = trainer.run()
    assert train_loss() < 0.8 * before
    assert m["kind"] == kind and m["finished"] and 1 <= m["validation"]["tau"] <= 1 + trainer.head.config.drafts
    net = load_block_drafter(out)
    assert net.config.kind == kind and net.config.block_size == 4
    more = trainer_type(str(chat_dir), cache, out, dataclasses.replace(cfg, epochs=4), resume=True)
    assert more.run()["training"]["steps"] == m["training"]["steps"] + len(more.plan[3])
    llm = llm_for(chat_dir, kind, out, context=96, draft_max=4)
    r = llm.generate(PROMPTS[0], max_tokens=16)
    # drafted only: 3 epochs on 12 conversations get no draft of this prompt accepted
    assert r.token_ids == llm.generate(PROMPTS[0], max_tokens=16, spec_type="none").token_ids and r.stats.drafted
