"""Tokenizer and chat template for the API process, without transformers or torch.

Reads `tokenizer.json` with `tokenizers` and renders the chat template with jinja2 as
transformers does. The template comes from `--chat-template`, else `chat_template.jinja`, else
`tokenizer_config.json`; templated text is tokenized without adding special tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

from tapserve.api.message_specials import ChatText, MessageSpecials

# the named special tokens transformers passes to chat templates (those the tokenizer sets)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# what the server passes to every chat template: chat_template_kwargs may not replace them
_SERVER_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "self", *SPECIAL_TOKEN_NAMES}
)
# appended to the message continue_final_message continues; the render is cut where it lies
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _char_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: byte-level BPE writes byte b as this char."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = {b: b for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + len(chars) - len(printable)
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF_CHAR = _char_to_byte()  # a constant table


class ChatTemplateError(ValueError):
    """The chat template is missing or failed to render (a 400 for the client)."""


class UnencodableTextError(ValueError):
    """Text that is not valid Unicode: a lone surrogate (a 400 for the client)."""


def check_unicode(text: str) -> None:
    """UnencodableTextError for text holding a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnencodableTextError(
            f"the text is not valid Unicode: a lone surrogate "
            f"U+{ord(text[e.start]):04X} at character {e.start}"
        ) from None


def _token_text(entry: Any) -> str | None:
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


def _sentencepiece_layout(tokenizer: Tokenizer) -> tuple[bool, str | None]:
    """How a SentencePiece-style tokenizer.json spells bytes: (`<0xNN>` byte fallback, the
    word mark), each or None."""
    spec = json.loads(tokenizer.to_str())
    steps = spec.get("decoder") or {}
    steps = steps.get("decoders", [steps]) if isinstance(steps, dict) else []
    mark = None
    for step in steps:
        if step.get("type") == "Metaspace":
            mark = step.get("replacement", "\u2581")
        elif step.get("type") == "Replace" and step.get("content") == " ":
            mark = (step.get("pattern") or {}).get("String") or mark
    byte_fallback = bool((spec.get("model") or {}).get("byte_fallback")) and any(
        step.get("type") == "ByteFallback" for step in steps
    )
    return byte_fallback, mark


class _GenerationBlock(Extension):
    """transformers' `{% generation %}` block, rendered as its body in its own scope."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment chat templates render in, as transformers builds it."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def check_chat_template(text: str, source: str = "--chat-template") -> None:
    """A ValueError for a template that does not compile; source names it in the message."""
    try:
        _template_environment().from_string(text)
    except TemplateError as e:
        raise ValueError(f"{source} does not compile: {e}") from None


def names_a_file(override: str) -> bool:
    """--chat-template names a file (rather than being the template's own text)."""
    try:
        return Path(override).is_file()
    except (OSError, ValueError):  # an inline template: too long for a file name, or a NUL
        return False


def chat_template_text(override: str) -> str:
    """--chat-template: a file's text, or an inline Jinja template; a ValueError otherwise."""
    if names_a_file(override):
        return Path(override).read_text(encoding="utf-8")
    if "{{" in override or "{%" in override:
        return override
    raise ValueError(f"--chat-template {override!r} is neither a file nor a Jinja template")


def _tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json, with a legacy special_tokens_map.json over it, as transformers."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    legacy = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        config = {**config, **json.loads(legacy.read_text(encoding="utf-8"))}
    return config


def _template_source(folder: Path, config: dict, override: str | None) -> str | None:
    if override:
        return chat_template_text(override)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


# ids decoded with the GIL held (a streamed token's window): releasing it costs more
GIL_HELD_DECODE = 256


class TextTokenizer:
    """Encode / decode / chat-template one checkpoint's tokenizer (thread-compatible, no torch)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: dict,
        chat_template: str | None,
        split_special_tokens_in_messages: bool = False,
    ):
        """split_special_tokens_in_messages: special-token text in messages is plain text."""
        self.tokenizer = tokenizer
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None
        }
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.chat_template = chat_template
        self._env = _template_environment()
        self._template = None
        self.token_str = lru_cache(maxsize=65536)(self._token_str)
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._added_ids = set(tokenizer.get_added_tokens_decoder())
        self._byte_fallback, self._word_mark = _sentencepiece_layout(tokenizer)
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self._message_specials = (
            MessageSpecials(tokenizer) if split_special_tokens_in_messages else None
        )

    @classmethod
    def from_dir(
        cls,
        folder: str | Path,
        chat_template: str | None = None,
        split_special_tokens_in_messages: bool = False,
    ) -> TextTokenizer:
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found (the API process needs tokenizer.json)")
        config = _tokenizer_config(folder)
        return cls(
            Tokenizer.from_file(str(tok_file)),
            config,
            _template_source(folder, config, chat_template),
            split_special_tokens_in_messages,
        )

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own EOS token (its config's eos_token), or None."""
        return None if self.eos_token is None else self.tokenizer.token_to_id(self.eos_token)

    @property
    def byte_level(self) -> bool:
        """A byte-level BPE vocabulary (GPT-2's byte-to-unicode map): every token is bytes."""
        return self._byte_level

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """text's token ids; UnencodableTextError for text that is not valid Unicode.
        The batch call releases the GIL."""
        try:
            if isinstance(text, ChatText) and self._message_specials is not None:
                return self._message_specials.encode(text, add_special_tokens)
            return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:  # what `tokenizers` raises for a lone surrogate
            check_unicode(text)
            raise

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """ids' text; a long list's decode releases the GIL (the batch call)."""
        if len(ids) <= GIL_HELD_DECODE:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def _token_str(self, token_id: int) -> str:
        """One token's text, special tokens included (for logprobs and /tokenize)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (OpenAI's chat logprobs `bytes`), maybe part of a character;
        the UTF-8 of token_str outside a byte-level vocabulary."""
        piece = self.tokenizer.id_to_token(token_id)
        if self._byte_level and piece is not None and token_id not in self._added_ids:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:  # not a byte-level entry after all
                pass
        return self.token_str(token_id).encode("utf-8")

    def text_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to a decoded text (for text offsets), SentencePiece byte
        fallback and word marks included."""
        piece = self.tokenizer.id_to_token(token_id)
        if self._byte_level or piece is None or token_id in self._added_ids:
            return self.token_bytes(token_id)
        if self._byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece[-1] == ">":
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._word_mark:
            return piece.replace(self._word_mark, " ").encode("utf-8")
        return self.token_str(token_id).encode("utf-8")

    def legacy_token_str(self, token_id: int) -> str:
        """The token as legacy completions logprobs name it: its text, `bytes:\\xNN...` for
        part of a character (as OpenAI), or `token_id:N` past the tokenizer's entries."""
        if self.tokenizer.id_to_token(token_id) is None:
            return f"token_id:{token_id}"
        data = self.text_bytes(token_id)
        try:
            return data.decode("utf-8")  # (a SentencePiece word's leading space included)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """Render the chat template with the client's extra variables; ChatTemplateError for
        a missing or failing template or variables that replace the server's.
        continue_final_message leaves the last message open."""
        if not self.chat_template:
            raise ChatTemplateError(
                "the model has no chat template; start the server with --chat-template FILE"
            )
        template_kwargs = template_kwargs or {}
        taken = sorted(set(template_kwargs) & _SERVER_TEMPLATE_VARIABLES)
        if taken:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(taken)}")
        marker = None
        if self._message_specials is not None:
            messages, marker = self._message_specials.mark(messages, self.chat_template)
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ChatTemplateError("continue_final_message needs a final message with text")
            messages = [
                *messages[:-1],
                {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG},
            ]
        try:
            if self._template is None:
                self._template = self._env.from_string(self.chat_template)
            # as transformers: the special tokens the tokenizer sets, the others undefined
            text = self._template.render(
                **{"tools": None, "documents": None, **template_kwargs},
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except Exception as e:  # the client's variables can make jinja raise anything
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        if continue_final_message:
            text = _cut_at_continue_tag(text, messages[-1]["content"])
        if marker is None:
            return text
        try:
            return self._message_specials.unmark(text, marker)
        except ValueError as e:
            raise ChatTemplateError(str(e)) from None


def _cut_at_continue_tag(text: str, tagged_content: str) -> str:
    """The rendered chat up to the continued message's end, as transformers cuts it: at the
    tag, with trailing spaces stripped where the template trimmed the tag's own."""
    final, tag = tagged_content[: -len(_CONTINUE_TAG)], _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message: the final message does not appear in "
            "the rendered chat (the template drops part of it)"
        )
    at = text.rindex(tag)
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
