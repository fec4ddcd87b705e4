"""What a grammar costs a token: llguidance's next-token mask (what specdec uses, specdec/constraint.py) against
outlines-core's allowed-token list (if installed), walking one JSON answer under its schema, per pulled pack.

    python scripts/grammar_cost.py                       # smollm2-135m and qwen2.5-coder-1.5b (pulled if missing)
    pip install outlines-core==0.2.14                    # to time it beside

Prints one line per pack and library: vocabulary, grammar build seconds, median and max ms per token (llguidance: the
mask alone, and a logit row masked as the engine does it, `Constraint.mask`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.constraint import Constraint, Grammar
from specdec.models.packs import pull
from specdec.models.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"]}, separators=(",", ":"))


def _ms(times: list[float]) -> str:
    return f"median {1e3 * statistics.median(times):.3f} ms, max {1e3 * max(times):.3f} ms"


def time_llguidance(tok: Tokenizer, ids: list[int], vocab: int, stop: set[int]) -> str:
    t0 = time.perf_counter()
    c = Constraint(Grammar.json_schema(SCHEMA), tok, vocab, stop)
    build, times, masked = time.perf_counter() - t0, [], []
    logits = torch.zeros(1, vocab)
    for t in ids:
        t0 = time.perf_counter()
        c.allowed()
        times.append(time.perf_counter() - t0)
        c.mask(logits, [[]])
        masked.append(time.perf_counter() - t0 - times[-1])
        c.commit([t])
    return f"llguidance: build {build:.2f} s (tokenizer included), mask {_ms(times)}; a logit row masked {_ms(masked)}"


def _byte_strings(tok: Tokenizer) -> dict[bytes, list[int]]:
    """Each token's bytes for a byte-level BPE vocabulary (GPT-2's byte-to-character table read backwards)."""
    table = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = dict(zip(table, table)), 0
    for b in range(256):
        if b not in chars:
            chars[b], n = 256 + n, n + 1
    back = {chr(c): b for b, c in chars.items()}
    out: dict[bytes, list[int]] = {}
    for s, i in tok.fast.get_vocab().items():
        if all(ch in back for ch in s):
            out.setdefault(bytes(back[ch] for ch in s), []).append(i)
    return out


def time_outlines(tok: Tokenizer, ids: list[int], eos: int) -> str:
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return "outlines-core: not installed"
    t0 = time.perf_counter()
    vocab = {k: [i for i in v if i != eos] for k, v in _byte_strings(tok).items()}
    guide = Guide(
        Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos, {k: v for k, v in vocab.items() if v}))
    )
    build, times = time.perf_counter() - t0, []
    for t in ids:
        t0 = time.perf_counter()
        guide.get_tokens()
        times.append(time.perf_counter() - t0)
        guide.advance(t)
    return f"outlines-core: build {build:.2f} s, {_ms(times)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--packs", default="smollm2-135m,qwen2.5-coder-1.5b")
    args = p.parse_args()
    for name in args.packs.split(","):
        tok = Tokenizer(pull(name))
        eos = tok.token_id(tok.eos_token)
        ids, vocab = tok.encode(ANSWER, add_special_tokens=False), tok.fast.get_vocab_size()
        print(
            f"{name} ({vocab} tokens, {len(ids)}-token answer): {time_llguidance(tok, ids, vocab, {eos})}; "
            f"{time_outlines(tok, ids, eos)}"
        )


if __name__ == "__main__":
    main()
