"""/detokenize: its body read and decoded without holding the event loop.

A large body's `tokens` array is parsed in a worker thread by numpy, which releases the GIL
(json.loads would hold it about 0.7 s for 10 MB); a body this cannot read is parsed the
ordinary way, with the ordinary errors.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

import numpy as np
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from tapserve.api.errors import invalid
from tapserve.api.openai_schemas import StrictModel
from tapserve.api.state import AppState

DETOKENIZE_MAX_BODY_BYTES = 10 * 1024 * 1024
_CHUNK_BYTES = 256 * 1024
_IDS_CHUNK = 65536
_TEXT_CHUNK = 256 * 1024
_INTEGERS = re.compile(rb"\s*-?\d+\s*(?:,\s*-?\d+\s*)*")
_INT64 = np.iinfo(np.int64)


class DetokenizeRequest(StrictModel):
    model: str | None = None  # as TokenizeRequest's
    tokens: list[int]
    skip_special_tokens: bool = False


def detokenize(state: AppState, raw: bytes, content_type: str | None, fast: bool) -> Response:
    """/detokenize's answer; `fast`: read `tokens` with numpy where the body allows."""
    split = split_token_list(raw) if fast and is_json(content_type) else None
    if split is None:
        body = validated(DetokenizeRequest, raw, content_type)
        ids: Any = body.tokens
    else:
        body = validated_object(DetokenizeRequest, {**split[0], "tokens": []})
        ids = split[1]
    state.check_model(body.model)
    vocab = state.vocab_size
    if isinstance(ids, np.ndarray):
        bad = ids[(ids < 0) | (ids >= vocab)][:5].tolist()
        ids = id_list(ids)
    else:
        bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise invalid(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "tokens")
    text = state.tokenizer.decode(ids, body.skip_special_tokens)
    return Response(_prompt_json(text), media_type="application/json")


def _prompt_json(text: str) -> bytes:
    """{"prompt": text} as JSONResponse writes it, escaped a piece at a time (GIL handovers)."""
    pieces = (
        json.dumps(text[at : at + _TEXT_CHUNK], ensure_ascii=False)[1:-1]
        for at in range(0, len(text), _TEXT_CHUNK)
    )
    return ('{"prompt":"' + "".join(pieces) + '"}').encode("utf-8")


def validated(model: type[BaseModel], raw: bytes, content_type: str | None) -> Any:
    """The body as FastAPI parses a JSON body parameter, with FastAPI's errors."""
    data: Any = raw
    if is_json(content_type):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error"}
            raise RequestValidationError(
                [{**error, "input": {}, "ctx": {"error": e.msg}}]
            ) from None
        except (ValueError, RecursionError):  # not UTF-8, or nested too deep: as FastAPI
            raise invalid(
                "request body could not be read: There was an error parsing the body"
            ) from None
    return validated_object(model, data)


def is_json(content_type: str | None) -> bool:
    """A body FastAPI would parse as JSON: no Content-Type, application/json or +json."""
    maintype, _, subtype = (content_type or "application/json").partition(";")[0].partition("/")
    subtype = subtype.strip().lower()
    return maintype.strip().lower() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def validated_object(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in e.errors()]
        ) from None


def split_token_list(raw: bytes) -> tuple[dict, np.ndarray] | None:
    """(the body's other fields, its `tokens` as int64) for a JSON object whose first array
    is its top-level `tokens`, a flat list of int64 integers; else None."""
    start = raw.find(b"[")
    end = raw.find(b"]", start + 1)
    if start < 1 or end < 0 or raw[start - 1 : start] == b"\\":
        return None
    # a placeholder the client cannot guess: found as `tokens` only if the array was it
    placeholder = secrets.token_hex(16)
    try:
        rest = json.loads(b'%s"%s"%s' % (raw[:start], placeholder.encode(), raw[end + 1 :]))
    except (ValueError, RecursionError):
        return None
    if not isinstance(rest, dict) or rest.pop("tokens", None) != placeholder:
        return None
    ids = _integers(memoryview(raw)[start + 1 : end])
    return None if ids is None else (rest, ids)


def _integers(text: memoryview) -> np.ndarray | None:
    """Comma-separated integers, parsed a chunk at a time; None unless all are int64."""
    parts, pos = [], 0
    while pos < len(text):
        cut = bytes(text[pos + _CHUNK_BYTES : pos + _CHUNK_BYTES + 32]).find(b",")
        cut = len(text) if cut < 0 or pos + _CHUNK_BYTES >= len(text) else pos + _CHUNK_BYTES + cut
        chunk = bytes(text[pos:cut])
        if not _INTEGERS.fullmatch(chunk):
            return None
        values = np.fromstring(chunk, dtype=np.int64, sep=",")
        if len(values) != chunk.count(b",") + 1:
            return None
        parts.append(values)
        pos = cut + 1
    if not parts or pos == len(text):  # empty, or a trailing comma
        return None
    ids = np.concatenate(parts)
    if ((ids == _INT64.max) | (ids == _INT64.min)).any():  # saturated: past int64
        return None
    return ids


def id_list(ids: np.ndarray) -> list[int]:
    """ids as Python ints, a chunk at a time (so the thread can hand the GIL over)."""
    out: list[int] = []
    for at in range(0, len(ids), _IDS_CHUNK):
        out.extend(ids[at : at + _IDS_CHUNK].tolist())
    return out
