"""StepPlan: everything every rank needs to run one step, and its msgpack codec.

A plan is self-contained but for the KV cache. Its arrays may be views of the planner's buffers
(rank 0: valid for its step) or of the channel's receive buffer (valid until the next receive).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields, replace

import msgpack
import numpy as np


class StepKind(enum.IntEnum):
    HEARTBEAT = 0  # no work; keeps collectives alive while idle
    PREFILL = 1
    DECODE = 2
    MIXED = 3
    STOP = 4


def _empty(dtype) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


def block_table_dtype(num_blocks: int) -> np.dtype:
    """Plans' block-table dtype: uint16 while every block id of the pool fits, else int32."""
    return np.dtype(np.uint16 if num_blocks <= 1 << 16 else np.int32)


@dataclass
class StepPlan:
    kind: StepKind
    input_ids: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # [T]
    positions: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # [T]
    slot_mapping: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # [T]
    query_start_loc: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [B+1]
    context_lens: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [B]
    # [B, M] block ids, zero-padded: uint16 where the pool allows (block_table_dtype), else int32
    block_tables: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    # rows to sample from, strictly increasing
    logit_rows: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    custom_rows: np.ndarray = field(
        default_factory=lambda: _empty(np.int64)
    )  # rows for the handler
    block_copies: np.ndarray = field(
        default_factory=lambda: np.zeros((0, 2), np.int64)
    )  # (src, dst)
    graph_bucket: int = -1  # CUDA-graph batch bucket, -1 = eager
    # a step scheduled ahead (coordinator/run_ahead.py): the ids come from rank 0's GPU
    ids_from_rank0: bool = False
    # rank 0 only: the message whose data the arrays are views of (PlanMessage), if any
    wire: PlanMessage | None = field(default=None, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


_HEAD_FIELDS = ("kind", "graph_bucket", "ids_from_rank0")
# the wire's order: the block tables last, so that a laid-out message widens them in place
_ARRAY_FIELDS = [
    f.name for f in fields(StepPlan) if f.name not in (*_HEAD_FIELDS, "wire", "block_tables")
] + ["block_tables"]
_ALIGN = 8  # each array's offset in the data blob
# one msgpack map {kind, graph_bucket, ids_from_rank0, arrays: [[dtype, shape], ...], data: bin},
# "data" last: the sender writes the arrays' bytes straight after the packed head
_HEAD_KEYS = [msgpack.packb(k) for k in (*_HEAD_FIELDS, "arrays", "data")]
TRANSPORT_HEADER_BYTES = 16  # room a PlanMessage leaves before its head (PlanChannel's header)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _int32(value: int) -> bytes:
    """A msgpack int32 whatever the value: a head's length depends on dtypes and ranks only."""
    return b"\xd2" + int(value).to_bytes(4, "big", signed=True)


def _head_fields(plan: StepPlan) -> tuple[int, int, bool]:
    """plan's _HEAD_FIELDS, in order (spelled out: this runs every decode step)."""
    return plan.kind, plan.graph_bucket, plan.ids_from_rank0


def _pack_head(fields: tuple[int, int, bool], arrays: list[np.ndarray]) -> bytes:
    """The message up to (and with the header of) its data bin."""
    kind_key, bucket_key, ids_key, arrays_key, data_key = _HEAD_KEYS
    kind, bucket, ids_from_rank0 = fields
    layout = [
        b"\x92"
        + msgpack.packb(a.dtype.str)
        + bytes([0x90 | a.ndim])
        + b"".join(map(_int32, a.shape))
        for a in arrays
    ]
    data_bytes = sum(_padded(a.nbytes) for a in arrays)
    return b"".join(
        (
            b"\x85",
            kind_key,
            _int32(kind),
            bucket_key,
            _int32(bucket),
            ids_key,
            b"\xc3" if ids_from_rank0 else b"\xc2",
            arrays_key,
            bytes([0x90 | len(arrays)]),
            *layout,
            data_key,
            b"\xc6",
            data_bytes.to_bytes(4, "big"),
        )
    )  # bin 32 header


class EncodedPlan:
    """A plan laid out for the wire: the packed head, then the arrays."""

    def __init__(self, plan: StepPlan):
        self.arrays = [np.ascontiguousarray(getattr(plan, name)) for name in _ARRAY_FIELDS]
        self.head = _pack_head(_head_fields(plan), self.arrays)
        self.nbytes = len(self.head) + sum(_padded(a.nbytes) for a in self.arrays)

    def write_into(self, out: np.ndarray) -> None:
        """Write the nbytes of the message into out[:nbytes] (a uint8 array)."""
        pos = len(self.head)
        out[:pos] = np.frombuffer(self.head, np.uint8)
        for a in self.arrays:
            out[pos : pos + a.nbytes] = a.reshape(-1).view(np.uint8)
            pos += _padded(a.nbytes)

    def tobytes(self) -> bytes:
        out = np.zeros(self.nbytes, np.uint8)
        self.write_into(out)
        return out.tobytes()


class PlanMessage:
    """A plan laid out in its wire message once, its arrays writable views of the message: a plan
    built or advanced in them is sent without encoding once `seal` has written its head."""

    def __init__(self, plan: StepPlan, table_width: int = 0, reuse: np.ndarray | None = None):
        """table_width: the least block-table width (zero-padded). reuse: a buffer no longer
        needed (holding none of plan's arrays), taken if large enough."""
        pad = table_width - plan.block_tables.shape[1]
        if pad > 0:
            plan = replace(plan, block_tables=np.pad(plan.block_tables, ((0, 0), (0, pad))))
        encoded = EncodedPlan(plan)
        self.data_start = _padded(TRANSPORT_HEADER_BYTES + len(encoded.head))
        self.start = self.data_start - len(encoded.head) - TRANSPORT_HEADER_BYTES  # transport's
        self.nbytes = encoded.nbytes  # of the message proper, head and data
        # room for an agreed size up to twice the message, and for widening
        size = 3 * (self.start + TRANSPORT_HEADER_BYTES + self.nbytes) + 16384
        fits = reuse is not None and size <= reuse.size <= 2 * size
        self.buffer = reuse if fits else np.zeros(size, np.uint8)
        encoded.write_into(self.buffer[self.start + TRANSPORT_HEADER_BYTES :])
        self.views, pos = [], self.data_start
        for a in encoded.arrays:
            self.views.append(self._view(pos, a.dtype, a.shape))
            self._tables_at = pos  # the last array's offset
            pos += _padded(a.nbytes)
        self._sealed: tuple[int, int, bool] | None = _head_fields(plan)  # the head's

    def _view(self, pos: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return self.buffer[pos : pos + dtype.itemsize * math.prod(shape)].view(dtype).reshape(shape)

    def plan(
        self, kind: StepKind, graph_bucket: int = -1, ids_from_rank0: bool = False
    ) -> StepPlan:
        """A plan whose arrays are this message's views."""
        return StepPlan(
            kind,
            graph_bucket=graph_bucket,
            ids_from_rank0=ids_from_rank0,
            wire=self,
            **dict(zip(_ARRAY_FIELDS, self.views)),
        )

    def holds(self, plan: StepPlan) -> bool:
        """plan's arrays are still this message's views."""
        return all(getattr(plan, name) is view for name, view in zip(_ARRAY_FIELDS, self.views))

    def widen(self, width: int) -> bool:
        """Widen the block tables to `width` columns in place, the new ones zero (earlier plans
        hold stale views); False when the buffer has no room left."""
        tables = self.views[-1]
        rows, old = tables.shape
        nbytes = self.nbytes + _padded(rows * width * tables.itemsize) - _padded(tables.nbytes)
        # via scratch space: overlapping rows would make numpy copy through a fresh temporary
        scratch = _padded(self.data_start + nbytes)
        if scratch + tables.nbytes > self.buffer.size or 2 * scratch > self.buffer.size:
            return False  # (the room a transport sending a fixed size may need)
        moved = self._view(scratch, tables.dtype, tables.shape)
        moved[...] = tables
        wider = self._view(self._tables_at, tables.dtype, (rows, width))
        wider[:, :old] = moved
        wider[:, old:] = 0
        self.views[-1], self.nbytes, self._sealed = wider, nbytes, None
        return True

    def seal(self, plan: StepPlan) -> None:
        """Write plan's head in front of the data, unless the last seal wrote the same."""
        fields = _head_fields(plan)
        if self._sealed != fields:
            head = _pack_head(fields, self.views)
            self.buffer[self.data_start - len(head) : self.data_start] = np.frombuffer(
                head, np.uint8
            )
            self._sealed = fields


def encode_plan(plan: StepPlan) -> bytes:
    return EncodedPlan(plan).tobytes()


def decode_plan(data: bytes | memoryview | np.ndarray, copy: bool = True) -> StepPlan:
    """The plan in data, its arrays writable views of a private copy (copy=False, a writable
    buffer: of data itself); a ValueError for a malformed message."""
    view = memoryview(data)
    head = _read_head(view)  # the usual message, without msgpack copying its data
    if head is None:
        return _decode_body(_unpack(view), None)
    body, at, n = head
    blob = np.frombuffer(view, np.uint8, count=n, offset=at)
    if copy or not blob.flags.writeable:
        blob = blob.copy()
    return _decode_body(body, blob)


def _unpack(view: memoryview) -> dict:
    try:
        return msgpack.unpackb(view, raw=False)
    except (TypeError, msgpack.UnpackException) as e:
        raise ValueError(f"malformed step plan: {type(e).__name__}: {e}") from e


def _read_head(view: memoryview) -> tuple[dict, int, int] | None:
    """(the map without "data", where the data bytes start, how many) for a map ending in a
    "data" bin whose head fits the first 4 KiB; else None."""
    try:
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(view[:4096])
        body, entries = {}, unpacker.read_map_header()
        for i in range(entries):
            key = unpacker.unpack()
            if type(key) is not str or key in body:
                return None
            if key != "data":
                body[key] = unpacker.unpack()
            elif i != entries - 1:
                return None
            else:
                at = unpacker.tell()
                width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(view[at], 0)
                n = int.from_bytes(view[at + 1 : at + 1 + width], "big")
                if width and at + 1 + width + n == len(view):
                    return body, at + 1 + width, n
        return None
    except Exception:  # noqa: BLE001 (whatever it is, the full unpack reports it)
        return None


def _decode_body(body: dict, blob: np.ndarray | None) -> StepPlan:
    if blob is None:
        try:
            blob = np.frombuffer(body["data"], np.uint8).copy()
        except (TypeError, KeyError) as e:
            raise ValueError(f"malformed step plan: {type(e).__name__}: {e}") from e
    layout = _layout(body)
    _check_size(blob.size, layout)
    return layout.plan(blob)


@dataclass(frozen=True)
class _Layout:
    """A message's head, checked: the plan's scalars and where each array lies in the data."""

    kind: StepKind
    graph_bucket: int
    ids_from_rank0: bool
    arrays: tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]  # name, dtype, shape, offset
    nbytes: int  # of the data

    def plan(self, blob: np.ndarray) -> StepPlan:
        """The plan whose arrays are views of blob (self.nbytes long)."""
        return StepPlan(
            kind=self.kind,
            graph_bucket=self.graph_bucket,
            ids_from_rank0=self.ids_from_rank0,
            **{name: np.ndarray(shape, dt, blob, pos) for name, dt, shape, pos in self.arrays},
        )


def _layout(body: dict) -> _Layout:
    try:
        arrays, pos = [], 0
        for name, (dtype, shape) in zip(_ARRAY_FIELDS, body["arrays"], strict=True):
            dt = np.dtype(dtype)
            if dt.kind not in "biuf" or not dt.isnative:
                raise ValueError(f"plan array {name}: dtype {dt.str} is not a native numeric dtype")
            if not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError(f"plan array {name}: bad shape {shape}")
            arrays.append((name, dt, tuple(shape), pos))
            pos += _padded(dt.itemsize * math.prod(shape))
        if type(body["ids_from_rank0"]) is not bool:
            raise TypeError(f"ids_from_rank0 is {body['ids_from_rank0']!r}, not a bool")
        return _Layout(
            StepKind(body["kind"]),
            int(body["graph_bucket"]),
            body["ids_from_rank0"],
            tuple(arrays),
            pos,
        )
    except (TypeError, KeyError, OverflowError, SyntaxError, msgpack.UnpackException) as e:
        # (numpy's dtype parser raises SyntaxError for some strings, int() OverflowError)
        raise ValueError(f"malformed step plan: {type(e).__name__}: {e}") from e


def _check_size(nbytes: int, layout: _Layout) -> None:
    if nbytes != layout.nbytes:
        past = " (they run past the data)" if layout.nbytes > nbytes else ""
        raise ValueError(f"plan data is {nbytes} bytes, its arrays take {layout.nbytes}{past}")


class PlanDecoder:
    """decode_plan(data, copy=False) for a stream of messages: a head that repeats the last one
    byte for byte (every steady decode step's) reuses its checked parse."""

    def __init__(self) -> None:
        self._head = b""  # the last message's bytes up to its data
        self._layout: _Layout | None = None

    def decode(self, data: np.ndarray) -> StepPlan:
        view, layout, k = memoryview(data), self._layout, len(self._head)
        if layout is None or len(view) != k + layout.nbytes or view[:k] != self._head:
            head = _read_head(view)
            if head is None:
                return decode_plan(data, copy=False)  # (msgpack names what is wrong)
            body, k, n = head
            layout = _layout(body)
            _check_size(n, layout)
            self._head, self._layout = view[:k].tobytes(), layout
        blob = np.frombuffer(view, np.uint8, count=layout.nbytes, offset=k)
        return layout.plan(blob if blob.flags.writeable else blob.copy())
