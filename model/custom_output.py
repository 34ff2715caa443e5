"""The custom output handler contract: loading a deployment's module, its weights, and the
checks its outputs must pass.

A deployment module (`--custom-module path/to/file.py[:Class]` or `package.module:Class`) holds
a class built with no arguments, once, on rank 0 only. It may subclass CustomOutputHandler or
just define the methods (duck typing).
"""

from __future__ import annotations

import abc
import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ALLOWED_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
}


class CustomOutputHandler(abc.ABC):
    """Base class for deployment heads run on the tokens a selector picks per request.
    Subclasses must define forward(); the other methods have working defaults. A head may
    also define `should_stop(outputs, params) -> Tensor`: bool [rows], given forward's output
    for a step's ALL_GENERATED rows and each row's custom_output_params; True ends that
    sequence at that token with finish_reason "content_filter"."""

    NO_OUTPUT = -1
    LAST_GENERATED = -2  # score each sequence's last generated token when it finishes
    ALL_GENERATED = -3  # in a list only: a row for every generated token of each sequence
    # optional: the names of a [rows, width] output's columns (`width` names), or one name
    # for a [rows] output; checked against the dry run, listed in /v1/models
    labels: str | list[str] | tuple[str, ...] | None = None

    def select_token_position(self, input_ids: list[int], params: dict | None) -> int | list[int]:
        """Once per request on rank 0, after tokenization / chat templating. Zero-based index
        into input_ids, -1 for no custom output, or -2 (LAST_GENERATED) for each sequence's
        last generated token; or a list (a multi-row selection): distinct prompt positions
        plus at most one of -2 / -3 (ALL_GENERATED). Raise ValueError for bad params (605).

        Default: `params["position"]` when given (an int or a list of them, else
        ValueError), else the last prompt token. Range checks are the engine's (605)."""
        if params and "position" in params:
            position = params["position"]
            if isinstance(position, list):
                if not all(isinstance(p, int) and not isinstance(p, bool) for p in position):
                    raise ValueError(f"position must be a list of integers, got {position!r}")
                return list(position)
            if not isinstance(position, int) or isinstance(position, bool):
                raise ValueError(f"position must be an integer, got {position!r}")
            return position
        return len(input_ids) - 1

    @abc.abstractmethod
    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] final-normalized, model dtype and device -> [rows] or [rows, width]
        in float32, float16, bfloat16 or int32. Must not perform collectives."""

    def weight_names(self) -> list[str]:
        """Tensors to fetch from the model's safetensors (or <module_stem>.safetensors)."""
        return []

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Receives weight_names() tensors on the model's device in their stored dtype."""


class CustomOutputError(Exception):
    """A handler's output broke the rules, or it raised (606 for the requests involved)."""


class HandlerLoadError(RuntimeError):
    """The deployment module could not be loaded or failed its start-up checks."""


# a request's value travels in every stream chunk and is encoded on the API's event loop:
# 1 MiB (262,144 float32) bounds what one request can cost the others
MAX_ROW_BYTES = 1 << 20


def check_output(out: object, rows: int) -> torch.Tensor:
    """Enforce the output rules; raise CustomOutputError naming the violation."""
    if not isinstance(out, torch.Tensor):
        raise CustomOutputError(f"forward returned {type(out).__name__}, expected a torch.Tensor")
    if out.dtype not in ALLOWED_DTYPES:
        raise CustomOutputError(
            f"dtype {out.dtype} not allowed (float32, float16, bfloat16, int32)"
        )
    if out.dim() not in (1, 2) or out.numel() == 0:
        raise CustomOutputError(
            f"shape {list(out.shape)} must be nonempty [rows] or [rows, width]: "
            f"expected [{rows}] or [{rows}, width]"
        )
    if out.shape[0] != rows:
        raise CustomOutputError(
            f"returned {out.shape[0]} rows for {rows} selected tokens: shape "
            f"{list(out.shape)}, expected [{rows}] or [{rows}, width]"
        )
    row_bytes = out[0].numel() * out.element_size()
    if row_bytes > MAX_ROW_BYTES:
        raise CustomOutputError(
            f"a row of {row_bytes} bytes is over the {MAX_ROW_BYTES} byte "
            f"limit per request ({tuple(out.shape)} {out.dtype})"
        )
    return out


def check_labels(handler: object, out: torch.Tensor) -> str | list[str] | None:
    """The handler's `labels` (None when it declares none) as /v1/models lists them,
    checked against its dry run's output `out`: one name for a [rows] output, one per
    column of a [rows, width] output (distinct). A HandlerLoadError names a mismatch."""
    name = type(handler).__name__
    labels = getattr(handler, "labels", None)
    if labels is None:
        return None
    if out.dim() == 1:
        if not isinstance(labels, str) or not labels:
            raise HandlerLoadError(
                f"custom handler {name}.labels must be one nonempty name (a str) for its "
                f"[rows] output, got {describe(labels)[:200]}"
            )
        return labels
    width = out.shape[1]
    if (
        not isinstance(labels, (list, tuple))
        or not all(isinstance(label, str) and label for label in labels)
        or len(set(labels)) != len(labels)
    ):
        raise HandlerLoadError(
            f"custom handler {name}.labels must be a list of {width} distinct nonempty "
            f"names for its [rows, {width}] output, got {describe(labels)[:200]}"
        )
    if len(labels) != width:
        raise HandlerLoadError(
            f"custom handler {name}.labels names {len(labels)} columns, but its output "
            f"(the dry run's) is [rows, {width}]: {list(labels)}"
        )
    return list(labels)


def describe_error(e: BaseException, with_type: bool = True) -> str:
    """'Type: message' (or the message alone) for an exception a handler raised, even one
    whose str() raises."""
    try:
        return f"{type(e).__name__}: {e}" if with_type else str(e)
    except BaseException:  # noqa: BLE001 - the handler's object, not ours
        return f"{type(e).__name__} (its message could not be formatted)"


def describe(value: object) -> str:
    """repr(value) for a value a handler returned, even one whose repr() raises."""
    try:
        return repr(value)
    except BaseException:  # noqa: BLE001
        return f"<{type(value).__name__} (its repr() raised)>"


@contextmanager
def startup_step(what: str) -> Iterator[None]:
    """Run a start-up call into the deployment's code (import, constructor, weight_names,
    load_weights, the dry run): whatever it raises, SystemExit included, becomes a
    HandlerLoadError "<what>: <Type>: <message>", so the server exits non-zero with the
    message. A KeyboardInterrupt is the operator's Ctrl-C (no signal handler is installed
    yet) and goes on up."""
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise HandlerLoadError(f"{what}: {describe_error(e)}") from e


def names_a_module_file(target: str) -> bool:
    """The module part of a `--custom-module` spec is a file path (`x.py`, `dir/x`), not a
    dotted module name."""
    return target.endswith(".py") or "/" in target


def load_handler_class(spec: str) -> type:
    """`path/to/file.py[:Class]` or `package.module:Class`. Without a class name the module
    must define exactly one handler-looking class."""
    target, _, class_name = spec.partition(":")
    if names_a_module_file(target):
        path = Path(target)
        if not path.is_file():
            raise HandlerLoadError(f"custom module file not found: {path}")
        mod_spec = importlib.util.spec_from_file_location(f"tapserve_custom_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        with startup_step(f"cannot load custom module {path}"):
            mod_spec.loader.exec_module(module)
    else:
        importable_from_cwd()
        with startup_step(f"cannot import custom module {target!r}"):  # ImportError too
            module = importlib.import_module(target)
    if class_name:
        if not hasattr(module, class_name):
            classes = [c.__name__ for c in _own_classes(module)]
            raise HandlerLoadError(
                f"{target} has no class {class_name!r}; the classes it defines: {classes}"
                + _did_you_mean(class_name, classes)
            )
        return getattr(module, class_name)
    found = [c for c in _own_classes(module) if _looks_like_handler(c)]
    if len(found) != 1:
        raise HandlerLoadError(
            f"{target}: name the handler class as {target}:Class "
            f"(found {[c.__name__ for c in found]})"
        )
    return found[0]


def importable_from_cwd() -> None:
    """A dotted `--custom-module` resolves from the current directory under every launcher,
    as under `python -m` (the `tapserve` command and torchrun's ranks start elsewhere)."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def check_handler_spec(spec: str) -> None:
    """A HandlerLoadError when the module of a `--custom-module` spec cannot be found: the
    file does not exist, or its top-level package is not importable. Nothing is imported or
    run (the module is loaded once, on rank 0, after the process group and the model)."""
    target = spec.partition(":")[0]
    if names_a_module_file(target):
        if not Path(target).is_file():
            raise HandlerLoadError(f"custom module file not found: {target}")
        return
    top = target.split(".")[0]  # (finding a submodule would run its packages' __init__)
    importable_from_cwd()
    try:
        found = bool(top) and importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise HandlerLoadError(f"cannot import custom module {target!r}: no module {top!r}")


def _own_classes(module: object) -> list[type]:
    """The classes a module defines (not those it imports), by name."""
    return [
        c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__
    ]


def closest_name(name: str, names: list[str]) -> str | None:
    """The closest of names to name (difflib's), or None."""
    close = difflib.get_close_matches(name, names, n=1)
    return close[0] if close else None


def _did_you_mean(name: str, names: list[str]) -> str:
    close = closest_name(name, names)
    return f" (did you mean {close!r}?)" if close else ""


def _looks_like_handler(cls: type) -> bool:
    return callable(getattr(cls, "select_token_position", None)) and callable(
        getattr(cls, "forward", None)
    )
