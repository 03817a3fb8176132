"""Tokenizer and chat template of a model folder (tokenizer.json, tokenizer_config.json)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from shared.errors import InvalidRequestError, ModelFormatError, ModelNotFoundError


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template."""

    def __init__(self, tok: HFTokenizer, config: dict[str, Any], eos_token_ids: Sequence[int]):
        self._tok = tok
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token: str | None = _token_str(config.get("bos_token"))
        self.eos_token: str | None = _token_str(config.get("eos_token"))
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.special_ids = frozenset(
            tid for tid, added in tok.get_added_tokens_decoder().items() if added.special
        )
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(self.chat_template)

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ModelNotFoundError(f"{folder} has no tokenizer.json (fast tokenizer file)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception on bad files
            raise ModelFormatError(f"{path} is not a valid tokenizer file: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")
        eos = gen.get("eos_token_id", model_cfg.get("eos_token_id"))
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        eos_tok = _token_str(config.get("eos_token"))
        if eos_tok is not None:
            tid = tok.token_to_id(eos_tok)
            if tid is not None and tid not in eos_ids:
                eos_ids.append(tid)
        return cls(tok, config, eos_ids)

    def to_json(self) -> str:
        """The tokenizer as its tokenizer.json text (what grammar engines read)."""
        return str(self._tok.to_str())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, tid: int) -> str | None:
        return self._tok.id_to_token(tid)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; use completions instead")
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Chat messages -> prompt ids (the template carries the special tokens itself)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} as older configs write it
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} must hold a JSON object")
    return data
