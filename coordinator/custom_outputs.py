"""Rank 0's side of custom outputs: building the handler, selecting positions, and running
the handler once per step on the selected rows (one device-to-host copy per step)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tapserve.api.wire import EXECUTION_EXCEPTION, INVALID_PARAMS
from tapserve.coordinator.handler_failures import FailureLog, log
from tapserve.coordinator.sequence import LAST_GENERATED  # (re-exported: the engine's name for -2)
from tapserve.model.custom_output import (
    ALLOWED_DTYPES,
    CustomOutputError,
    HandlerLoadError,
    check_labels,
    check_output,
    closest_name,
    describe,
    describe_error,
    load_handler_class,
    names_a_module_file,
    startup_step,
)
from tapserve.model.loader import open_safetensors, safetensors_files


class RequestError(Exception):
    """A request is refused or failed: code 605 (INVALID_PARAMS) or 606 (EXECUTION_EXCEPTION)."""

    def __init__(
        self,
        code: int,
        message: str,
        param: str | None = None,
        selector_error: BaseException | None = None,
    ):
        """param: the request field at fault, by the engine's names (max_new_tokens,
        custom_output_params, ...), when one is. selector_error: what the selector raised."""
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.selector_error = selector_error


def build_handler(
    spec: str, model_dir: Path | None, device: torch.device, dtype: torch.dtype, hidden_size: int
) -> object:
    """Instantiate the deployment's handler (no arguments), give it its weights, and check it
    with one dry run on a zero row. Raises HandlerLoadError with a clear message."""
    cls = load_handler_class(spec)
    with startup_step(f"custom handler {cls.__name__}() failed"):
        handler = cls()
    for method in ("select_token_position", "forward"):
        if not callable(getattr(handler, method, None)):
            raise HandlerLoadError(f"custom handler {cls.__name__} has no method {method}()")
    with startup_step(f"custom handler {cls.__name__}.weight_names() failed"):
        returned = getattr(handler, "weight_names", lambda: [])() or []
        # any iterable of names (a list, a tuple, a generator), but not one string
        names = None if isinstance(returned, (str, bytes)) else list(returned)
    if names is None or not all(isinstance(n, str) for n in names):
        raise HandlerLoadError(
            f"custom handler {cls.__name__}.weight_names() must return a list "
            f"of tensor names, got {describe(returned)[:200]}"
        )
    if names:
        if not callable(getattr(handler, "load_weights", None)):
            raise HandlerLoadError(
                f"custom handler {cls.__name__} names weights but has no method load_weights()"
            )
        tensors = _find_tensors(names, model_dir, _weights_beside(spec, cls), device)
        with startup_step(f"custom handler {cls.__name__}.load_weights() failed"):
            handler.load_weights(tensors)
    with startup_step("custom handler dry run failed"), torch.inference_mode():
        zero = torch.zeros(1, hidden_size, dtype=dtype, device=device)
        dry_run = check_output(handler.forward(zero), 1)
    check_labels(handler, dry_run)
    return handler


def _weights_beside(spec: str, cls: type) -> list[Path]:
    """Where <module_stem>.safetensors may be: beside the spec's module file, then beside the
    file that defines the class (package.module:Class specs); the first that exists counts."""
    paths: list[Path] = []
    target = spec.partition(":")[0]
    if names_a_module_file(target):
        paths.append(Path(target).with_suffix(".safetensors"))
    try:
        paths.append(Path(inspect.getfile(cls)).with_suffix(".safetensors"))
    except (TypeError, OSError):
        pass
    unique = {p.resolve(): p for p in reversed(paths)}  # (the spec's spelling first)
    return list(reversed(unique.values()))


def _find_tensors(
    names: list[str], model_dir: Path | None, beside: list[Path], device: torch.device
) -> dict[str, torch.Tensor]:
    extra = next((p for p in beside if p.is_file()), None)
    files = (safetensors_files(model_dir) if model_dir else []) + ([extra] if extra else [])
    found: dict[str, torch.Tensor] = {}
    held: dict[Path, list[str]] = {}
    for path in files:
        with open_safetensors(path) as f:
            held[path] = list(f.keys())
            for name in set(names) & set(held[path]) - set(found):
                found[name] = f.get_tensor(name).to(device)
    missing = [n for n in names if n not in found]
    if missing:
        raise HandlerLoadError(_missing_weights_message(missing, held, beside, extra))
    return found


MAX_LISTED_TENSORS = 30


def _missing_weights_message(
    missing: list[str], held: dict[Path, list[str]], beside: list[Path], extra: Path | None
) -> str:
    """The missing names, each file searched with its tensor names, the <module_stem>
    paths tried, and each missing name's closest held name."""
    lines = [f"custom handler weights not found: {missing}"]
    for path, keys in held.items():
        shown = sorted(keys)[:MAX_LISTED_TENSORS]
        more = f" and {len(keys) - len(shown)} more" if len(keys) > len(shown) else ""
        lines.append(f"  searched {path} ({len(keys)} tensors): {shown}{more}")
    for path in beside:  # (the first that exists is the one searched)
        if path == extra:
            break
        lines.append(f"  searched {path} (<module_stem>.safetensors): no such file")
    if not beside:
        lines.append("  no <module_stem>.safetensors: the handler class has no source file")
    every = sorted({k for keys in held.values() for k in keys})
    for name in missing:
        close = closest_name(name, every)
        lines.append(
            f"  closest to {name!r}: {close!r}" if close else f"  nothing close to {name!r}"
        )
    return "\n".join(lines)


def select_position(
    handler: object | None, input_ids: list[int], params: dict | None, max_new_tokens: int
) -> int:
    """Run the selector with the error rules of DESIGN.md; -1 means no custom output."""
    if handler is None:
        if params is not None:
            raise RequestError(
                INVALID_PARAMS,
                "custom_output_params given but no custom output module is loaded",
                "custom_output_params",
            )
        if max_new_tokens == 0:
            raise RequestError(
                INVALID_PARAMS,
                "a scoring-only request (0 tokens to generate) needs a custom output module",
                "max_new_tokens",
            )
        return -1
    if params is not None and not isinstance(params, dict):
        raise RequestError(
            INVALID_PARAMS,
            f"custom_output_params must be a JSON object, got {type(params).__name__}",
            "custom_output_params",
        )
    try:
        pos = handler.select_token_position(list(input_ids), params)
    except ValueError as e:
        raise RequestError(
            INVALID_PARAMS,
            f"custom output selection: {describe_error(e, with_type=False)}",
            "custom_output_params",
            selector_error=e,
        ) from None
    except BaseException as e:  # SystemExit, KeyboardInterrupt too: the handler's, not ours
        raise RequestError(
            EXECUTION_EXCEPTION,
            f"custom output selection failed: {describe_error(e)}",
            selector_error=e,
        ) from None
    if not isinstance(pos, (int, np.integer)) or isinstance(pos, bool):
        raise RequestError(
            INVALID_PARAMS,
            f"the selector returned {type(pos).__name__} "
            f"{describe(pos)[:100]}, not an int position",
            "custom_output_params",
        )
    if not (-1 <= pos < len(input_ids) or pos == LAST_GENERATED):
        raise RequestError(
            INVALID_PARAMS,
            f"selected position {int(pos)} is outside "
            f"[-1, {len(input_ids)}) (or -2, LAST_GENERATED)",
            "custom_output_params",
        )
    if pos == LAST_GENERATED and max_new_tokens == 0:
        raise RequestError(
            INVALID_PARAMS,
            "a scoring-only request (0 tokens to generate) "
            "has no generated token for LAST_GENERATED (-2) to "
            "score",
            "max_new_tokens",
        )
    if pos == -1 and max_new_tokens == 0:
        raise RequestError(
            INVALID_PARAMS,
            "a scoring-only request (0 tokens to generate) but the selector chose no token",
            "max_new_tokens",
        )
    return int(pos)


@dataclass
class CustomOutputStats:
    """Handler counters (wire.EngineStats, /metrics) and the failures' log."""

    calls: int = 0  # forward() calls
    errors: int = 0  # forward() calls that failed: 606 for every request with rows in them
    selector_invalid: int = 0  # requests whose selector raised ValueError: 605
    selector_errors: int = 0  # requests whose selector raised anything else: 606
    failures: FailureLog = field(default_factory=FailureLog)

    def selector_failed(self, request_id: str, e: RequestError) -> None:
        """A request refused because its selector raised: counted; a 606 logged with the
        selector's traceback (rate-limited), a 605 at debug level."""
        if e.code == INVALID_PARAMS:
            self.selector_invalid += 1
            log.debug("request %s: 605 from the custom output selector: %s", request_id, e.message)
            return
        self.selector_errors += 1
        message = f"request {request_id}: 606 {e.message}"
        self.failures.failed("selector", message, e.selector_error or e)

    def forward_failed(self, rows: int, error: BaseException) -> None:
        self.errors += 1
        message = (
            f"custom output processor failed on {rows} rows (606 for their requests): "
            f"{describe_error(error)}"
        )
        self.failures.failed("forward", message, error)


@dataclass
class HostRows:
    """A step's handler output after its one device-to-host copy: `array` is the numpy
    carrier ([rows] or [rows, width]; bfloat16 travels as its int16 bit pattern)."""

    dtype: str
    array: np.ndarray

    def __len__(self) -> int:
        return self.array.shape[0]

    def row(self, i: int) -> np.ndarray:
        """Row i kept as [1] or [1, width] (a view: copy it before the buffer is reused)."""
        return self.array[i : i + 1]


def run_handler(handler: object, hidden_rows: torch.Tensor, stats: CustomOutputStats) -> HostRows:
    """One call for all selected rows of a step, checked, then the step's one device-to-host
    copy. Raises CustomOutputError (the caller fails exactly these rows' requests with 606)."""
    stats.calls += 1
    rows = hidden_rows.shape[0]
    try:
        with torch.inference_mode():  # the hidden states are inference tensors; no autograd
            out = check_output(handler.forward(hidden_rows), rows)
            host = out.detach().contiguous().cpu()  # the step's one device-to-host copy
    except CustomOutputError as e:
        stats.forward_failed(rows, e)
        raise
    except BaseException as e:  # SystemExit, KeyboardInterrupt too: the handler's, not ours
        stats.forward_failed(rows, e)
        raise CustomOutputError(describe_error(e)) from e
    raw = host.view(torch.int16) if host.dtype == torch.bfloat16 else host
    return HostRows(ALLOWED_DTYPES[host.dtype], raw.numpy())


def encode_row(row: np.ndarray, dtype: str) -> dict:
    """One request's row ([1] or [1, width] numpy carrier) -> wire value {dtype, shape, data}
    (raw little-endian bytes)."""
    return {
        "dtype": dtype,
        "shape": list(row.shape),
        "data": row.astype(row.dtype.newbyteorder("<"), copy=False).tobytes(),
    }


def decode_value(value: dict) -> torch.Tensor:
    """Wire value -> tensor (tests and offline users)."""
    dtype = {v: k for k, v in ALLOWED_DTYPES.items()}[value["dtype"]]
    carrier = torch.int16 if dtype == torch.bfloat16 else dtype
    t = torch.frombuffer(bytearray(value["data"]), dtype=carrier).reshape(value["shape"])
    return t.view(dtype) if dtype == torch.bfloat16 else t
