"""Incremental detokenization of one sequence, UTF-8 safe, with stop strings.

Text is the difference of two decodes of a small window of ids, as in TGI and vLLM; tokens
ending inside a character are held back until it completes, so a stream never carries broken
UTF-8. The first stop string in the output ends the sequence and cuts the text; while
streaming, its possible start is held back.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

PROMPT_CONTEXT = 5  # prompt tokens kept as decoding context (more to start on a character)
_MAX_HELD_TOKENS = 8  # give up waiting for a character to complete after this many tokens


# the second byte's range after these lead bytes (Unicode's table 3-7); else 0x80-0xBF
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _utf8_length(lead: int) -> int:
    """The bytes of the character a lead byte begins (0: not a lead byte)."""
    return (
        1
        if lead < 0x80
        else 2
        if 0xC2 <= lead < 0xE0
        else 3
        if 0xE0 <= lead < 0xF0
        else 4
        if 0xF0 <= lead < 0xF5
        else 0
    )


def _open_character_bytes(data: bytes) -> int:
    """How many bytes at the end of data begin a UTF-8 character that more bytes could
    complete; 0 when none do."""
    for back in range(1, min(4, len(data) + 1)):
        byte = data[-back]
        if 0x80 <= byte < 0xC0:
            continue  # a continuation byte: its lead is further back
        if back >= _utf8_length(byte):
            return 0
        second = _SECOND_BYTE.get(byte)  # (E0 80 .. is overlong, ED A0 .. a surrogate: never)
        if back > 1 and second and not second[0] <= data[-back + 1] <= second[1]:
            return 0
        return back
    return 0


class TextOffsets:
    """Where each token's text begins (OpenAI's text_offset), from the tokens' bytes, counting
    characters as decode writes them: one U+FFFD for each maximal run of invalid bytes."""

    def __init__(self, prompt_open: bytes = b"") -> None:
        """prompt_open: the bytes of a character the prompt leaves unfinished (the prompt's)."""
        self._pending = prompt_open  # an unfinished character's bytes so far
        self._owned = bool(prompt_open)  # ... and they are the prompt's
        self._chars = 0  # characters before them

    def add(self, data: bytes) -> int:
        """The next token's offset, given its bytes (b"" for a token whose text is left out)."""
        offset = self._chars + (
            bool(self._pending) and not self._owned and bool(data) and not self._continues(data[0])
        )
        for byte in data:
            self._add_byte(byte)
        return offset

    def _continues(self, byte: int) -> bool:
        lo, hi = (
            _SECOND_BYTE.get(self._pending[0], (0x80, 0xBF))
            if len(self._pending) == 1
            else (0x80, 0xBF)
        )
        return lo <= byte <= hi

    def _add_byte(self, byte: int) -> None:
        if self._pending:
            if self._continues(byte):
                self._pending += bytes([byte])
                if len(self._pending) == _utf8_length(self._pending[0]):
                    self._end_pending()
                return
            self._end_pending()  # their U+FFFD
        if _utf8_length(byte) > 1:
            self._pending = bytes([byte])
        else:
            self._chars += 1  # a character, or a U+FFFD for a byte no character begins with

    def _end_pending(self) -> None:
        """The unfinished character is done."""
        self._chars += not self._owned
        self._pending, self._owned = b"", False


def open_character_bytes(token_bytes: list[bytes]) -> bytes:
    """The bytes of a character that the last of these tokens leave unfinished (b"")."""
    tail = b"".join(token_bytes[-3:])
    opened = _open_character_bytes(tail)
    return tail[len(tail) - opened :] if opened else b""


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def prompt_context(decoder: Decoder, prompt_ids: list[int]) -> list[int]:
    """The prompt tokens a sequence's decoding window starts with: the last PROMPT_CONTEXT, and
    up to 3 more (with a decoder that has `text_bytes`) so it does not start inside a character."""
    start = max(0, len(prompt_ids) - PROMPT_CONTEXT)
    text_bytes = getattr(decoder, "text_bytes", None)
    if text_bytes is not None:
        for _ in range(3):
            first = text_bytes(prompt_ids[start])[:1] if start > 0 else b""
            if not (first and 0x80 <= first[0] < 0xC0):
                break
            start -= 1  # a continuation byte: its character began further back
    return list(prompt_ids[start:])


@dataclass
class StopChecker:
    stop: list[str] = field(default_factory=list)
    include_stop_str: bool = False
    # as vLLM: stop strings count only once the output has more tokens than this
    min_tokens: int = 0
    matched: str | None = None  # the stop string of the last cut `find` returned

    @property
    def hold(self) -> int:
        """Characters to hold back while streaming."""
        if not self.stop or self.include_stop_str:
            return 0
        return max(len(s) for s in self.stop) - 1

    def find(self, text: str, new_from: int) -> int | None:
        """Where the text must be cut for a stop string at or after `new_from`, else None."""
        best: tuple[int, int] | None = None
        for s in self.stop:
            if not s:
                continue
            pos = text.find(s, max(0, new_from - len(s) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, len(s))
        if best is None:
            return None
        self.matched = text[best[0] : best[0] + best[1]]
        return best[0] + best[1] if self.include_stop_str else best[0]


class IncrementalDetokenizer:
    """Feed output token ids; read the text grown since the last read (`take_delta`)."""

    def __init__(
        self,
        decoder: Decoder,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        stop: StopChecker | None = None,
    ):
        self.decoder = decoder
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or StopChecker()
        self._ids: list[int] = prompt_context(decoder, prompt_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all output text decoded so far (cut at a stop string)
        self.num_tokens = 0  # output tokens consumed (up to and including a stop match)
        self.stopped = False  # a stop string matched
        self._sent = 0  # characters of self.text already handed out
        self._ends: list[int] = []  # len(text) after each consumed token (before any cut)

    def add_tokens(self, token_ids: list[int]) -> int:
        """Consume new token ids; returns how many were used (none after a stop string)."""
        used = 0
        for token in token_ids:
            if self.stopped:
                break
            used += 1
            self.num_tokens += 1
            self._ids.append(token)
            grown = self._decode_step()
            if grown:
                old_len = len(self.text)
                self.text += grown
                self._cut_at_stop(old_len)
            self._ends.append(len(self.text))
        return used

    def _cut_at_stop(self, new_from: int) -> None:
        """Cut the text at a stop string in what changed since new_from, past min_tokens."""
        if self.num_tokens <= self.stop.min_tokens:
            return
        cut = self.stop.find(self.text, new_from)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True

    @property
    def kept_tokens(self) -> int:
        """Output tokens up to the one that produced the last kept character (an upper bound
        after a stop-string cut; 0 when nothing is kept)."""
        if not self.stopped:
            return self.num_tokens
        return bisect.bisect_left(self._ends, len(self.text)) + 1 if self.text else 0

    def _decode_step(self, final: bool = False) -> str:
        prefix = self._decode(self._read_offset)
        end = len(self._ids)
        full = self._decode(end)
        if full.endswith("\ufffd") and not final:
            if end - self._read_offset < _MAX_HELD_TOKENS:
                return ""
            end, full = self._without_open_tail(end, full)  # give up waiting, mostly
        if len(full) <= len(prefix):
            return ""
        new = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, end
        if self._prefix_offset > 64:  # keep the window small
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset, self._read_offset = 0, self._read_offset - drop
        return new

    def _decode(self, end: int) -> str:
        return self.decoder.decode(self._ids[self._prefix_offset : end], self.skip_special_tokens)

    def _without_open_tail(self, end: int, full: str) -> tuple[int, str]:
        """When giving up on held tokens (byte-level BPE only): the end and text that keep back
        the last held tokens whose bytes open a character the next token may complete."""
        if not getattr(self.decoder, "byte_level", False):  # (a SentencePiece byte run
            return end, full  # decodes as a whole: cut, it would read differently)
        last = self._held_bytes(end)
        opened = _open_character_bytes(b"".join(last))
        k, held_bytes = 0, 0
        while held_bytes < opened:  # the fewest last tokens that hold the open bytes
            k += 1
            held_bytes += len(last[-k])
        if k == 0:
            return end, full
        for cut in range(end - k, self._read_offset - 1, -1):
            shorter = self._decode(cut)
            if full.startswith(shorter):
                return cut, shorter
        return end, full

    def finish(self) -> None:
        """The sequence ended: flush characters held for completion."""
        if not self.stopped and self._read_offset < len(self._ids):
            self._append_last(self._decode_step(final=True))

    def drop_held(self) -> None:
        """The sequence ends on a token whose text is left out: flush the held text, except a
        character left open, which is dropped (as vLLM does)."""
        end = len(self._ids)
        if self.stopped or self._read_offset >= end:
            return
        if getattr(self.decoder, "byte_level", False):
            prefix, full = self._decode(self._read_offset), self._decode(end)
            if _open_character_bytes(b"".join(self._held_bytes(end))) and full.endswith("\ufffd"):
                full = full[:-1]
            self._append_last(full[len(prefix) :] if len(full) > len(prefix) else "")
        self._read_offset = len(self._ids)

    def _held_bytes(self, end: int) -> list[bytes]:
        """Each held token's bytes up to end (none for a skipped special token)."""
        skipped = getattr(self.decoder, "special_ids", ()) if self.skip_special_tokens else ()
        return [
            b"" if t in skipped else self.decoder.token_bytes(t)
            for t in self._ids[self._read_offset : end]
        ]

    def _append_last(self, grown: str) -> None:
        """The last text of an ended sequence, credited to its last token."""
        if grown:
            old_len = len(self.text)
            self.text += grown
            self._ends[-1] = len(self.text)
            self._cut_at_stop(old_len)

    def take_delta(self, final: bool = False) -> str:
        """Text not handed out yet; while not final, minus the stop-string hold-back."""
        end = (
            len(self.text)
            if final or self.stopped
            else max(self._sent, len(self.text) - self.stop.hold)
        )
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
