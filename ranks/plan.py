"""StepPlan: everything every rank needs to run one step, and its msgpack codec.

Arrays travel as raw bytes (one trailing bin, each array 8-aligned), never as Python lists. A
plan is self-contained: a rank needs nothing from earlier plans but its KV cache. On rank 0 a
plan is used up within its step: its block_tables is a view of the planner's buffer, which the
next build rewrites (copy a plan to keep it; received plans own their arrays).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields

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


@dataclass
class StepPlan:
    kind: StepKind
    input_ids: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # [T]
    positions: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # [T]
    slot_mapping: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # [T]
    query_start_loc: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [B+1]
    context_lens: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # [B]
    block_tables: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # [B, M]
    # rows to sample from, strictly increasing (the runner takes every row unindexed when
    # there are as many as rows)
    logit_rows: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    custom_rows: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # rows for the handler
    block_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))  # (src, dst)
    graph_bucket: int = -1  # CUDA-graph batch bucket, -1 = eager

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start_loc).max()) if self.num_seqs else 0


_ARRAY_FIELDS = [f.name for f in fields(StepPlan) if f.name not in ("kind", "graph_bucket")]
_ALIGN = 8  # each array starts 8-aligned in the data blob, so the receiver's views are aligned
# The message is one msgpack map: {"kind": int, "graph_bucket": int, "arrays": [[dtype, shape],
# ... in _ARRAY_FIELDS order], "data": bin}. "data" comes last so that the sender can write the
# arrays' bytes straight into the broadcast buffer after the packed head.
_HEAD_KEYS = [msgpack.packb(k) for k in ("kind", "graph_bucket", "arrays", "data")]


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class EncodedPlan:
    """A plan laid out for the wire: the packed head (everything up to the data bytes) and
    the arrays that follow it, so the bytes can be written into any buffer without an
    intermediate copy."""

    def __init__(self, plan: StepPlan):
        self.arrays = [np.ascontiguousarray(getattr(plan, name)) for name in _ARRAY_FIELDS]
        layout = [[a.dtype.str, list(a.shape)] for a in self.arrays]
        data_bytes = sum(_padded(a.nbytes) for a in self.arrays)
        kind, bucket, arrays, data = _HEAD_KEYS
        self.head = b"".join((b"\x84", kind, msgpack.packb(int(plan.kind)), bucket,
                              msgpack.packb(plan.graph_bucket), arrays, msgpack.packb(layout),
                              data, b"\xc6", data_bytes.to_bytes(4, "big")))  # bin 32 header
        self.nbytes = len(self.head) + data_bytes

    def write_into(self, out: np.ndarray) -> None:
        """Write the nbytes of the message into out[:nbytes] (a uint8 array)."""
        pos = len(self.head)
        out[:pos] = np.frombuffer(self.head, np.uint8)
        for a in self.arrays:
            out[pos:pos + a.nbytes] = a.reshape(-1).view(np.uint8)
            pos += _padded(a.nbytes)

    def tobytes(self) -> bytes:
        out = np.zeros(self.nbytes, np.uint8)
        self.write_into(out)
        return out.tobytes()


def encode_plan(plan: StepPlan) -> bytes:
    return EncodedPlan(plan).tobytes()


def decode_plan(data: bytes | memoryview) -> StepPlan:
    """The plan in data (any buffer). Its arrays are writable views of one private copy of
    the data bytes. A malformed message (not the map above, a non-numeric or byte-swapped
    dtype, a bad shape, data of the wrong length) is a ValueError."""
    try:
        body = msgpack.unpackb(data, raw=False)
        blob = np.frombuffer(body["data"], np.uint8).copy()
        arrays, pos = {}, 0
        for name, (dtype, shape) in zip(_ARRAY_FIELDS, body["arrays"], strict=True):
            arrays[name] = _view(blob, pos, name, np.dtype(dtype), shape)
            pos += _padded(arrays[name].nbytes)
        if pos != blob.size:
            raise ValueError(f"plan data is {blob.size} bytes, its arrays take {pos}")
        return StepPlan(kind=StepKind(body["kind"]), graph_bucket=int(body["graph_bucket"]), **arrays)
    except (TypeError, KeyError, msgpack.UnpackException) as e:
        raise ValueError(f"malformed step plan: {type(e).__name__}: {e}") from e


def _view(blob: np.ndarray, pos: int, name: str, dt: np.dtype, shape: list) -> np.ndarray:
    if dt.kind not in "biuf" or not dt.isnative:
        raise ValueError(f"plan array {name}: dtype {dt.str} is not a native numeric dtype")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"plan array {name}: bad shape {shape}")
    n = dt.itemsize * math.prod(shape)
    if pos + n > blob.size:
        raise ValueError(f"plan array {name} runs past the data")
    return blob[pos:pos + n].view(dt).reshape(shape)
