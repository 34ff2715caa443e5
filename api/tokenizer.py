"""Tokenizer and chat template for the API process, without transformers or torch.

transformers 5 imports torch when it loads a tokenizer (and takes seconds), so the API process
reads the checkpoint's `tokenizer.json` with the `tokenizers` library and renders the chat
template with jinja2 the way transformers does (sandboxed, trim_blocks, lstrip_blocks,
`raise_exception`, `strftime_now`, `tojson`). The template comes from `--chat-template FILE`,
else `chat_template.jinja` (transformers 5), else `tokenizer_config.json["chat_template"]`.
Templated text is tokenized without adding special tokens (the template holds them).
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ChatTemplateError(ValueError):
    """The chat template is missing or failed to render (a 400 for the client)."""


def _token_text(entry: Any) -> str | None:
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _template_source(folder: Path, config: dict, override: str | None) -> str | None:
    if override:
        path = Path(override)
        return path.read_text(encoding="utf-8") if path.is_file() else override
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


class TextTokenizer:
    """Encode / decode / chat-template one checkpoint's tokenizer (thread-compatible, no torch)."""

    def __init__(self, tokenizer: Tokenizer, config: dict, chat_template: str | None):
        self.tokenizer = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.chat_template = chat_template
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=[loopcontrols])
        self._env.filters["tojson"] = _tojson
        self._env.globals["raise_exception"] = _raise_exception
        self._env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = None
        self.token_str = lru_cache(maxsize=65536)(self._token_str)

    @classmethod
    def from_dir(cls, folder: str | Path, chat_template: str | None = None) -> "TextTokenizer":
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found (the API process needs tokenizer.json)")
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        return cls(Tokenizer.from_file(str(tok_file)), config,
                   _template_source(folder, config, chat_template))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _token_str(self, token_id: int) -> str:
        """One token's text, special tokens included (for logprobs and /tokenize)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the chat template; raises ChatTemplateError for a missing or failing one."""
        if not self.chat_template:
            raise ChatTemplateError("the model has no chat template; start the server with "
                                    "--chat-template FILE")
        try:
            if self._template is None:
                self._template = self._env.from_string(self.chat_template)
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                   **kwargs)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
