"""Special-token text typed inside chat messages, tokenized as plain text
(`--split-special-tokens-in-messages`, transformers' `split_special_tokens` for message
content only).

Each special token's text in a message's content is swapped for a marker while the chat
template renders and put back after, its span noted (ChatText.literal); encoding keeps the
template's own special tokens special and tokenizes everything else as plain text.
"""

from __future__ import annotations

import bisect
import re
from typing import Any

from tokenizers import Encoding, Tokenizer


class ChatText(str):
    """Rendered chat text; `literal`: the (start, end) spans where message content spelled a
    special token, to tokenize as plain text."""

    literal: tuple[tuple[int, int], ...] = ()

    def __new__(cls, text: str, literal: tuple[tuple[int, int], ...]) -> ChatText:
        made = super().__new__(cls, text)
        made.literal = literal
        return made


class MessageSpecials:
    """Marks special-token text in messages and encodes the rendered chat around it."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.plain = Tokenizer.from_str(tokenizer.to_str())
        self.plain.encode_special_tokens = True  # (set once, before any thread uses it)
        added = {t.content: t for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        self.added = added
        self.texts = sorted(added, key=len, reverse=True)  # longest first, as a regex tries
        self.index = {text: i for i, text in enumerate(self.texts)}
        self.pattern = re.compile("|".join(map(re.escape, self.texts))) if added else None

    def mark(self, messages: list[dict], template: str) -> tuple[list[dict], str | None]:
        """messages with special tokens' text marked, and the marker (None: nothing marked)."""
        contents = [m.get("content") for m in messages]
        if self.pattern is None or not any(
            isinstance(c, str) and self.pattern.search(c) for c in contents
        ):
            return messages, None
        seen = template + "".join(c for c in contents if isinstance(c, str))
        marker = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in seen)

        def marked(match: re.Match) -> str:
            return f"{marker}{self.index[match.group()]}{marker}"

        return [
            {**m, "content": self.pattern.sub(marked, m["content"])}
            if isinstance(m.get("content"), str)
            else m
            for m in messages
        ], marker

    def unmark(self, rendered: str, marker: str) -> ChatText:
        """The rendered text with the marked special tokens' text back, their spans noted;
        a ValueError when the template changed a marker."""
        pieces = rendered.split(marker)
        if len(pieces) % 2 == 0 or not all(p.isdigit() for p in pieces[1::2]):
            raise ValueError("the chat template changed message content it renders")
        text, spans, at = [], [], 0
        for i, piece in enumerate(pieces):
            if i % 2:
                piece = self.texts[int(piece)]
                spans.append((at, at + len(piece)))
            text.append(piece)
            at += len(piece)
        return ChatText("".join(text), tuple(spans))

    def encode(self, text: ChatText, add_special_tokens: bool) -> list[int]:
        """text's ids: its literal spans as plain text, every other special token special."""
        starts = [s for s, _ in text.literal]
        plain, special, at = [], [], 0
        for match in self.pattern.finditer(text):
            start, end = match.span()
            i = bisect.bisect_right(starts, start) - 1
            if i >= 0 and start < text.literal[i][1]:
                continue  # typed in a message
            token = self.added[match.group()]
            if token.lstrip:  # the whitespace the token takes with it, as tokenizers strips it
                start = max(at, len(text[:start].rstrip()))
            if token.rstrip:
                end = len(text) - len(text[end:].lstrip())
            plain.append(text[at:start])
            special.append(text[start:end])
            at = end
        plain.append(text[at:])
        pieces: list[Any] = self.plain.encode_batch(plain, add_special_tokens=False)
        tokens = self.tokenizer.encode_batch(special, add_special_tokens=False) if special else []
        interleaved = [e for pair in zip(pieces, tokens) for e in pair] + [pieces[-1]]
        merged = Encoding.merge(interleaved, growing_offsets=True)
        return self.tokenizer.post_process(merged, None, add_special_tokens).ids
