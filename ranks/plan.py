"""StepPlan: everything every rank needs to run one step, and its msgpack codec.

Arrays travel as raw bytes (dtype, shape, buffer), never as Python lists. A plan is
self-contained: a rank needs nothing from earlier plans but its KV cache.
"""
from __future__ import annotations

import enum
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
    logit_rows: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # rows to sample from
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


def encode_plan(plan: StepPlan) -> bytes:
    body: dict = {"kind": int(plan.kind), "graph_bucket": plan.graph_bucket}
    for name in _ARRAY_FIELDS:
        a = np.ascontiguousarray(getattr(plan, name))
        body[name] = (a.dtype.str, a.shape, a.tobytes())
    return msgpack.packb(body, use_bin_type=True)


def decode_plan(data: bytes | memoryview) -> StepPlan:
    body = msgpack.unpackb(data, raw=False)
    arrays = {name: np.frombuffer(buf, dtype=np.dtype(dt)).reshape(shape).copy()
              for name, (dt, shape, buf) in ((n, body[n]) for n in _ARRAY_FIELDS)}
    return StepPlan(kind=StepKind(body["kind"]), graph_bucket=body["graph_bucket"], **arrays)
