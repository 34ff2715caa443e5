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
from tapserve.coordinator.row_selection import (  # (LAST_GENERATED re-exported)
    LAST_GENERATED,
    RowSelection,
    SelectionError,
    parse_selection,
)
from tapserve.model.custom_output import (
    ALLOWED_DTYPES,
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
) -> tuple[object, int]:
    """Instantiate the deployment's handler (no arguments), give it its weights, and check it
    with one dry run on a zero row; returns it and the bytes of one of its rows. Raises
    HandlerLoadError with a clear message."""
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
    return handler, dry_run[0].numel() * dry_run.element_size()


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
) -> int | RowSelection:
    """Run the selector with the error rules of DESIGN.md; -1 means no custom output, a
    RowSelection a multi-row one (a list answer)."""
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
    if isinstance(pos, (list, tuple)):
        try:
            selection = parse_selection(list(pos), len(input_ids), max_new_tokens)
        except SelectionError as e:
            raise RequestError(e.code, str(e), "custom_output_params") from None
        return -1 if selection is None else selection
    if not isinstance(pos, (int, np.integer)) or isinstance(pos, bool):
        raise RequestError(
            INVALID_PARAMS,
            f"the selector returned {type(pos).__name__} "
            f"{describe(pos)[:100]}, not an int position or a list of them",
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
    rows_sent: int = 0  # multi-row selections' rows in outputs
    bytes_sent: int = 0
    content_filter: int = 0  # sequences should_stop ended
    should_stop_errors: int = 0  # should_stop calls that failed: 606 for their rows' requests
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

    def should_stop_failed(self, rows: int, error: BaseException) -> None:
        self.should_stop_errors += 1
        message = (
            f"custom output should_stop failed on {rows} rows (606 for their requests): "
            f"{describe_error(error)}"
        )
        self.failures.failed("should_stop", message, error)


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
