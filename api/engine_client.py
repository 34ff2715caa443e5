"""The API process's ZeroMQ client of the rank-0 coordinator.

PUSH to `to_engine`, PULL from `from_engine` in the coordinator's ipc_dir; one reader task
routes each RequestOutput to its request's queue, and sends never block. Every AddRequest is
answered first by an accept or a reject (finished), then by outputs until one is finished.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

import msgpack
import zmq
import zmq.asyncio

from tapserve.api import wire

log = logging.getLogger("tapserve.api")


# what msgpack raises for a value it cannot carry
_UNENCODABLE = (UnicodeEncodeError, RecursionError, OverflowError, ValueError, TypeError)


MAX_PARAMS_NESTING = 100  # custom_output_params: lists and maps this many levels deep at most


def _encode(request: wire.AddRequest) -> bytes:
    """The request's wire bytes; a 605 naming the field that msgpack cannot carry."""
    try:
        if _nesting(request.custom_output_params) > MAX_PARAMS_NESTING:
            raise RecursionError
        return wire.encode(request)
    except _UNENCODABLE as e:
        from tapserve.api.errors import invalid

        param = _unencodable_field(request)
        if isinstance(e, UnicodeEncodeError):  # a lone surrogate in a stop string, say
            why = f"it holds text that is not valid Unicode ({e.reason})"
        elif isinstance(e, RecursionError):
            why = f"{param or 'custom_output_params'} is nested too deeply (over {MAX_PARAMS_NESTING} levels)"
        else:
            why = f"integers, such as custom_output_params values or the seed, must fit in 64 bits: {e}"
        raise invalid(f"request cannot be encoded: {why}", param) from None


def _nesting(value: object) -> int:
    """How many levels of lists and maps value has ({"a": [1]}: 2), counted up to one past
    MAX_PARAMS_NESTING, without recursion."""
    depth, level = 0, [value]
    while depth <= MAX_PARAMS_NESTING:
        level = [v for v in level if isinstance(v, (list, dict))]
        if not level:
            break
        depth += 1
        level = [item for v in level for item in (v.values() if isinstance(v, dict) else v)]
    return depth


def _unencodable_field(request: wire.AddRequest) -> str | None:
    """The first request field that msgpack refuses; None if each packs alone."""
    fields = [
        ("custom_output_params", request.custom_output_params),
        *request.sampling_params.items(),
    ]
    for name, value in fields:
        if name == "custom_output_params" and _nesting(value) > MAX_PARAMS_NESTING:
            return name
        try:
            msgpack.packb(value, use_bin_type=True)
        except _UNENCODABLE:
            return name
    return None


class EngineError(Exception):
    """A request refused or failed by the engine (605 / 606) or the engine gone (503)."""

    def __init__(self, code: int, message: str, param: str | None = None):
        """param: the request field at fault (wire.RequestOutput.error_param)."""
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


ENGINE_DOWN = 503  # EngineError.code when the coordinator stopped answering
CATCH_UP_BACKLOG = 4  # engine messages waiting at once that mean the API is behind


@dataclass(slots=True)
class ColumnToken:
    """A plain decode token from an Outputs message's token columns, queued as it came;
    RequestGroup.batches joins a request's queued ones into one RequestOutput."""

    request_id: str
    token: int
    finished = False


Queued = wire.RequestOutput | ColumnToken


def coalesced(items: list[Queued]) -> list[wire.RequestOutput]:
    """items in order, each run of a request's column tokens one output with those tokens
    (a plain token carries nothing but its id, so k of them read as one k-token output)."""
    outputs: list[wire.RequestOutput] = []
    open_runs: dict[str, list[int]] = {}  # request -> the token list of its run being built
    for item in items:
        if type(item) is ColumnToken:
            run = open_runs.get(item.request_id)
            if run is not None:
                run.append(item.token)
                continue
            seq = wire.SequenceOutput(0, [item.token])
            open_runs[item.request_id] = seq.new_token_ids
            outputs.append(wire.RequestOutput(item.request_id, True, [seq]))
        else:
            open_runs.pop(item.request_id, None)  # (its later tokens come after it)
            outputs.append(item)
    return outputs


@dataclass
class RequestGroup:
    """The engine requests behind one HTTP request (one per prompt), sharing one queue."""

    client: EngineClient
    request_ids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: set[str] = field(default_factory=set)
    engine_stop_strings: set[str] = field(default_factory=set)  # see wire.RequestOutput
    _buffered: list[Queued] = field(default_factory=list)

    async def accepted(self) -> None:
        """Raise EngineError (and abort the others) if any request was rejected."""
        waiting = set(self.request_ids)
        error: EngineError | None = None
        while waiting:
            out = await self._next()
            if type(out) is not ColumnToken and out.request_id in waiting:
                waiting.discard(out.request_id)
                if not out.accepted or out.error_code is not None:
                    self.finished.add(out.request_id)
                    error = error or EngineError(
                        out.error_code or wire.EXECUTION_EXCEPTION,
                        out.error_message or "request rejected",
                        out.error_param,
                    )
                    continue
                if out.engine_stop_strings:
                    self.engine_stop_strings.add(out.request_id)
                if not out.sequences and not out.finished and out.custom_output is None:
                    continue  # the plain accept answer
            self._buffered.append(out)
        if error is not None:
            self.abort()
            raise error

    async def _next(self) -> Queued:
        return self._take(await self.queue.get())

    def _take(self, item: Queued | EngineError) -> Queued:
        if isinstance(item, EngineError):
            raise item
        if item.finished:
            self.finished.add(item.request_id)
        return item

    async def batches(self):
        """Yield lists of outputs, each all that is queued (coalesced), until every request
        is finished."""
        if self._buffered:
            batch, self._buffered = self._buffered, []
            yield coalesced(batch)
        while len(self.finished) < len(self.request_ids):
            batch = [await self._next()]
            while not self.queue.empty() and len(self.finished) < len(self.request_ids):
                batch.append(self._take(self.queue.get_nowait()))
            yield coalesced(batch)

    def engine_stops(self, request_id: str) -> bool:
        """The coordinator detects this request's stop strings (wire.RequestOutput)."""
        return request_id in self.engine_stop_strings

    def abort(self) -> None:
        """Abort every unfinished request of the group (idempotent)."""
        for rid in self.request_ids:
            if rid not in self.finished:
                self.finished.add(rid)
                self.client.abort(rid)
        self.client.release(self)

    def abort_one(self, request_id: str) -> None:
        if request_id not in self.finished:
            self.finished.add(request_id)
            self.client.abort(request_id)


class EngineClient:
    """Connects to the coordinator; one reader task; per-request routing."""

    def __init__(
        self,
        ipc_dir: str,
        on_stats: Callable[[wire.EngineStats], None] = lambda s: None,
        on_stopped: Callable[[], None] = lambda: None,
    ):
        """on_stopped: called once the engine says it has stopped (wire.Shutdown, stopped)."""
        self.ipc_dir = ipc_dir
        self.on_stats, self.on_stopped = on_stats, on_stopped
        self._ctx = zmq.asyncio.Context()
        self._push = zmq.Context.shadow(self._ctx).socket(zmq.PUSH)  # sync: sends never await
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull_now = zmq.Socket.shadow(self._pull)  # sync: reads what waits, never awaits
        self._routes: dict[str, RequestGroup] = {}
        self._prefix = secrets.token_hex(4)
        self._counter = count()
        self._reader: asyncio.Task | None = None
        self.stats = wire.EngineStats()
        self.last_message_time: float | None = None
        self.shutting_down = False
        self.engine_stopped = False  # the engine said it has stopped

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._push.connect(f"ipc://{os.path.join(self.ipc_dir, wire.TO_ENGINE)}")
        self._pull.connect(f"ipc://{os.path.join(self.ipc_dir, wire.FROM_ENGINE)}")
        self._reader = asyncio.create_task(self._read_loop(), name="engine-reader")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        self.fail_all(EngineError(ENGINE_DOWN, "the API server is shutting down"))
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()

    def healthy(self, timeout_s: float) -> bool:
        """The coordinator spoke within `timeout_s` seconds and is not shutting down."""
        return (
            not self.shutting_down
            and self.last_message_time is not None
            and time.monotonic() - self.last_message_time < timeout_s
        )

    @property
    def num_in_flight(self) -> int:
        return len(self._routes)

    # ---- requests ------------------------------------------------------------------------
    def new_request_id(self, kind: str) -> str:
        return f"{kind}-{self._prefix}{next(self._counter):08x}"

    def submit(self, requests: list[wire.AddRequest]) -> RequestGroup:
        """Send the requests (one HTTP request's prompts) and return their group."""
        for r in requests:
            r.arrival_time = r.arrival_time or time.time()
        payloads = [_encode(r) for r in requests]
        group = RequestGroup(self, [r.request_id for r in requests])
        for r in requests:
            self._routes[r.request_id] = group
        for data in payloads:
            self._push.send(data, zmq.NOBLOCK)
        return group

    def request_drain(self, signum: int, signal_time: float) -> None:
        """Ask the coordinator to drain as a signal to rank 0 at signal_time would."""
        self._push.send(wire.encode(wire.DrainRequest(signum, signal_time)), zmq.NOBLOCK)

    def abort(self, request_id: str) -> None:
        if request_id in self._routes:
            self._push.send(wire.encode(wire.AbortRequest(request_id)), zmq.NOBLOCK)
            log.debug("abort %s", request_id)

    def release(self, group: RequestGroup) -> None:
        """Stop routing outputs of the group's requests (after finish or abort)."""
        for rid in group.request_ids:
            if self._routes.get(rid) is group:
                del self._routes[rid]

    def stop_accepting(self, message: str) -> None:
        """Answer every request in flight, and every later one, with a 503 and message."""
        self.shutting_down = True
        self.fail_all(EngineError(ENGINE_DOWN, message))

    def fail_all(self, error: EngineError) -> None:
        for group in {id(g): g for g in self._routes.values()}.values():  # groups are unhashable
            group.queue.put_nowait(error)
        self._routes.clear()

    # ---- reading -------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        """Hand each engine message to the streams alone, letting them run before the next,
        so that each step's token is an SSE event of its own; once CATCH_UP_BACKLOG messages
        wait at once the API is behind, and they go over together (a stream then sends the
        tokens it has in one event)."""
        while True:
            waiting = [await self._pull.recv()]
            waiting += self._waiting_now()
            together = len(waiting) >= CATCH_UP_BACKLOG
            for data in waiting:
                self._handle(data)
                if not together:
                    await asyncio.sleep(0)
            if together:
                await asyncio.sleep(0)

    def _waiting_now(self) -> list[bytes]:
        """The messages that can be read without waiting."""
        waiting = []
        while True:
            try:
                waiting.append(self._pull_now.recv(zmq.NOBLOCK))
            except zmq.Again:
                return waiting

    def _handle(self, data: bytes) -> None:
        try:
            self._dispatch(wire.decode(data))
        except Exception:  # a bad message must not kill the reader
            log.exception("cannot handle a message from the engine")

    def _route(self, out: wire.RequestOutput) -> None:
        group = self._routes.get(out.request_id)
        if group is not None:
            if out.finished:
                del self._routes[out.request_id]
            group.queue.put_nowait(out)

    def _dispatch(self, message: object) -> None:
        self.last_message_time = time.monotonic()
        if isinstance(message, wire.Outputs):
            routes = self._routes
            for out in message.outputs:
                self._route(out)
            for request_id, token in zip(message.token_request_ids, message.new_token_ids):
                group = routes.get(request_id)
                if group is not None:
                    group.queue.put_nowait(ColumnToken(request_id, token))
            if message.row_request_ids:
                for out in message.row_outputs():
                    self._route(out)
        elif isinstance(message, wire.EngineStats):
            self.stats = message
            self.on_stats(message)
        elif isinstance(message, wire.Shutdown):
            log.info("engine shutting down: %s", message.reason)
            self.shutting_down = True
            if message.stopped:  # after a drain nothing waits; after a failure, answer now
                self.fail_all(EngineError(ENGINE_DOWN, f"the engine stopped ({message.reason})"))
                self.engine_stopped = True
                self.on_stopped()
