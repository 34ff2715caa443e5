"""Messages between the API process and the rank-0 coordinator, and their one codec.

msgpack maps with a `type` tag and a protocol `version`. No torch, no pickle: both
sides import this module. Custom outputs travel as {dtype, shape, data} with raw bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
# the two ipc sockets in the coordinator's private dir (ApiConfig.ipc_dir), named from rank 0
TO_ENGINE, FROM_ENGINE = "to_engine", "from_engine"

# error codes (DESIGN.md "Errors")
INVALID_PARAMS = 605
EXECUTION_EXCEPTION = 606
ERROR_NAMES = {INVALID_PARAMS: "605_INVALID_PARAMS", EXECUTION_EXCEPTION: "606_EXECUTION_EXCEPTION"}


@dataclass
class AddRequest:
    """API -> coordinator: a new request, already tokenized."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict  # SamplingParams.to_dict()
    custom_output_params: dict | None = None
    arrival_time: float = 0.0
    TYPE = "add"


@dataclass
class AbortRequest:
    """API -> coordinator: drop a request (client went away, or a stop string matched)."""

    request_id: str
    TYPE = "abort"


@dataclass
class DrainRequest:
    """API -> coordinator: the API process got SIGTERM or SIGINT; drain as on a signal to
    rank 0 at signal_time (the host's monotonic clock)."""

    signal: int
    signal_time: float = 0.0
    TYPE = "drain"


@dataclass
class SequenceOutput:
    """New tokens of one sequence (index i of n / of the beams) since its last output."""

    index: int
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] | None = None
    # per new token: [[token_id, logprob], ...] of the top_logprobs alternatives
    new_top_logprobs: list[list[list]] | None = None
    # "stop" | "length" | "abort" | "error" | "content_filter" (the head's should_stop)
    finish_reason: str | None = None
    cumulative_logprob: float | None = None  # beam score (length-penalised) for beams
    # this sequence's own custom output (LAST_GENERATED), sent with its finish_reason
    custom_output: dict | None = None
    # a multi-row selection: this sequence's new generated-token rows, {dtype, shape [k] or
    # [k, width], data}, and each row's index in prompt + generated ids; the rows of exactly
    # the new tokens, plus, with "content_filter", the flagged token's (which has no id here)
    custom_rows: dict | None = None
    custom_positions: list[int] | None = None


@dataclass
class RequestOutput:
    """Coordinator -> API: one request's progress. The first output of every request has
    accepted=True or carries an error; later outputs carry new tokens."""

    request_id: str
    accepted: bool = True
    sequences: list[SequenceOutput] = field(default_factory=list)
    finished: bool = False
    custom_output: dict | None = None  # {"dtype": str, "shape": list[int], "data": bytes}
    error_code: int | None = None
    error_message: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # on the accept answer: the coordinator detects the stop strings (a cut choice waits for
    # its final output); sent only when true
    engine_stop_strings: bool = False
    # on a rejection: the request field at fault, by the engine's names; sent only when set
    error_param: str | None = None
    # "prefix_reuse": the selected prompt position came from the prefix cache; sent if set
    custom_output_omitted: str | None = None
    # a multi-row selection: new prompt-position rows, shared by every sequence, and their
    # positions (as SequenceOutput's); sent once each, only when set
    custom_rows: dict | None = None
    custom_positions: list[int] | None = None


@dataclass
class Outputs:
    """Coordinator -> API: one engine step's news. A plain decode token travels in two
    columns (request token_request_ids[i] got new_token_ids[i]); a plain token of an
    every-generated-token request in three more with its row (row_request_ids[i] got
    row_token_ids[i] at row_positions[i], its custom_rows the i-th row of `rows`); the rest as
    full outputs. Iterating yields every request's output, the columns expanded."""

    outputs: list[RequestOutput] = field(default_factory=list)
    token_request_ids: list[str] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    row_request_ids: list[str] = field(default_factory=list)
    row_token_ids: list[int] = field(default_factory=list)
    row_positions: list[int] = field(default_factory=list)
    rows: dict | None = None  # {dtype, shape [k] or [k, width], data}: one row per entry
    TYPE = "outputs"

    def __iter__(self) -> Iterator[RequestOutput]:
        yield from self.outputs
        for request_id, token in zip(self.token_request_ids, self.new_token_ids):
            yield RequestOutput(request_id, True, [SequenceOutput(0, [token])])
        if self.row_request_ids:
            yield from self.row_outputs()

    def row_outputs(self) -> Iterator[RequestOutput]:
        """The row columns' entries, each as its request's output."""
        rows = self.rows
        dtype, width, data = rows["dtype"], list(rows["shape"][1:]), rows["data"]
        size = len(data) // len(self.row_request_ids)
        for i, (request_id, token, position) in enumerate(
            zip(self.row_request_ids, self.row_token_ids, self.row_positions)
        ):
            row = {"dtype": dtype, "shape": [1, *width], "data": data[i * size : (i + 1) * size]}
            yield RequestOutput(
                request_id,
                True,
                [SequenceOutput(0, [token], custom_rows=row, custom_positions=[position])],
            )

    def __len__(self) -> int:
        return len(self.outputs) + len(self.token_request_ids) + len(self.row_request_ids)


@dataclass
class EngineStats:
    """Coordinator -> API, about once a second: gauges for /metrics and /health."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    custom_output_calls: int = 0
    custom_output_errors: int = 0  # forward() calls that failed (606 for their rows' requests)
    custom_output_selector_invalid: int = 0  # requests whose selector raised ValueError (605)
    custom_output_selector_errors: int = 0  # requests whose selector raised anything else (606)
    custom_output_rows: int = 0  # multi-row selections' rows sent
    custom_output_bytes: int = 0  # their bytes
    custom_output_content_filter: int = 0  # sequences a head's should_stop ended
    custom_output_should_stop_errors: int = 0  # should_stop calls that failed (606)
    engine_steps: int = 0  # steps that ran a forward, since start
    engine_steps_ahead: int = 0  # of them launched ahead of their predecessor's sampling
    TYPE = "stats"


@dataclass
class Shutdown:
    """Coordinator -> API: the engine is stopping; answer new requests 503. `stopped`: it
    has stopped, so requests in flight are answered with an error at once."""

    reason: str = ""
    stopped: bool = False
    TYPE = "shutdown"


_MESSAGE_TYPES = {
    cls.TYPE: cls
    for cls in (AddRequest, AbortRequest, DrainRequest, Outputs, EngineStats, Shutdown)
}


def encode(message: Any) -> bytes:
    """msgpack bytes of a message."""
    if isinstance(message, Outputs):
        body = {
            "outputs": [_output_body(o) for o in message.outputs],
            "token_request_ids": message.token_request_ids,
            "new_token_ids": message.new_token_ids,
        }
        if message.row_request_ids:  # (sent only when set)
            body["row_request_ids"] = message.row_request_ids
            body["row_token_ids"] = message.row_token_ids
            body["row_positions"] = message.row_positions
            body["rows"] = message.rows
    else:  # flat messages: their fields as they are (asdict would deep-copy the prompt)
        body = {f.name: getattr(message, f.name) for f in fields(message)}
    body["type"] = message.TYPE
    body["version"] = PROTOCOL_VERSION
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes) -> Any:
    body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if body.pop("version", None) != PROTOCOL_VERSION:
        raise ValueError("wire protocol version mismatch")
    cls = _MESSAGE_TYPES[body.pop("type")]
    if cls is Outputs:
        return Outputs(
            [_request_output(o) for o in body["outputs"]],
            body["token_request_ids"],
            body["new_token_ids"],
            body.get("row_request_ids", []),
            body.get("row_token_ids", []),
            body.get("row_positions", []),
            body.get("rows"),
        )
    return cls(**{f.name: body[f.name] for f in fields(cls) if f.name in body})


def _output_body(out: RequestOutput) -> dict:
    body = dict(out.__dict__)
    if not body["engine_stop_strings"]:
        del body["engine_stop_strings"]
    if body["error_param"] is None:
        del body["error_param"]
    for name in ("custom_output_omitted", "custom_rows", "custom_positions"):
        if body[name] is None:
            del body[name]
    body["sequences"] = [_sequence_body(s) for s in out.sequences]
    return body


def _sequence_body(seq: SequenceOutput) -> dict:
    body = dict(seq.__dict__)
    for name in ("custom_output", "custom_rows", "custom_positions"):
        if body[name] is None:  # absent unless set
            del body[name]
    return body


def _request_output(raw: dict) -> RequestOutput:
    raw["sequences"] = [SequenceOutput(**s) for s in raw["sequences"]]
    return RequestOutput(**raw)
