"""Training data for drafter heads (EAGLE-3, Medusa, MTP): prompts, the target's responses, its features.

`build_cache(target, out, n_prompts)` takes prompts from a source (`sources.py`: ShareGPT, deny-list and
Spec-Bench applied), has the target answer them (greedy; optionally a share sampled at `temperature` with a
seed) several at once through the engine's `Scheduler`, or takes the data's own replies (`responses="data"`),
then runs ONE teacher-forcing prefill over prompt + response that captures the target's hidden states, and
writes them in shards under `out`:

    shard-NNNNN.safetensors
      tokens    int32    [N]        the shard's conversations concatenated (chat template applied)
      offsets   int64    [C + 1]    conversation c is rows offsets[c]:offsets[c + 1]
      loss_mask uint8    [N]        1 on the response tokens (the prediction targets, the end-of-turn token
                                    of a response that stopped included), 0 on prompt and template tokens
      aux       bfloat16 [N, L, H]  hidden states ENTERING decoder layers `aux_layers` (HF hidden_states[i])
      final     bfloat16 [N, H]     input of the final norm (pre-norm: model.norm(final) = HF hidden_states[N])
      index     int64    [C]        prompt index: position in the seeded shuffle of the eligible prompts
      sampled   uint8    [C]        1: the response was sampled at `temperature`; 0: greedy (or the data's)
      metadata  format, aux_layers (JSON list), ids (JSON list: the source's conversation ids)
    progress.json   the settings and the prompt indices done: a rerun with the same settings continues
    manifest.json   target, features, sources and counts, rules applied, generation, throughput, shards

`FeatureCache(out)` reads a finished cache back.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.api import LLM
from specdec.engine.scheduler import Request, Scheduler
from specdec.errors import SpecdecError
from specdec.models.packs import PACKS
from specdec.runtime.runner import FeatureSpec, ModelRunner
from specdec.sampling import SEED_LIMIT, SamplingParams
from specdec.train.sources import (
    FORBIDDEN_PACKAGES,
    SHAREGPT,
    Prompt,
    Selection,
    WheelSource,
    load_prompts,
    stable_fraction,
)

FORMAT = "specdec-features/1"
RESPONSES = ("target", "data")
BATCH_CANDIDATES = (1, 4, 8, 16, 32)  # batch sizes `batch="auto"` measures
CALIBRATION_PROMPT, CALIBRATION_TOKENS = 16, 32  # prompt cut and new tokens when measuring a batch size
SHARD_TOKENS = 16384  # a shard is written once it holds this many tokens


@dataclass(frozen=True)
class Settings:
    """What decides a cache's content: a rerun continues an unfinished cache only with equal settings."""

    target: str
    source: dict
    responses: str
    max_new_tokens: int
    max_prompt_tokens: int
    turns: int
    sample_share: float
    temperature: float
    seed: int
    aux_layers: list[int]
    deny_list_sha256: str
    spec_bench_sha256: str


@dataclass
class Item:
    """A prompt chosen for the cache."""

    index: int  # position in the shuffled eligible prompts
    prompt: Prompt
    ids: list[int]  # the prompt in the chat template, ready for the assistant's turn
    sampled: bool  # answered by sampling (else greedy)


@dataclass
class Conversation:
    """A finished conversation with its features, waiting for its shard."""

    item: Item
    tokens: list[int]  # prompt + response [T]
    aux: torch.Tensor  # [T, L, H] bfloat16
    final: torch.Tensor  # [T, H] bfloat16

    @property
    def response_tokens(self) -> int:
        return len(self.tokens) - len(self.item.ids)


def build_cache(
    target: str,
    out: Path | str,
    n_prompts: int,
    *,
    source: WheelSource = SHAREGPT,
    responses: str = "target",
    max_new_tokens: int = 128,
    max_prompt_tokens: int = 512,
    turns: int = 1,
    sample_share: float = 0.0,
    temperature: float = 0.7,
    seed: int = 0,
    batch: int | str = "auto",
    aux_layers: tuple[int, ...] | None = None,
    shard_tokens: int = SHARD_TOKENS,
    deny_list: Path | None = None,
    spec_bench_dir: Path | None = None,
    dtype: str = "auto",
    quant: str = "auto",
    threads: int | None = None,
    progress: bool = True,
    command: str | None = None,
) -> Path:
    """Build (or continue) a feature cache of `n_prompts` conversations in `out`; returns `out`.

    target: pack name, GGUF file or checkpoint dir. responses: "target" (regenerated, up to `max_new_tokens`)
    or "data" (the source's reply, cut to `max_new_tokens`). Prompts: the first `turns` user turns (earlier
    replies from the data), at most `max_prompt_tokens` in the chat template. `sample_share` of the prompts
    are answered at `temperature` (seeded), the rest greedily. batch: sequences generated at once, or "auto"
    (the fastest of BATCH_CANDIDATES on a few prompts). aux_layers: default EAGLE-3's (2, N // 2, N - 3).
    deny_list / spec_bench_dir: default ../shared/training and ../shared/workloads/spec_bench; without them
    nothing is built. Growing `n_prompts` on a finished cache adds conversations; other settings must match.
    """
    _check_args(responses, n_prompts, max_new_tokens, max_prompt_tokens, turns, sample_share, batch)
    out = Path(out)
    selection = load_prompts(source, seed, turns, responses == "data", deny_list, spec_bench_dir, progress)
    batches = (batch,) if isinstance(batch, int) else BATCH_CANDIDATES
    llm = LLM(
        target,
        spec_type="none",
        parallel=1 if responses == "data" else max(batches) + 1,
        context=max_prompt_tokens + max_new_tokens + 1,
        dtype=dtype,
        quant=quant,
        threads=threads,
        progress=progress,
    )
    if llm.context < max_prompt_tokens + max_new_tokens + 1:
        raise SpecdecError(
            f"{target} holds {llm.context} positions; max_prompt_tokens + max_new_tokens must be below that"
        )
    spec = FeatureSpec(tuple(aux_layers)) if aux_layers else FeatureSpec.eagle3(llm.runner.model.config.num_layers)
    settings = Settings(
        target,
        source.describe(),
        responses,
        max_new_tokens,
        max_prompt_tokens,
        turns,
        sample_share,
        temperature,
        seed,
        list(spec.layers),
        selection.deny_sha256,
        selection.spec_bench_sha256,
    )
    out.mkdir(parents=True, exist_ok=True)
    state = Progress(out, settings)
    items, too_long = choose(llm, selection.prompts, n_prompts, max_prompt_tokens, seed, sample_share)
    todo = [it for it in items if it.index not in state.done]
    writer = ShardWriter(out, state, spec.layers, shard_tokens)
    with _bar(len(items), len(items) - len(todo), progress) as bar:
        respond(llm, todo, settings, batches, _recorder(llm, spec, writer, state, bar), state)
        writer.flush()
    manifest = make_manifest(llm, settings, selection, too_long, state, command)
    _write_atomic(out / "manifest.json", json.dumps(manifest, indent=1))
    return out


def respond(
    llm: LLM,
    todo: list[Item],
    settings: Settings,
    batches: tuple[int, ...],
    record: Callable[[Item, list[int]], None],
    state: Progress,
) -> None:
    """Record every item with its response: the data's, or the target's generated `batches[0]` at a time
    (the fastest of `batches` when there are several)."""
    if settings.responses == "data":
        end = end_of_turn(llm)
        for it in todo:
            record(it, data_response(llm, it, settings.max_new_tokens, end))
    elif todo:
        size = batches[0] if len(batches) == 1 else pick_batch(llm, todo, batches, state)
        generate(llm, todo, size, settings, record, state)


def _check_args(
    responses: str,
    n_prompts: int,
    max_new_tokens: int,
    max_prompt_tokens: int,
    turns: int,
    sample_share: float,
    batch: int | str,
) -> None:
    if responses not in RESPONSES:
        raise SpecdecError(f"responses must be one of {', '.join(RESPONSES)} (got {responses!r})")
    if min(n_prompts, max_new_tokens, max_prompt_tokens, turns) < 1:
        raise SpecdecError("n_prompts, max_new_tokens, max_prompt_tokens and turns must be >= 1")
    if not 0 <= sample_share <= 1:
        raise SpecdecError("sample_share must be in [0, 1]")
    if sample_share and responses == "data":
        raise SpecdecError("sample_share applies to responses='target' only")
    if batch != "auto" and not (isinstance(batch, int) and batch >= 1):
        raise SpecdecError(f"batch must be >= 1 or 'auto' (got {batch!r})")


def choose(
    llm: LLM, prompts: list[Prompt], n: int, max_prompt_tokens: int, seed: int, sample_share: float
) -> tuple[list[Item], int]:
    """The first `n` prompts that fit `max_prompt_tokens` in the chat template, and how many did not fit."""
    items, too_long = [], 0
    for index, prompt in enumerate(prompts):
        ids = llm.encode_chat(list(prompt.messages))
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        items.append(Item(index, prompt, ids, stable_fraction("sample", seed, index) < sample_share))
        if len(items) == n:
            break
    return items, too_long


def end_of_turn(llm: LLM) -> int:
    """The stop token the chat template closes an assistant turn with: appended to responses that stopped."""
    marker = "REPLY"
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}], add_generation_prompt=False
    )
    tail = llm.tokenizer.encode(text[text.rindex(marker) + len(marker) :], add_special_tokens=False)
    found = next((t for t in tail if t in llm.engine.stop_ids), None)
    if found is None:
        raise SpecdecError("the chat template ends an assistant turn with no stop token")
    return found


def data_response(llm: LLM, item: Item, max_new_tokens: int, end: int) -> list[int]:
    """The source's reply in tokens: cut to `max_new_tokens`, or whole and closed with `end`."""
    ids = llm.tokenizer.encode(item.prompt.reference or "", add_special_tokens=False)
    return ids[:max_new_tokens] if len(ids) >= max_new_tokens else ids + [end]


def params_for(item: Item, settings: Settings) -> SamplingParams:
    """Greedy, or seeded sampling (a function of the seed and the prompt index) for a sampled item."""
    if not item.sampled:
        return SamplingParams(max_tokens=settings.max_new_tokens)
    seed = (settings.seed * 1_000_003 + item.index) % SEED_LIMIT
    return SamplingParams(temperature=settings.temperature, seed=seed, max_tokens=settings.max_new_tokens)


def run_requests(
    llm: LLM,
    items: list[Item],
    batch: int,
    params: Callable[[Item], SamplingParams],
    on_done: Callable[[Item, list[int]], None],
    on_time: Callable[[float], None],
) -> None:
    """Generate for every item, `batch` at a time (continuous batching); on_done(item, response) as each
    finishes, the end-of-turn token appended when it stopped; on_time(seconds) after each engine iteration."""
    sched = Scheduler(llm.engine, batch, max_queue=batch)  # slots 0..batch-1; the last slot is teacher forcing's
    end = end_of_turn(llm)
    pending, owner, finished = deque(items), {}, []
    while pending or owner:
        while pending and len(sched.waiting) < batch:
            item = pending.popleft()
            req = Request(item.ids, params(item), on_done=finished.append)
            owner[id(req)] = item
            sched.submit(req)
        t = time.perf_counter()
        sched.run_once()
        on_time(time.perf_counter() - t)
        for req in finished:
            item = owner.pop(id(req))
            if req.error:
                raise SpecdecError(f"prompt {item.index} ({item.prompt.id}): {req.error}")
            on_done(item, req.seq.output_ids + ([end] if req.seq.finish_reason == "stop" else []))
        finished.clear()


def pick_batch(llm: LLM, items: list[Item], candidates: tuple[int, ...], state: Progress) -> int:
    """The batch size with the most generated tokens per second, each size b tried on the first b prompts cut to
    CALIBRATION_PROMPT tokens (prefill costs the same per token at any batch size), CALIBRATION_TOKENS new tokens
    each, greedy; the rates go to `state.batch_tok_s`."""
    params = SamplingParams(max_tokens=CALIBRATION_TOKENS)
    for b in [c for c in candidates if c <= len(items)] or [1]:
        made, spent = [], []
        short = [Item(it.index, it.prompt, it.ids[:CALIBRATION_PROMPT], False) for it in items[:b]]
        run_requests(llm, short, b, lambda _: params, lambda _, r: made.append(len(r)), spent.append)
        state.batch_tok_s[str(b)] = round(sum(made) / sum(spent), 2)
        state.add("seconds", "calibrate", sum(spent))
    return int(max(state.batch_tok_s, key=state.batch_tok_s.get))


def generate(
    llm: LLM,
    items: list[Item],
    batch: int,
    settings: Settings,
    record: Callable[[Item, list[int]], None],
    state: Progress,
) -> None:
    """The target's responses to `items`, `batch` at a time, each recorded as it finishes."""
    state.batch = batch

    def done(item: Item, response: list[int]) -> None:
        state.add("tokens", "generated", len(response))
        record(item, response)

    run_requests(
        llm, items, batch, lambda it: params_for(it, settings), done, lambda dt: state.add("seconds", "generate", dt)
    )


def teacher_features(
    runner: ModelRunner, spec: FeatureSpec, tokens: list[int], slot: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill over `tokens` in `slot` capturing `spec`: (aux [T, L, H], final [T, H]) in bfloat16."""
    runner.capture = spec
    try:
        runner.prefill(tokens, slot)
        f = runner.features[0]
    finally:
        runner.capture = None
    return f.layers.to(torch.bfloat16).contiguous(), f.final.to(torch.bfloat16).contiguous()


def _recorder(
    llm: LLM, spec: FeatureSpec, writer: ShardWriter, state: Progress, bar
) -> Callable[[Item, list[int]], None]:
    """record(item, response): teacher-force prompt + response in the last KV slot, hand it to the writer."""
    slot = llm.parallel - 1

    def record(item: Item, response: list[int]) -> None:
        tokens = item.ids + response
        t = time.perf_counter()
        aux, final = teacher_features(llm.runner, spec, tokens, slot)
        state.add("seconds", "teacher", time.perf_counter() - t)
        state.add("tokens", "teacher", len(tokens))
        writer.add(Conversation(item, tokens, aux, final))
        bar.update(1)
        bar.set_postfix(tokens=writer.tokens_total, tok_s=f"{state.rate('generated', 'generate'):.1f}")

    return record


class Progress:
    """progress.json: settings, prompt indices done, shards written, time and tokens so far (over every run)."""

    def __init__(self, out: Path, settings: Settings):
        self.path = out / "progress.json"
        self.settings = asdict(settings)
        state = json.loads(self.path.read_text()) if self.path.exists() else {"settings": self.settings}
        if state["settings"] != self.settings:
            changed = sorted(k for k in self.settings if state["settings"].get(k) != self.settings[k])
            raise SpecdecError(
                f"{out} holds a cache built with other settings ({', '.join(changed)}); "
                "use another directory or delete it"
            )
        self.done: set[int] = set(state.get("done", []))
        self.shards: list[dict] = state.get("shards", [])
        self.seconds: dict[str, float] = state.get("seconds", {})
        self.tokens: dict[str, int] = state.get("tokens", {})
        self.batch: int | None = state.get("batch")
        self.batch_tok_s: dict[str, float] = state.get("batch_tok_s", {})
        self._mark = time.perf_counter()
        listed = {s["file"] for s in self.shards}
        for f in out.iterdir():  # what a killed run left half-done
            if ".tmp-" in f.name or (f.name.startswith("shard-") and f.name not in listed):
                f.unlink()

    def add(self, table: str, key: str, amount: float) -> None:
        """Count `amount` more into `seconds[key]` or `tokens[key]`."""
        counter = getattr(self, table)
        counter[key] = counter.get(key, 0) + amount

    def rate(self, tokens: str, seconds: str) -> float:
        return self.tokens.get(tokens, 0) / max(self.seconds.get(seconds, 0.0), 1e-9)

    def save(self) -> None:
        now = time.perf_counter()
        self.seconds["total"] = self.seconds.get("total", 0.0) + now - self._mark
        self._mark = now
        state = {
            "settings": self.settings,
            "done": sorted(self.done),
            "shards": self.shards,
            "seconds": self.seconds,
            "tokens": self.tokens,
            "batch": self.batch,
            "batch_tok_s": self.batch_tok_s,
        }
        _write_atomic(self.path, json.dumps(state))


class ShardWriter:
    """Buffers conversations; writes a shard (temp file + rename) every `shard_tokens` tokens, then progress."""

    def __init__(self, out: Path, state: Progress, aux_layers: tuple[int, ...], shard_tokens: int):
        self.out, self.state, self.aux_layers, self.shard_tokens = out, state, aux_layers, shard_tokens
        self.buffer: list[Conversation] = []
        self.tokens_total = sum(s["tokens"] for s in state.shards)

    def add(self, conv: Conversation) -> None:
        self.buffer.append(conv)
        self.tokens_total += len(conv.tokens)
        if sum(len(c.tokens) for c in self.buffer) >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            name = f"shard-{len(self.state.shards):05d}.safetensors"
            tmp = self.out / f"{name}.tmp-{uuid.uuid4().hex}"
            save_file(
                shard_tensors(self.buffer),
                str(tmp),
                metadata={
                    "format": FORMAT,
                    "aux_layers": json.dumps(list(self.aux_layers)),
                    "ids": json.dumps([c.item.prompt.id for c in self.buffer]),
                },
            )
            os.replace(tmp, self.out / name)
            self.state.shards.append(
                {
                    "file": name,
                    "conversations": len(self.buffer),
                    "tokens": sum(len(c.tokens) for c in self.buffer),
                    "response_tokens": sum(c.response_tokens for c in self.buffer),
                    "sampled": sum(c.item.sampled for c in self.buffer),
                }
            )
            self.state.done.update(c.item.index for c in self.buffer)
            self.buffer = []
        self.state.save()


def shard_tensors(convs: list[Conversation]) -> dict[str, torch.Tensor]:
    """The tensors of one shard (see the module docstring)."""
    lens = [len(c.tokens) for c in convs]
    return {
        "tokens": torch.tensor([t for c in convs for t in c.tokens], dtype=torch.int32),  # [N]
        "offsets": torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64),  # [C+1]
        "loss_mask": torch.cat([torch.arange(n) >= len(c.item.ids) for c, n in zip(convs, lens)]).to(torch.uint8),
        "aux": torch.cat([c.aux for c in convs]),  # [N, L, H]
        "final": torch.cat([c.final for c in convs]),  # [N, H]
        "index": torch.tensor([c.item.index for c in convs], dtype=torch.int64),  # [C]
        "sampled": torch.tensor([c.item.sampled for c in convs], dtype=torch.uint8),  # [C]
    }


def make_manifest(
    llm: LLM, settings: Settings, selection: Selection, too_long: int, state: Progress, command: str | None
) -> dict:
    """What the cache holds and how it was made (shared/training/README.md asks for sources, counts, deny-list)."""
    cfg = llm.runner.model.config
    shards = state.shards
    counts = {k: sum(s[k] for s in shards) for k in ("conversations", "tokens", "response_tokens", "sampled")}
    seconds = {k: round(v, 2) for k, v in state.seconds.items()}
    return {
        "format": FORMAT,
        "target": {
            "name": settings.target,
            "gguf_sha256": PACKS[settings.target].sha256 if settings.target in PACKS else None,
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "runtime": llm.quant_info,
        },
        "features": {
            "aux_layers": settings.aux_layers,
            "hidden_size": cfg.hidden_size,
            "dtype": "bfloat16",
            "aux": "hidden state entering each decoder layer (HF hidden_states[i])",
            "final": "input of the final norm (pre-norm)",
        },
        "sources": [
            {
                **settings.source,
                "read": selection.read,
                "truncated_last_record": selection.truncated,
                "excluded": {**selection.excluded, "prompt_too_long": too_long},
                "eligible": len(selection.prompts),
                **counts,
            }
        ],
        "rules": {
            "deny_list_sha256": settings.deny_list_sha256,
            "spec_bench_sha256": settings.spec_bench_sha256,
            "forbidden_packages": list(FORBIDDEN_PACKAGES),
        },
        "generation": {
            "responses": settings.responses,
            "greedy_share": round(1 - settings.sample_share, 4),
            "sample_share": settings.sample_share,
            "temperature": settings.temperature,
            "max_new_tokens": settings.max_new_tokens,
            "max_prompt_tokens": settings.max_prompt_tokens,
            "turns": settings.turns,
            "seed": settings.seed,
            "batch": state.batch,
            "batch_tok_s": state.batch_tok_s,
            "end_of_turn_token": end_of_turn(llm),
        },
        "throughput": {
            "generate_tok_s": round(state.rate("generated", "generate"), 2),
            "teacher_tok_s": round(state.rate("teacher", "teacher"), 2),
            "seconds": seconds,
            "hours": round(state.seconds.get("total", 0.0) / 3600, 3),
            "tokens": state.tokens,
        },
        "counts": counts,
        "command": command if command is not None else " ".join(sys.argv),
        "shards": shards,
    }


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _bar(total: int, initial: int, progress: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="conv",
        desc="features",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=not progress,
    )


@dataclass(frozen=True)
class Row:
    """Where one conversation lies."""

    shard: int
    start: int
    end: int
    index: int
    id: str
    sampled: bool


class FeatureCache:
    """A finished cache read back. `len`, iteration and `cache[i]` give one conversation each:
    {"tokens" long [T], "loss_mask" bool [T], "aux" bfloat16 [T, L, H], "final" bfloat16 [T, H],
    "index" int, "id" str, "sampled" bool}."""

    def __init__(self, directory: Path | str):
        self.dir = Path(directory)
        path = self.dir / "manifest.json"
        if not path.is_file():
            raise SpecdecError(
                f"{self.dir}: no manifest.json (not a finished feature cache; build_cache with the "
                "same settings continues an unfinished one)"
            )
        self.manifest = json.loads(path.read_text())
        self.aux_layers = tuple(self.manifest["features"]["aux_layers"])
        self.files = [self.dir / s["file"] for s in self.manifest["shards"]]
        self.rows = [r for k, f in enumerate(self.files) for r in _shard_rows(f, k)]
        self._handles: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        f = self._handle(row.shard)
        part = {name: f.get_slice(name)[row.start : row.end] for name in ("tokens", "loss_mask", "aux", "final")}
        return {
            "tokens": part["tokens"].long(),
            "loss_mask": part["loss_mask"].bool(),
            "aux": part["aux"],
            "final": part["final"],
            "index": row.index,
            "id": row.id,
            "sampled": row.sampled,
        }

    def split(self, val_share: float = 0.05, seed: int = 0) -> tuple["FeatureCache", "FeatureCache"]:
        """(train, validation) by conversation: a conversation is in validation by a hash of (seed, its prompt
        index), so the split does not depend on shards and stays put as a cache grows."""
        val = [stable_fraction("val", seed, r.index) < val_share for r in self.rows]
        return (
            self._view([r for r, v in zip(self.rows, val) if not v]),
            self._view([r for r, v in zip(self.rows, val) if v]),
        )

    def token_counts(self) -> torch.Tensor:
        """[V] int64: how often each token is a prediction target (loss mask 1) in these conversations."""
        counts = torch.zeros(self.manifest["target"]["vocab_size"], dtype=torch.int64)
        for shard, rows in itertools.groupby(sorted(self.rows, key=lambda r: r.shard), key=lambda r: r.shard):
            f = self._handle(shard)
            tokens, mask = f.get_tensor("tokens").long(), f.get_tensor("loss_mask").bool()  # [N]
            keep = torch.zeros_like(mask)
            for r in rows:
                keep[r.start : r.end] = True
            counts += torch.bincount(tokens[mask & keep], minlength=counts.numel())
        return counts

    def _view(self, rows: list[Row]) -> "FeatureCache":
        view = object.__new__(FeatureCache)
        view.__dict__.update(self.__dict__, rows=rows)
        return view

    def _handle(self, shard: int):
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.files[shard]), framework="pt")
        return self._handles[shard]


def _shard_rows(path: Path, shard: int) -> list[Row]:
    with safe_open(str(path), framework="pt") as f:
        offsets = f.get_tensor("offsets").tolist()
        index, sampled = f.get_tensor("index").tolist(), f.get_tensor("sampled").tolist()
        ids = json.loads(f.metadata()["ids"])
    return [Row(shard, offsets[c], offsets[c + 1], index[c], ids[c], bool(sampled[c])) for c in range(len(index))]
