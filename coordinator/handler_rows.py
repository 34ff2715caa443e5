"""Running the handler on a step's selected rows (one call per step) and bringing its output
to the host: at once, or through pinned buffers without a sync (the run-ahead path)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tapserve.coordinator.custom_outputs import CustomOutputStats
from tapserve.model.custom_output import (
    ALLOWED_DTYPES,
    CustomOutputError,
    check_output,
    describe_error,
)


@dataclass
class HostRows:
    """A step's handler output after its one device-to-host copy: `array` is the numpy
    carrier ([rows] or [rows, width]; bfloat16 travels as its int16 bit pattern). stops: per
    should_stop row, its answer; stop_error: why should_stop failed (606 for those rows)."""

    dtype: str
    array: np.ndarray
    stops: np.ndarray | None = None
    stop_error: str | None = None

    def __len__(self) -> int:
        return self.array.shape[0]

    def row(self, i: int) -> np.ndarray:
        """Row i kept as [1] or [1, width] (a view: copy it before the buffer is reused)."""
        return self.array[i : i + 1]


@dataclass
class DeviceRows:
    """A step's checked handler output still on the device, and should_stop's answers."""

    out: torch.Tensor
    stops: torch.Tensor | None = None
    stop_error: str | None = None

    def packed(self) -> torch.Tensor:
        """out's bytes, then stops' (one tensor: one device-to-host copy for both)."""
        data = self.out.reshape(-1).view(torch.uint8)
        return data if self.stops is None else torch.cat([data, self.stops.view(torch.uint8)])

    def unpack(self, host: torch.Tensor) -> HostRows:
        """HostRows of a host copy of packed()."""
        out, size = self.out, self.out.numel() * self.out.element_size()
        values = host[:size].view(out.dtype).reshape(out.shape)
        raw = values.view(torch.int16) if out.dtype == torch.bfloat16 else values
        stops = None if self.stops is None else host[size:].view(torch.bool).numpy()
        return HostRows(ALLOWED_DTYPES[out.dtype], raw.numpy(), stops, self.stop_error)

    def to_host(self) -> HostRows:
        """The step's one device-to-host copy (synchronous; on the CPU a copy too: rows are
        kept past the handler's next call, which may reuse its output tensor)."""
        packed = self.packed()
        return self.unpack(packed.cpu() if packed.is_cuda else packed.clone())


def launch_handler(
    handler: object,
    hidden_rows: torch.Tensor,
    stats: CustomOutputStats,
    stop_rows: list[int] | None = None,
    stop_params: list[dict | None] | None = None,
) -> DeviceRows:
    """One call for all selected rows of a step, checked, queued on the device. Raises
    CustomOutputError (the caller fails exactly these rows' requests with 606). stop_rows:
    the ALL_GENERATED rows should_stop sees (with their requests' params)."""
    stats.calls += 1
    rows = hidden_rows.shape[0]
    try:
        with torch.inference_mode():  # the hidden states are inference tensors; no autograd
            out = check_output(handler.forward(hidden_rows), rows).detach().contiguous()
    except CustomOutputError as e:
        stats.forward_failed(rows, e)
        raise
    except BaseException as e:  # SystemExit, KeyboardInterrupt too: the handler's, not ours
        stats.forward_failed(rows, e)
        raise CustomOutputError(describe_error(e)) from e
    result = DeviceRows(out)
    should_stop = getattr(handler, "should_stop", None)
    if stop_rows and callable(should_stop):
        try:
            with torch.inference_mode():
                picked = out if len(stop_rows) == rows else out[stop_rows]
                result.stops = _check_stops(should_stop(picked, stop_params), len(stop_rows))
        except BaseException as e:  # noqa: BLE001 - the handler's, not ours
            stats.should_stop_failed(len(stop_rows), e)
            result.stop_error = describe_error(e)
    return result


def run_handler(
    handler: object,
    hidden_rows: torch.Tensor,
    stats: CustomOutputStats,
    stop_rows: list[int] | None = None,
    stop_params: list[dict | None] | None = None,
) -> HostRows:
    """launch_handler, then the step's one device-to-host copy."""
    return launch_handler(handler, hidden_rows, stats, stop_rows, stop_params).to_host()


def _check_stops(flags: object, rows: int) -> torch.Tensor:
    """should_stop's answer, a bool tensor [rows] (else CustomOutputError)."""
    if not isinstance(flags, torch.Tensor) or flags.dtype != torch.bool:
        what = flags.dtype if isinstance(flags, torch.Tensor) else type(flags).__name__
        raise CustomOutputError(f"should_stop returned {what}, expected a bool tensor")
    if tuple(flags.shape) != (rows,):
        raise CustomOutputError(
            f"should_stop returned shape {list(flags.shape)}, expected [{rows}]"
        )
    return flags.detach()


class RowCopies:
    """Device-to-host copies of a step's handler output without a sync, through two pinned
    buffers used in turn (as run_ahead.TokenCopies: one step is in flight at a time); on the
    CPU the rows are already home."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    def start(self, rows: DeviceRows) -> PendingRows:
        if not self.cuda:
            return PendingRows(rows, None, None)
        packed = rows.packed()
        host = self._buffer(packed.numel())[: packed.numel()]
        host.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return PendingRows(rows, host, ready)

    def _buffer(self, size: int) -> torch.Tensor:
        """The next buffer in turn, of at least size bytes (both regrown when short)."""
        if not self._buffers or self._buffers[0].numel() < size:
            size = max(size, 2 * self._buffers[0].numel() if self._buffers else 1 << 16)
            self._buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in "ab"]
        self._turn ^= 1
        return self._buffers[self._turn]


@dataclass
class PendingRows:
    """A step's handler output on its way to the host."""

    rows: DeviceRows
    host: torch.Tensor | None
    ready: torch.cuda.Event | None

    def wait(self) -> HostRows:
        """The rows, copied out of the pinned buffer (which the step after next reuses)."""
        if self.ready is None:
            return self.rows.to_host()
        self.ready.synchronize()
        rows = self.rows.unpack(self.host)
        rows.array = rows.array.copy()
        if rows.stops is not None:
            rows.stops = rows.stops.copy()
        return rows
