"""The import contract, read from the code's syntax trees (imports inside functions too):
every first-party import is `tapserve.`-qualified (no bare `api`, `model`, ..., no relative
import), the API process's side imports no torch and nothing of the engine's, and the
packages depend on each other only downwards (DESIGN.md's process boundaries)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECKED = ("api", "coordinator", "model", "ranks", "cuda_graphs", "bench", "examples", "tests")
ROOT_MODULES = ("__init__.py", "__main__.py", "_checkout.py", "launch.py", "launch_flags.py")
BARE_FIRST_PARTY = {
    "api",
    "coordinator",
    "model",
    "ranks",
    "cuda_graphs",
    "bench",
    "launch",
    "launch_flags",
}
# what the installed package holds may import nothing that is not installed with it
INSTALLED = ("api", "coordinator", "model", "ranks", "cuda_graphs", *ROOT_MODULES)
NOT_INSTALLED = ("tapserve.bench", "tests", "examples")
ENGINE_SIDE = ("tapserve.coordinator", "tapserve.ranks", "tapserve.model", "tapserve.cuda_graphs")
# (files, the imports they must not make, why)
BOUNDARIES = (
    (
        ("api",),
        (
            *ENGINE_SIDE,
            "tapserve.launch",
            "tapserve.launch_flags",
            "torch",
            "transformers",
            "triton",
        ),
        "the API process loads no torch and no engine code",
    ),
    (("model",), ("tapserve.coordinator", "tapserve.api", "tapserve.ranks"), "model/ is a leaf"),
    (("ranks",), ("tapserve.coordinator", "tapserve.api"), "ranks/ runs below the coordinator"),
    (("cuda_graphs",), ("tapserve.coordinator", "tapserve.api"), "cuda_graphs/ serves ranks/"),
    (INSTALLED, NOT_INSTALLED, "only api, coordinator, model, ranks, cuda_graphs are installed"),
)


@dataclass(frozen=True)
class Import:
    line: int
    modules: tuple[str, ...]  # what the statement may import: `from a.b import c` -> a.b, a.b.c
    relative: bool


def imports(source: str, filename: str = "<source>") -> Iterator[Import]:
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, (alias.name,), False)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            named = tuple(f"{base}.{a.name}" if base else a.name for a in node.names)
            yield Import(node.lineno, (base, *named) if base else named, node.level > 0)


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(relative_path: str, source: str) -> list[str]:
    """`file:line: what` for each import in `source` (the file at `relative_path` from the
    checkout's root) that breaks the contract."""
    top = relative_path.split("/")[0]
    found = []
    for imp in imports(source, relative_path):
        where = f"{relative_path}:{imp.line}"
        if imp.relative:
            found.append(f"{where}: relative import (write its tapserve.-qualified name)")
            continue
        bare = imp.modules[0].split(".")[0]
        if bare in BARE_FIRST_PARTY:
            found.append(f"{where}: bare first-party import {imp.modules[0]!r} (tapserve.{bare})")
        for files, forbidden, why in BOUNDARIES:
            if top in files:
                for module in imp.modules:
                    if within(module, forbidden):
                        found.append(f"{where}: imports {module} ({why})")
                        break
    return found


def checked_files() -> list[Path]:
    files = [ROOT / name for name in ROOT_MODULES]
    for folder in CHECKED:
        files += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if "__pycache__" not in f.parts]


def test_the_checkout_keeps_the_import_contract():
    files = checked_files()
    assert len(files) > 100 and ROOT / "api" / "server.py" in files
    found = [
        v
        for path in files
        for v in violations(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))
    ]
    assert not found, "import contract broken:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "path, source, expected",
    [
        ("api/x.py", "import coordinator.engine", "api/x.py:1: bare first-party import"),
        ("tests/unit/t.py", "def f():\n    from model import demo", "t.py:2: bare first-party"),
        ("bench/b.py", "from launch import main", "bench/b.py:1: bare first-party"),
        ("model/m.py", "from . import layers", "model/m.py:1: relative import"),
        ("api/x.py", "def f():\n    import torch.nn", "api/x.py:2: imports torch.nn"),
        ("api/x.py", "from tapserve import model", "imports tapserve.model (the API process"),
        ("api/x.py", "from tapserve.coordinator.sampler import X", "imports tapserve.coordinator"),
        ("api/x.py", "import transformers", "api/x.py:1: imports transformers"),
        ("model/m.py", "from tapserve.api.wire import X", "imports tapserve.api.wire (model/ is"),
        ("ranks/r.py", "from tapserve.coordinator import engine", "imports tapserve.coordinator"),
        ("cuda_graphs/c.py", "import tapserve.api.wire", "imports tapserve.api.wire (cuda_graphs/"),
        (
            "launch.py",
            "from tapserve.bench.offline import run",
            "imports tapserve.bench.offline (only",
        ),
        (
            "coordinator/c.py",
            "from tests.helpers import x",
            "c.py:1: imports tests.helpers (only api,",
        ),
    ],
)
def test_the_checker_reports_a_violation(path: str, source: str, expected: str):
    found = violations(path, source)
    assert any(expected in v for v in found), found


@pytest.mark.parametrize(
    "path, source",
    [
        ("api/x.py", "import numpy\nfrom tapserve.api.wire import AddRequest\nimport tapserve"),
        ("api/x.py", "from tapserve import checkout_entry\nfrom tapserve.api import wire"),
        ("coordinator/c.py", "import torch\nfrom tapserve.api.sampling_params import S"),
        ("coordinator/c.py", "from tapserve.model.custom_output import CustomOutputHandler"),
        ("cuda_graphs/c.py", "from tapserve.ranks.plan import StepPlan"),
        ("tests/t.py", "from tapserve.coordinator import engine\nfrom tests.helpers import api"),
        ("bench/b.py", "from tapserve import launch\nfrom tests.helpers.procs import rss_kib"),
        ("model/m.py", "import modelling_lib\nfrom apis import x"),  # names that only start so
    ],
)
def test_the_checker_passes_what_the_contract_allows(path: str, source: str):
    assert violations(path, source) == []
