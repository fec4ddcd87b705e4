"""OpenAI request bodies (the fields we honour; unknown fields are ignored as OpenAI-compatible servers do)
and the OpenAI error format."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from specdec.sampling import SEED_LIMIT, SamplingParams

MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings per request, characters per stop string
MAX_BODY = 4 << 20  # default --max-body (bytes)


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class Speculative(BaseModel):
    """Per-request speculation (extension field `speculative`)."""
    model_config = ConfigDict(extra="forbid")
    type: str | None = None                            # a spec type or chain; None: the server's
    draft_max: StrictInt | None = Field(None, ge=1, le=256)
    accept_threshold: float | None = Field(None, ge=0, le=1)  # opt-in lossy relaxed acceptance (--allow-lossy)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


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

    def sampling(self, defaults: SamplingParams, max_tokens: int | None) -> SamplingParams:
        """Request fields over the server's defaults; out-of-range values raise APIError 400."""
        if self.presence_penalty or self.frequency_penalty:
            raise APIError(400, "presence_penalty and frequency_penalty are not supported", "presence_penalty")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"stop must be up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                           "characters", "stop")
        pick = lambda v, d: d if v is None else v  # noqa: E731
        top_k = pick(self.top_k, defaults.top_k)
        return SamplingParams(temperature=pick(self.temperature, defaults.temperature),
                              top_k=max(0, top_k), top_p=pick(self.top_p, defaults.top_p),
                              min_p=pick(self.min_p, defaults.min_p), seed=self.seed,
                              max_tokens=pick(max_tokens, defaults.max_tokens), stop=stops)


class CompletionRequest(_Common):
    prompt: Union[str, list[StrictInt], list[str]]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None

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

    def chat_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
