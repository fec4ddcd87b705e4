"""OpenAI request bodies (the fields we honour; unknown fields are ignored as OpenAI-compatible servers do),
the OpenAI error format, the stats every response carries, and what the other APIs' routes (Ollama's,
llama-server's) share to turn their bodies into OpenAI ones."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Mapping, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from specdec.compat import HF_WORDS
from specdec.runtime import kernels
from specdec.sampling import SEED_LIMIT, SamplingParams

if TYPE_CHECKING:
    from specdec.engine.scheduler import Request

MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings per request, characters per stop string
MAX_BODY = 4 << 20  # default --max-body (bytes)


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {
            400: "invalid_request_error",
            401: "authentication_error",
            403: "permission_error",
            404: "invalid_request_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
        }.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class Speculative(BaseModel):
    """Per-request speculation (extension field `speculative`)."""

    model_config = ConfigDict(extra="forbid")
    type: str | None = None  # a spec type or chain; None: the server's
    draft_max: StrictInt | None = Field(None, ge=1, le=256)
    accept_threshold: float | None = Field(None, ge=0, le=1)  # opt-in lossy relaxed acceptance (--allow-lossy)
    options: dict[str, Any] | None = None  # model-free drafters' options for this request (Registry.request_options)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the answer must be valid under (`name`, `strict`: accepted)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: StrictInt | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: Union[str, list[str], None] = None
    n: StrictInt = Field(1, ge=1, le=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    speculative: Union[StrictBool, Speculative, None] = None
    cache_prompt: StrictBool = True  # llama-server's: reuse (and keep) the prompt's K/V in the prefix cache
    specdec_trace: StrictBool = False  # extension: each output token's origin (`specdec_trace` in the answer)
    response_format: ResponseFormat | None = None  # JSON output: any object, or valid under a schema
    json_schema: Union[dict[str, Any], str, None] = None  # llama-server's: the same as a json_schema response_format
    grammar: str | None = None  # llama-server's: a GBNF grammar the output must match

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        """Request fields over the server's defaults; out-of-range values raise APIError 400."""
        if self.presence_penalty or self.frequency_penalty:
            raise APIError(400, "presence_penalty and frequency_penalty are not supported", "presence_penalty")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise APIError(
                400, f"stop must be up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters", "stop"
            )
        pick = lambda v, d: d if v is None else v  # noqa: E731
        top_k = pick(self.top_k, defaults.top_k)
        return SamplingParams(
            temperature=pick(self.temperature, defaults.temperature),
            top_k=max(0, top_k),
            top_p=pick(self.top_p, defaults.top_p),
            min_p=pick(self.min_p, defaults.min_p),
            seed=self.seed,
            max_tokens=pick(self.token_limit(), defaults.max_tokens),
            stop=stops,
        )

    def token_limit(self) -> int | None:
        """The most tokens to generate (None: the server's default)."""
        return self.max_tokens


class CompletionRequest(_Common):
    prompt: Union[str, list[StrictInt], list[str]]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False

    def logprobs_asked(self) -> tuple[bool, int]:
        """(whether each token's log-probability is asked for, how many best alternatives with it)."""
        return self.logprobs is not None, self.logprobs or 0


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" or p.text is None for p in self.content):
            raise APIError(400, "only text content parts are supported", "messages")
        return "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None  # functions the model may call (OpenAI's `tools`)
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_asked(self) -> tuple[bool, int]:
        return self.logprobs, self.top_logprobs or 0

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template takes it (tool calls and results included)."""
        out = []
        for m in self.messages:
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            extra = {"tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id}
            out.append(msg | {k: v for k, v in extra.items() if v is not None})
        return out

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt offers: none where `tool_choice` is "none"."""
        return None if self.tool_choice == "none" else self.tools or None


def response_stats(req: Request) -> dict:
    """Speculative stats and llama-server-style `timings` (draft_n, draft_n_accepted) of a finished request."""
    seq, s = req.seq, req.seq.stats
    first = req.first_token_s or 0.0
    decode_s = max((req.finished_s or first) - first, 1e-9)
    return {
        "lossless": seq.lossless,
        "fast_prefill": kernels.fast_prefill(),
        "speculative": {
            "type": seq.drafter.name if seq.drafter else "none",
            "drafted": s.drafted,
            "accepted": s.accepted,
            "relaxed": s.relaxed,
            "acceptance_rate": round(s.acceptance_rate, 4),
            "mean_accept_len": round(s.mean_accept_len, 4),
        },
        "timings": {
            "prompt_n": seq.prompt_len,
            "prompt_ms": round(1000 * (req.first_token_s or 0.0), 2),
            "predicted_n": s.new_tokens,
            "predicted_ms": round(1000 * decode_s, 2),
            "predicted_per_second": round(max(s.new_tokens - 1, 0) / decode_s, 3),
            "draft_n": s.drafted,
            "draft_n_accepted": s.accepted,
            "cache_n": seq.cached_tokens,
        },
    }


# -- the other APIs' bodies as OpenAI ones ----------------------------------------------------
EXTENSIONS = ("speculative", *HF_WORDS)  # per-request speculation, in any API's body


def refuse_unsupported(fields: Mapping[str, Any], neutral: Mapping[str, Any], prefix: str = "") -> None:
    """400 for a field that would change the output distribution (penalties, grammars, ...), which specdec does not
    do; `neutral`: field -> its no-op value (None: refused only when non-empty)."""
    for key, ok in neutral.items():
        value = fields.get(key)
        if value is not None and (bool(value) if ok is None else value != ok):
            raise APIError(
                400, f"{prefix}{key}={value!r} is not supported: it would change the output distribution", prefix + key
            )


def sampling_fields(fields: Mapping[str, Any], predict: str, context: int) -> dict[str, Any]:
    """Their sampling fields as OpenAI's: a negative seed is a random one, a negative `predict` (num_predict,
    n_predict) means up to the end of the context, which is `max_tokens` = `context`."""
    out = {k: fields[k] for k in ("temperature", "top_p", "top_k", "min_p", "stop") if fields.get(k) is not None}
    seed, n = fields.get("seed"), fields.get(predict)
    if seed is not None and not (isinstance(seed, int) and seed < 0):
        out["seed"] = seed
    if n is not None:
        out["max_tokens"] = context if isinstance(n, int) and not isinstance(n, bool) and n < 0 else n
    return out


def openai_body(cls: type[_Common], fields: dict[str, Any], names: Mapping[str, str]) -> _Common:
    """`cls` (CompletionRequest or ChatRequest) from converted fields; a bad value is a 400 naming the client's
    field (`names`: our field -> theirs)."""
    try:
        return cls.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        head, dot, rest = ".".join(str(x) for x in err["loc"]).partition(".")
        field = names.get(head, head) + dot + rest
        raise APIError(400, f"{field}: {err['msg']}", field) from None
