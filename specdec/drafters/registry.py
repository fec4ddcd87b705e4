"""The drafter registry: one `DrafterType` per spec type, with its options, read by every front end.

The CLI's `--spec-*` flags, `LLM(...)` keywords, the server's `speculative.type`, `specdec bench --methods`
and `bench replay` all take names, options and properties (lossy, needs a draft model) from here. A drafter
file declares its `DrafterType`s; `specdec.drafters` registers them, one line per file:

    register(DrafterType("toy", build=lambda ctx: ToyDrafter(ctx.options["toy_len"]), help="...",
                         options=(Option("toy_len", "--spec-toy-len", 4, "tokens per draft", int, ">= 1"),)))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from specdec.errors import SpecdecError

if TYPE_CHECKING:
    from specdec.drafters.base import Drafter
    from specdec.models.tokenizer import Tokenizer
    from specdec.runtime.runner import ModelRunner
    from specdec.sequence import Draft, Sequence

# rule -> test of a value, for `Option.rule`
RULES: dict[str, Callable[[Any], bool]] = {
    ">= 0": lambda v: v >= 0,
    "auto or >= 0": lambda v: v == "auto" or v >= 0,
    ">= 1": lambda v: v >= 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "> 0 and finite": lambda v: 0 < v < math.inf,
    "in (0, 65536]": lambda v: 0 < v <= 65536,
    "numbers in [0, 1]": lambda v: len(v) > 0 and all(0 <= r <= 1 for r in v),
    "auto or none": lambda v: v in ("auto", "none"),
}


def float_list(text: str) -> tuple[float, ...]:
    """'0.9,0.8' -> (0.9, 0.8)."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise SpecdecError(f"expected comma-separated numbers, got {text!r}") from None


@dataclass(frozen=True)
class Option:
    """One drafter setting: its keyword (`LLM(name=...)`, argparse dest), CLI flag, default and rule."""

    name: str
    flag: str
    default: Any
    help: str
    parse: Callable[[str], Any] = float  # CLI text -> value
    rule: str | None = None  # a key of RULES

    def check(self, value: Any) -> Any:
        """The value, validated (lists become tuples); SpecdecError naming the option otherwise."""
        if isinstance(value, str):
            value = self.parse(value)
        if isinstance(value, list):
            value = tuple(value)
        try:
            ok = self.rule is None or RULES[self.rule](value)
        except TypeError:
            ok = False
        if not ok:
            raise SpecdecError(f"{self.name} must be {self.rule} (got {value!r})")
        return value


@dataclass
class BuildContext:
    """What a drafter may be built from."""

    options: Mapping[str, Any]  # every registered option's value
    target: ModelRunner | None = None  # the target's runner (None in `bench replay`)
    model: str | None = None  # the target's name (a pack) or path
    load_draft: Callable[[], ModelRunner] | None = None  # the -md model in a runner of its own, loaded on call
    # (target, draft) tokenizers when the -md model's vocabulary differs from the target's, else None (after load_draft)
    draft_tokenizers: Callable[[], tuple[Tokenizer, Tokenizer] | None] = lambda: None
    draft: str | None = None  # the -md model's name or path, as given

    def draft_runner(self) -> ModelRunner:
        if self.load_draft is None:
            raise SpecdecError("this spec type needs a draft model (-md)")
        return self.load_draft()


@dataclass(frozen=True)
class MemoryQuery:
    """What `specdec plan` asks a drafter that holds memory of its own (a trained head) about."""

    model: str  # the target's name (a pack) or path: where its head is looked up
    hidden: int  # the target's shape
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context: int  # positions per slot
    slots: int
    dtype_bytes: int  # bytes per element of the runtime's activations (the head loads in that dtype)
    options: Mapping[str, Any] = field(default_factory=dict)  # drafter options (e.g. a head directory)
    draft: str | None = None  # the -md model's name or path (a Gemma 4 assistant for `mtp`)


@dataclass(frozen=True)
class HeadMemory:
    """A drafter's own resident memory: bytes per part ("eagle3 head weights", "eagle3 head KV") and a note on
    where the figures come from."""

    parts: dict[str, int]
    note: str


VerifyHook = Callable[["Sequence", "Draft", Any], "tuple[list[int], list[int]] | None"]


@dataclass(frozen=True)
class DrafterType:
    name: str
    build: Callable[[BuildContext], Drafter]
    help: str
    options: tuple[Option, ...] = ()
    lossy: bool = False  # opt-in only: the output is not the target's
    draft_model: bool = False  # needs a draft model (-md)
    target_features: bool = False  # reads the target's hidden states
    target_layers: bool = False  # drafts with the target's own layers (runs model forwards; not replayable)
    per_scope: bool = True  # learns across requests: one instance per scope (API key); else one for all
    # A lossy type may replace verification: (seq, draft, logits [N+1, V]) -> (new tokens, accepted path), or
    # None to verify as usual. Installed on the engine when a drafter of the type is made.
    verify_hook: VerifyHook | None = None
    # Memory the drafter holds beyond the target (and draft model), for `specdec plan`.
    memory: Callable[[MemoryQuery], HeadMemory] | None = None

    @property
    def model_free(self) -> bool:
        """Lossless and drafting from token ids alone (n-grams, suffixes): no model forward of its own."""
        return not (self.lossy or self.draft_model or self.target_features or self.target_layers)

    @property
    def request_options(self) -> tuple[Option, ...]:
        """Options one request may set: a model-free type's numeric ones. The rest (a draft model's, a head's
        directory) are fixed when the drafters are made."""
        return tuple(o for o in self.options if not isinstance(o.default, str)) if self.model_free else ()


@dataclass
class Registry:
    types: dict[str, DrafterType] = field(default_factory=dict)
    options: dict[str, Option] = field(default_factory=dict)

    def register(self, t: DrafterType) -> DrafterType:
        if t.name in self.types or t.name == "none" or "," in t.name or "+" in t.name:
            raise SpecdecError(f"cannot register spec type {t.name!r}")
        for o in t.options:
            if self.options.get(o.name, o) != o:
                raise SpecdecError(f"option {o.name!r} of {t.name!r} differs from the one registered before")
        self.options.update({o.name: o for o in t.options})
        self.types[t.name] = t
        return t

    def unregister(self, name: str) -> None:
        """Drop a spec type and the options no other type uses (tests that register their own)."""
        t = self.types.pop(name)
        used = {o.name for other in self.types.values() for o in other.options}
        for o in t.options:
            if o.name not in used:
                del self.options[o.name]

    def names(self, lossy: bool | None = None) -> tuple[str, ...]:
        """Registered spec types (lossy None: all; True/False: only those)."""
        return tuple(n for n, t in self.types.items() if lossy is None or t.lossy == lossy)

    def get(self, name: str) -> DrafterType:
        if name not in self.types:
            raise SpecdecError(
                f"unknown spec type {name!r} (choose {', '.join(('none', *self.types))}, "
                "or a comma-separated chain such as ngram-mod,draft)"
            )
        return self.types[name]

    def request_options(self, spec: list[str], given: Mapping[str, Any]) -> dict[str, Any]:
        """`given`, validated, if one request may set those options for the spec types `spec` (a chain's parts:
        `DrafterType.request_options` of each); else SpecdecError."""
        types = [self.get(p) for p in spec if p != "none"]
        if not all(t.model_free for t in types):
            raise SpecdecError(
                "per-request drafter options only for model-free spec types (n-grams, suffix); "
                "start the server with the others"
            )
        own = {o.name: o for t in types for o in t.request_options}
        bad = sorted(set(given) - set(own))
        if bad:
            raise SpecdecError(
                f"{bad[0]!r} is not a per-request option of {','.join(spec)} (choose from {', '.join(own) or 'none'})"
            )
        return {n: own[n].check(v) for n, v in given.items()}

    def option_values(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Every option's value: `given` (validated) over the defaults; unknown names fail."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise SpecdecError(f"unknown drafter option {unknown[0]!r} (known: {', '.join(self.options)})")
        return {n: o.check(given[n]) if n in given else o.default for n, o in self.options.items()}


REGISTRY = Registry()
register = REGISTRY.register
