"""llama-server's `/completion` (and its alias `/completions`) over the same handler as the OpenAI routes: its
request fields, its answer (`content`, `stop`, `tokens_predicted`, `tokens_evaluated`, `stop_type`, `timings`),
its SSE stream (`data: {"content": ..., "stop": false}` lines, no [DONE]) and its error format; and its
`/tokenize`, `/detokenize`, `/props` and `/slots`."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, Union

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

import specdec
from specdec.server.protocol import (
    EXTENSIONS,
    APIError,
    CompletionRequest,
    openai_body,
    refuse_unsupported,
    response_stats,
    sampling_fields,
)

if TYPE_CHECKING:
    from specdec.engine.scheduler import Request
    from specdec.sequence import Sequence
    from specdec.server.handler import Handler

PATHS = ("/completion", "/completions")
# fields that would change the output distribution, with their no-op values (llama-server's defaults)
NEUTRAL = {
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "typical_p": 1.0,
    "mirostat": 0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "top_n_sigma": -1.0,
    "dynatemp_range": 0.0,
    "ignore_eos": False,
    "logit_bias": None,
}
NAMES = {"max_tokens": "n_predict"}  # our field -> llama-server's, in errors
# llama-server's error types by status
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "unavailable_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class Tokenize(BaseModel):
    content: str
    add_special: StrictBool = False
    with_pieces: StrictBool = False


class Detokenize(BaseModel):
    tokens: list[StrictInt]


class LlamaCompletion(BaseModel):
    """The fields read here; the others (n_predict, temperature, ...) are converted from `model_extra`."""

    model_config = ConfigDict(extra="allow")
    prompt: Union[str, list[StrictInt], list[str]]
    stream: StrictBool = False


def add_routes(app: FastAPI, h: Handler) -> None:
    """llama-server's /completion and its error format on `app`, served by `h` (specdec.server.handler.Handler)."""
    for path in PATHS:
        app.state.error_bodies[path] = error_body

    @app.post(PATHS[0])
    @app.post(PATHS[1], include_in_schema=False)  # the same route: fuzzed once
    async def completion(body: LlamaCompletion, http: HTTPRequest, scope: int | None = Depends(h.auth)):
        fields = body.model_extra or {}
        refuse_unsupported(fields, NEUTRAL)
        if fields.get("n_probs"):
            raise APIError(
                400, "n_probs is not supported on /completion (ask /v1/completions with logprobs)", "n_probs"
            )
        openai = openai_body(
            CompletionRequest,
            {
                **sampling_fields(fields, "n_predict", h.llm.context),
                "prompt": body.prompt,
                "stream": body.stream,
                "cache_prompt": fields.get("cache_prompt", True),
                **{k: fields[k] for k in ("grammar", "json_schema", "response_format") if fields.get(k) is not None},
                **{k: fields[k] for k in EXTENSIONS if k in fields},
            },
            NAMES,
        )  # no `model`: llama-server's /completion serves its one model whatever the body says
        return await h.completions(openai, http, scope, _Wire(h.llm.tokenizer.decode, h.cfg.model_id))

    @app.post("/tokenize", dependencies=[Depends(h.auth)])
    async def tokenize(body: Tokenize):
        tok = h.llm.tokenizer
        ids = tok.encode(body.content, add_special_tokens=body.add_special)
        return {"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids] if body.with_pieces else ids}

    @app.post("/detokenize", dependencies=[Depends(h.auth)])
    async def detokenize(body: Detokenize):
        vocab = h.llm.runner.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"content": h.llm.tokenizer.decode(body.tokens)}

    @app.get("/props", dependencies=[Depends(h.auth)])
    async def props():
        d = h.cfg.defaults
        return {
            "default_generation_settings": {
                "n_ctx": h.llm.context,
                "params": {
                    "n_predict": d.max_tokens,
                    "temperature": d.temperature,
                    "top_k": d.top_k,
                    "top_p": d.top_p,
                    "min_p": d.min_p,
                    "speculative.type": h.llm.spec_type,
                    "speculative.n_max": h.llm.engine.spec.draft_max,
                },
            },
            "total_slots": h.llm.parallel,
            "model_path": h.cfg.model_id,
            "model_alias": h.cfg.model_id,
            "chat_template": h.llm.tokenizer.chat_template or "",
            "build_info": f"specdec {specdec.__version__}",
        }

    @app.get("/slots", dependencies=[Depends(h.auth)])
    async def slots():
        free = set(h.scheduler.free)
        return [{"id": i, "n_ctx": h.llm.context, "is_processing": i not in free} for i in range(h.llm.parallel)]


def error_body(e: APIError) -> dict:
    """llama-server's error format: {"error": {"code", "message", "type"}}."""
    kind = "exceed_context_size_error" if e.code == "context_length_exceeded" else TYPES.get(e.status, "server_error")
    return {"error": {"code": e.status, "message": e.message, "type": kind}}


class _Wire:
    """llama-server's answer: SSE lines {"content", "stop": false}, then one with stop true and the totals; the
    totals and the whole text in one object when not streamed."""

    media_type = "text/event-stream"

    def __init__(self, decode, model_id: str):
        self.decode, self.model_id = decode, model_id
        self.rid = "cmpl-" + uuid.uuid4().hex[:24]

    def opening(self) -> list[str]:
        return []

    def piece(self, delta: str, toks: list[int], lps: list, trace: Any) -> str:
        return _data({"content": delta, "stop": False})

    def closing(self, req: Request, events: Any, err: APIError | None) -> list[str]:
        return [_data(error_body(err) if err else self._final(req, ""))]

    def response(self, req: Request) -> dict:
        return self._final(req, req.seq.text)

    def _final(self, req: Request, content: str) -> dict:
        seq = req.seq
        stop_type, word = self._stop(seq)
        return {
            "content": content,
            "stop": True,
            "model": self.model_id,
            "tokens_predicted": seq.stats.new_tokens,
            "tokens_evaluated": seq.prompt_len,
            "stop_type": stop_type,
            "stopping_word": word,
            "truncated": False,
            **response_stats(req),
        }

    def _stop(self, seq: Sequence) -> tuple[str, str]:
        """llama-server's stop_type (limit, word, eos) and stopping_word: a stop string is where the text was cut."""
        if seq.finish_reason == "length":
            return "limit", ""
        rest = self.decode(seq.output_ids)[len(seq.text) :]
        word = next((s for s in seq.params.stop if rest.startswith(s)), None)
        return ("word", word) if word is not None else ("eos", "")


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
