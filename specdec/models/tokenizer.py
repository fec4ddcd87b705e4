"""Tokenizer: a `tokenizers` fast tokenizer plus special tokens and the chat template."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from specdec.errors import SpecdecError

# Special tokens that end a turn in the chat formats we know; used as extra stop tokens.
# gpt-oss (o200k_harmony): <|return|> ends an answer, <|call|> a tool call; its <|end|> only ends one message of it,
# as llama.cpp's vocabulary loader treats it
END_OF_TURN = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "</s>",
    "<|return|>",
    "<|call|>",
)


def _token_str(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


class Tokenizer:
    def __init__(self, directory: Path):
        from tokenizers import Tokenizer as FastTokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.exists():
            raise SpecdecError(f"{directory}: no tokenizer.json (a fast tokenizer is required)")
        self.fast = FastTokenizer.from_file(str(path))
        cfg_path = Path(directory) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        tpl = Path(directory) / "chat_template.jinja"
        self.chat_template: str | None = tpl.read_text() if tpl.exists() else cfg.get("chat_template")
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))

    @property
    def vocab_size(self) -> int:
        return self.fast.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.fast.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; `encode_batch` releases the GIL while it works (`encode` holds it), so a long prompt
        tokenized on a worker thread stalls neither the server's event loop nor the engine thread."""
        return self.fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.fast.decode(ids, skip_special_tokens=True)

    def stop_ids(self, config_eos: list[int]) -> set[int]:
        """EOS ids from the model config and tokenizer, plus known end-of-turn tokens."""
        ids = set(config_eos)
        for tok in (self.eos_token, *END_OF_TURN):
            i = self.token_id(tok)
            if i is not None:
                ids.add(i)
        return ids

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        if not self.chat_template:
            raise SpecdecError("this model has no chat template; use a plain prompt")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg: str):
            raise TemplateError(msg)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise SpecdecError(f"chat template error: {e}") from None

    def same_vocab(self, other: "Tokenizer") -> bool:
        """True if both give every id they share the same token (trailing padding ids may differ)."""
        n = min(self.vocab_size, other.vocab_size)
        return all(self.fast.id_to_token(i) == other.fast.id_to_token(i) for i in range(n))


class Detokenizer:
    """Incremental decoding for streaming: emits only complete characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta
