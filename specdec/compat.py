"""Other engines' words for speculative decoding, turned into specdec's (`Config` keywords); docs/compat.md is the
table. Every function returns keywords such as {"spec_type": "ngram-simple", "draft_max": 10, "ngram_n": 2}, and
fails with a SpecdecError naming what is supported when a value has no counterpart here.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Mapping

from specdec.drafters import REGISTRY, parse_spec_type
from specdec.errors import SpecdecError

Settings = dict[str, Any]  # Config keywords (fields and drafter options)

# transformers `generate(...)` assisted-generation arguments
HF_WORDS = (
    "assistant_model",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
    "assistant_early_exit",
    "use_mtp",
)
HF_SCHEDULES = {"constant": False, "heuristic": True, "heuristic_transient": True}  # -> adaptive draft length
# vLLM `--speculative-config` methods -> our spec type, and the drafter option its "model" names (None: -md)
VLLM_METHODS = {
    "ngram": ("ngram-simple", None),
    "draft_model": ("draft", None),
    "suffix": ("suffix", None),
    "eagle3": ("eagle3", "eagle3_head"),
    "mtp": ("mtp", "mtp_head"),
    "dflash": ("dflash", "dflash_head"),
    "medusa": ("medusa", "medusa_head"),
}
VLLM_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
# Ollama Modelfile PARAMETERs -> Config keywords
OLLAMA_PARAMETERS = {"num_ctx": "context", "num_gpu": "n_gpu_layers", "draft_model": "draft", "num_draft": "draft_max"}
# keywords of transformers, llama-cpp-python, vLLM and Ollama that are ours under another name (`LLM(...)`, `generate`)
OUR_NAMES = {
    "max_new_tokens": "max_tokens",
    "max_length": "max_tokens",
    "n_predict": "max_tokens",
    "num_predict": "max_tokens",
    "n_ctx": "context",
    "num_ctx": "context",
    "max_model_len": "context",
    "ctx_size": "context",
    "n_threads": "threads",
    "num_thread": "threads",
    "temp": "temperature",
}


def refuse_other_names(kw: Mapping[str, Any], where: str) -> None:
    """A keyword another library spells differently (`OUR_NAMES`) fails with the one meant, before any other check."""
    for name in kw:
        if name in OUR_NAMES:
            raise SpecdecError(f"{where} takes no {name!r}: use {OUR_NAMES[name]}=")


def _one_spec(out: Settings, spec: str, why: str) -> None:
    """Set the spec type once; two words asking for two drafters fail."""
    if out.setdefault("spec_type", spec) != spec:
        raise SpecdecError(
            f"{why} asks for spec type {spec!r}, but another argument already chose {out['spec_type']!r}"
        )


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecdecError(f"{name} must be a positive integer (got {value!r})")
    return value


def from_transformers(kw: Mapping[str, Any]) -> Settings:
    """transformers' assisted-generation arguments (`HF_WORDS`; None = not given) -> Config keywords."""
    unknown = sorted(set(kw) - set(HF_WORDS))
    if unknown:
        raise SpecdecError(f"unknown transformers argument {unknown[0]!r} (supported: {', '.join(HF_WORDS)})")
    kw = {k: v for k, v in kw.items() if v is not None}
    out: Settings = {}
    if "assistant_model" in kw:
        if not isinstance(kw["assistant_model"], (str, Path)):
            raise SpecdecError("assistant_model must be a model pack name, GGUF file or checkpoint directory")
        out["draft"] = str(kw["assistant_model"])
        _one_spec(out, "draft", "assistant_model")
    if "prompt_lookup_num_tokens" in kw:
        n = _positive("prompt_lookup_num_tokens", kw["prompt_lookup_num_tokens"])
        _one_spec(out, "ngram-simple", "prompt_lookup_num_tokens")
        out.update(draft_max=n, ngram_m=n, ngram_n=2, ngram_min=1)  # transformers: match 2 tokens, then 1
    if "max_matching_ngram_size" in kw:
        if out.get("spec_type") != "ngram-simple":
            raise SpecdecError("max_matching_ngram_size needs prompt_lookup_num_tokens")
        out["ngram_n"] = _positive("max_matching_ngram_size", kw["max_matching_ngram_size"])
    if "num_assistant_tokens" in kw:
        out["draft_max"] = _positive("num_assistant_tokens", kw["num_assistant_tokens"])
    if "num_assistant_tokens_schedule" in kw:
        schedule = kw["num_assistant_tokens_schedule"]
        if schedule not in HF_SCHEDULES:
            raise SpecdecError(
                f"unknown num_assistant_tokens_schedule {schedule!r} (supported: {', '.join(HF_SCHEDULES)})"
            )
        out["adaptive"] = HF_SCHEDULES[schedule]
    if "assistant_confidence_threshold" in kw:
        t = kw["assistant_confidence_threshold"]
        if not isinstance(t, (int, float)) or not 0 <= t <= 1:
            raise SpecdecError(f"assistant_confidence_threshold must be in [0, 1] (got {t!r})")
        out["draft_p_min"] = float(t)
    if "assistant_early_exit" in kw:
        _one_spec(out, "early-exit", "assistant_early_exit")
        out["spec_exit_layer"] = _positive("assistant_early_exit", kw["assistant_early_exit"])
    if kw.get("use_mtp"):
        _one_spec(out, "mtp", "use_mtp")
    return out


REQUEST_SETTINGS = ("spec_type", "draft_max")  # what one server request or `LLM.generate` call may change


def for_request(kw: Mapping[str, Any], server: Mapping[str, Any]) -> Settings:
    """transformers' words in one server request or `LLM.generate` call -> the settings a request may change
    (`REQUEST_SETTINGS`); the other settings they imply must be the running ones (`server`: `Config.settings()`),
    else a SpecdecError naming what a request can change."""
    out = from_transformers(kw)
    for key, value in out.items():
        have = server.get(key)
        if key in REQUEST_SETTINGS or _same_setting(key, value, have, server):
            continue
        raise SpecdecError(
            f"{', '.join(k for k in kw if kw[k] is not None)} needs {key}={value!r}, but this server "
            f"or LLM runs {key}={have!r}; per request only the spec type (assistant_model = its draft "
            "model, prompt_lookup_num_tokens, assistant_early_exit, use_mtp) and the draft length "
            "(num_assistant_tokens) can change: start the server (or make the LLM) with the rest"
        )
    return {k: out[k] for k in REQUEST_SETTINGS if k in out}


def _same_setting(key: str, value: Any, have: Any, server: Mapping[str, Any]) -> bool:
    """Whether the server's setting already is `value`: a draft model named by its path, file name or stem; an
    ngram_m at least the draft length (drafts are cut to draft_max anyway)."""
    if key == "draft" and have is not None:
        return value in (have, Path(have).name, Path(have).stem)
    if key == "ngram_m" and have is not None:
        return have >= min(value, server.get("draft_max", value))
    return value == have


def from_vllm(config: str | Mapping[str, Any]) -> Settings:
    """vLLM's `--speculative-config` (a JSON object or its text) -> Config keywords."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"--speculative-config is not valid JSON: {e.msg}") from None
    if not isinstance(config, Mapping):
        raise SpecdecError("--speculative-config must be a JSON object")
    unknown = sorted(set(config) - set(VLLM_KEYS))
    if unknown:
        raise SpecdecError(f"unsupported --speculative-config key {unknown[0]!r} (supported: {', '.join(VLLM_KEYS)})")
    method = config.get("method") or ("draft_model" if config.get("model") else None)
    if method not in VLLM_METHODS and not _is_spec_type(method):
        raise SpecdecError(
            f"unsupported speculative method {method!r} (supported: {', '.join(VLLM_METHODS)}, "
            "or any specdec spec type or chain)"
        )
    spec, head = VLLM_METHODS.get(method, (method, None))
    out: Settings = {"spec_type": spec}
    if config.get("model") is not None:
        if head is None and not any(p != "none" and REGISTRY.get(p).draft_model for p in parse_spec_type(spec)):
            raise SpecdecError(f"speculative method {method!r} takes no model")
        out[head or "draft"] = str(config["model"])
    if config.get("num_speculative_tokens") is not None:
        out["draft_max"] = _positive("num_speculative_tokens", config["num_speculative_tokens"])
    lookup = {k: config[k] for k in ("prompt_lookup_min", "prompt_lookup_max") if config.get(k) is not None}
    if lookup and method != "ngram":
        raise SpecdecError("prompt_lookup_min/prompt_lookup_max apply to method 'ngram' only")
    if lookup:
        high = _positive("prompt_lookup_max", lookup.get("prompt_lookup_max", lookup.get("prompt_lookup_min")))
        low = _positive("prompt_lookup_min", lookup.get("prompt_lookup_min", high))
        if low > high:
            raise SpecdecError("prompt_lookup_min must not exceed prompt_lookup_max")
        out.update(ngram_n=high, ngram_min=low)
    return out


def _is_spec_type(name: Any) -> bool:
    try:
        return isinstance(name, str) and bool(parse_spec_type(name))
    except SpecdecError:
        return False


def from_vllm_flags(
    speculative_model: str | None = None,
    num_speculative_tokens: int | None = None,
    ngram_prompt_lookup_max: int | None = None,
    ngram_prompt_lookup_min: int | None = None,
) -> Settings:
    """vLLM's older flags: `--speculative-model` (a path, or "[ngram]"), `--num-speculative-tokens`,
    `--ngram-prompt-lookup-max/-min`."""
    config: dict[str, Any] = {
        "num_speculative_tokens": num_speculative_tokens,
        "prompt_lookup_max": ngram_prompt_lookup_max,
        "prompt_lookup_min": ngram_prompt_lookup_min,
    }
    if speculative_model == "[ngram]" or (
        speculative_model is None and (ngram_prompt_lookup_max or ngram_prompt_lookup_min)
    ):
        config["method"] = "ngram"
    elif speculative_model is not None:
        config.update(method="draft_model", model=speculative_model)
    elif num_speculative_tokens is None:
        return {}
    else:
        raise SpecdecError("--num-speculative-tokens needs --speculative-model")
    return from_vllm({k: v for k, v in config.items() if v is not None})


def from_tgi(speculate: int) -> Settings:
    """TGI's `--speculate N`: N tokens a step from the model's own heads when it ships them, else n-grams; specdec
    drafts with prompt lookup (its trained heads are chosen with --spec-type)."""
    return {"spec_type": "ngram-simple", "draft_max": _positive("--speculate", speculate)}


def read_modelfile(path: str | Path) -> Settings:
    """An Ollama Modelfile: `FROM` (the model) and the PARAMETERs of `OLLAMA_PARAMETERS`; other instructions and
    parameters (sampling defaults, templates) fail, naming what is supported."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SpecdecError(f"cannot read Modelfile {path}: {e.strerror}") from None
    out: Settings = {}
    for number, line in enumerate(lines, start=1):
        words = shlex.split(line, comments=True)
        if not words:
            continue
        where = f"Modelfile {path}, line {number}"
        instruction = words[0].upper()
        if instruction == "FROM" and len(words) == 2:
            out["model"] = words[1]
        elif instruction == "PARAMETER" and len(words) == 3 and words[1] in OLLAMA_PARAMETERS:
            key, value = OLLAMA_PARAMETERS[words[1]], words[2]
            out[key] = value if key == "draft" else _int(value, where)
        elif instruction == "PARAMETER":
            raise SpecdecError(
                f"{where}: unsupported PARAMETER {' '.join(words[1:2])!r} (supported: {', '.join(OLLAMA_PARAMETERS)})"
            )
        else:
            raise SpecdecError(f"{where}: unsupported instruction {words[0]!r} (supported: FROM, PARAMETER)")
    if "model" not in out:
        raise SpecdecError(f"Modelfile {path} has no FROM line")
    if "draft" in out:
        out.setdefault("spec_type", "draft")
    return out


def _int(text: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SpecdecError(f"{where}: expected an integer, got {text!r}") from None


def merge(given: Settings, words: Settings, source: str) -> Settings:
    """`given` with `words` laid over it; a spec type, model or draft that `given` already names otherwise fails."""
    for key in ("spec_type", "model", "draft"):
        if given.get(key) is not None and key in words and words[key] != given[key]:
            raise SpecdecError(f"{source} sets {key} {words[key]!r}, but {given[key]!r} was given too")
    return {**given, **words}


def from_flags(given: Settings) -> Settings:
    """Parsed CLI flags (None = not given) with the other engines' flags among them (--modelfile,
    --speculative-config, --speculative-model, --num-speculative-tokens, --ngram-prompt-lookup-max/-min,
    --speculate) turned into specdec's."""
    out = dict(given)
    if given.get("modelfile") is not None:
        out = merge(out, read_modelfile(given["modelfile"]), "--modelfile")
    if given.get("speculative_config") is not None:
        out = merge(out, from_vllm(given["speculative_config"]), "--speculative-config")
    out = merge(
        out,
        from_vllm_flags(
            given.get("speculative_model"),
            given.get("num_speculative_tokens"),
            given.get("ngram_prompt_lookup_max"),
            given.get("ngram_prompt_lookup_min"),
        ),
        "--speculative-model",
    )
    if given.get("speculate") is not None:
        out = merge(out, from_tgi(given["speculate"]), "--speculate")
    return out


def add_flags(p: Any) -> None:
    """The other engines' flags on an argparse parser (`specdec generate|serve|bench`)."""
    g = p.add_argument_group("other engines' flags (docs/compat.md)")
    g.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='vLLM: {"method": ngram|draft_model|suffix|eagle3|'
        'mtp|dflash|medusa, "model", "num_speculative_tokens", "prompt_lookup_min", '
        '"prompt_lookup_max"}',
    )
    g.add_argument("--speculative-model", metavar="MODEL", help="vLLM (older): a draft model, or [ngram]")
    g.add_argument("--num-speculative-tokens", type=int, metavar="N", help="vLLM (older): tokens per draft")
    g.add_argument("--ngram-prompt-lookup-max", type=int, metavar="N", help="vLLM (older): longest n-gram match")
    g.add_argument("--ngram-prompt-lookup-min", type=int, metavar="N", help="vLLM (older): shortest n-gram match")
    g.add_argument("--speculate", type=int, metavar="N", help="TGI: N tokens per step (prompt lookup here)")
    g.add_argument(
        "--modelfile", metavar="FILE", help="Ollama Modelfile: FROM, PARAMETER num_ctx, num_gpu, draft_model, num_draft"
    )
