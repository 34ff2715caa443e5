"""Output dispatch on rank 0 (`--output-workers N`): per-request output work runs inline
(N = 0) or on N single-thread shards keyed by request id, so one request's tasks run in queue
order whatever N is (docs/custom_output.md).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

MAX_WORKERS = 64  # threads encoding rows: more than a host's cores buys nothing


def check_workers(workers: int) -> None:
    """ValueError unless 0 <= workers <= MAX_WORKERS (each worker starts a thread pool)."""
    if not 0 <= workers <= MAX_WORKERS:
        raise ValueError(f"output_workers must be in [0, {MAX_WORKERS}], got {workers}")


class OutputDispatcher:
    def __init__(self, workers: int = 0):
        check_workers(workers)
        self.workers = workers
        self._shards = [
            ThreadPoolExecutor(1, thread_name_prefix=f"tapserve-output-{i}") for i in range(workers)
        ]

    def shard_of(self, key: str) -> int:
        """Stable shard of a request id (same shard for every task of that request)."""
        return zlib.crc32(key.encode("utf-8")) % self.workers if self.workers else 0

    def submit(self, key: str, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) for request `key`, inline or on its shard, with array arguments
        copied now; the Future holds the result or the exception."""
        args = tuple(np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in args)
        if not self._shards:
            future: Future = Future()
            try:
                future.set_result(fn(*args))
            except Exception as e:  # delivered through the future, as with a pool
                future.set_exception(e)
            return future
        return self._shards[self.shard_of(key)].submit(fn, *args)

    def close(self, wait: bool = True) -> None:
        for shard in self._shards:
            shard.shutdown(wait=wait)
        self._shards = []
        self.workers = 0

    def __enter__(self) -> OutputDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
