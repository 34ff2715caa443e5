"""`pip install .` and `pip install -e .` of a clean clone into a fresh venv, offline: only
`tapserve` lands at the top of site-packages, with its data; the `tapserve` command,
`python -m tapserve`, `--nproc-per-node` ranks and `torchrun -m tapserve` serve from a folder
outside the checkout, the API process and the ranks started from the installed files; a
dotted `--custom-module` resolves from the current directory; and pytest still tests this
checkout while a copy is installed."""

from __future__ import annotations

import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import tapserve
from tests.helpers.api import ROOT, port_from_log, wait_healthy
from tests.helpers.procs import cmdline, descendants, exited

PACKAGES = ("api", "coordinator", "cuda_graphs", "model", "ranks")
ROOT_MODULES = ("__init__.py", "__main__.py", "_checkout.py", "launch.py", "launch_flags.py")
CONSTANT_HEAD = """
import torch

from tapserve.model.custom_output import CustomOutputHandler


class ConstantHead(CustomOutputHandler):
    def forward(self, selected_hidden_states):
        return torch.full((selected_hidden_states.shape[0], 3), 7.0)
"""
CONSTANT_OUTPUT = [[7.0, 7.0, 7.0]]


@dataclass
class Venv:
    root: Path
    site_packages: Path
    outside: Path  # the current directory of every command: no checkout, a `mypkg` package
    sources: frozenset[str]  # the clean clone's files, relative to its root

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    @property
    def command(self) -> str:
        return str(self.root / "bin" / "tapserve")

    @property
    def installed(self) -> Path:
        return self.site_packages / "tapserve"


def clean_clone(dest: Path) -> frozenset[str]:
    """The files a commit of this checkout would hold (tracked, and new ones git does not
    ignore), as they are in the working tree: no build/, no egg-info, no caches."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no clean clone to install")
    names = [n for n in listed.decode().split("\0") if (ROOT / n).is_file()]  # (not deleted)
    for name in names:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    return frozenset(names)


def dependency_view(dest: Path) -> Path:
    """Links to every distribution this interpreter's site-packages hold, but tapserve: the
    venv sees the dependencies and no installed copy of tapserve (CI installs one before
    pytest, and a copy on sys.path would shadow an editable install's finder)."""
    dest.mkdir()
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    for folder in map(Path, [*site.getsitepackages(), *user]):
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            name = entry.name.lower()
            if name == "tapserve" or name.startswith(("tapserve-", "__editable__")):
                continue
            if not (dest / entry.name).exists():  # the first folder on sys.path wins
                (dest / entry.name).symlink_to(entry)
    return dest


def child_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("PYTHONPATH", "TAPSERVE_API_KEY", "PYTHONSAFEPATH"):
        env.pop(name, None)
    return env


def make_venv(base: Path, *, editable: bool) -> Venv:
    """A fresh venv that sees the dependencies (dependency_view) with a clean clone (in
    base/clone) installed by pip with no network, and a folder outside the checkout holding
    the package `mypkg`."""
    clone = base / "clone"
    sources = clean_clone(clone)
    root = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = str(root / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = dependency_view(base / "deps")
    (Path(purelib) / "_dependencies.pth").write_text(
        f"import site; site.addsitedir({str(deps)!r})\n"
    )
    install = [python, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-index"]
    install += ["--no-deps", "--disable-pip-version-check", *(["-e"] if editable else [])]
    subprocess.run([*install, str(clone)], cwd=base, env=child_env(), check=True, timeout=300)
    outside = base / "outside"
    (outside / "mypkg").mkdir(parents=True)
    (outside / "mypkg" / "__init__.py").write_text("")
    (outside / "mypkg" / "head.py").write_text(CONSTANT_HEAD)
    return Venv(root, Path(purelib), outside, sources)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    base = tmp_path_factory.mktemp("install")
    installed = make_venv(base, editable=False)
    shutil.rmtree(base / "clone")  # the installed files alone from here on
    return installed


@contextmanager
def serving(argv: list[str], cwd: Path, timeout: float = 180.0) -> Iterator[str]:
    """Run a serving command (with `--port 0`) until the block ends: SIGTERM, then every
    process it started is gone. Yields the server's URL (its port read from the log, where the
    API process writes it) once /health answers."""
    assert argv[argv.index("--port") + 1] == "0", argv
    handle, name = tempfile.mkstemp(prefix="server-", suffix=".log", dir=cwd)
    log = Path(name)
    with open(handle, "w") as out:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    started: dict[int, list[str]] = {}  # pid -> command line
    try:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{port_from_log(log, proc, timeout)}"
        state = wait_healthy(url, proc, max(deadline - time.monotonic(), 1.0))
        assert state == "healthy", f"{state}:\n{log.read_text()[-4000:]}"
        started.update(command_lines(descendants(proc.pid)))
        yield url
    finally:
        started.update(command_lines(descendants(proc.pid)) if proc.poll() is None else {})
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid, argv in started.items():  # (torchrun's ranks run in sessions of their own)
            if not exited(pid) and command_lines([pid]).get(pid) == argv:  # (not a reused pid)
                os.kill(pid, signal.SIGKILL)


def command_lines(pids: list[int]) -> dict[int, list[str]]:
    out = {}
    for pid in pids:
        try:
            out[pid] = cmdline(pid)
        except OSError:  # gone
            pass
    return out


def complete(url: str) -> dict:
    """One /v1/completions request, checked: 200, and 4 tokens of text."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hello world", "max_tokens": 4, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["text"]
    return answer


def started_from(venv: Venv) -> list[list[str]]:
    """The command lines of the processes under `venv`'s python (serving's children)."""
    found = command_lines(descendants(os.getpid())).values()
    return [argv for argv in found if argv[0] == venv.python]


def started_by_path(venv: Venv, name: str) -> list[str]:
    """The files named `name` that running processes were started from (`python -P FILE`)."""
    return [a[2] for a in started_from(venv) if a[1:2] == ["-P"] and Path(a[2]).name == name]


def api_process_file(venv: Venv) -> str:
    """The file the running API process was started from."""
    files = started_by_path(venv, "server.py")
    assert len(files) == 1, started_from(venv)
    return files[0]


def test_pytest_tests_this_checkout():
    assert Path(tapserve.__file__).resolve() == ROOT / "__init__.py"
    assert tapserve.ROOT == ROOT


def test_only_tapserve_is_installed_with_its_data_files(venv: Venv):
    top = {p.name for p in venv.site_packages.iterdir()} - {"__pycache__", "_dependencies.pth"}
    assert {n for n in top if not n.endswith(".dist-info")} == {"tapserve"}, top
    expected = {n for n in venv.sources if n in ROOT_MODULES or n.split("/")[0] in PACKAGES}
    installed = {
        f.relative_to(venv.installed).as_posix()
        for f in venv.installed.rglob("*")
        if f.is_file() and "__pycache__" not in f.parts
    }
    assert "model/kernels/gemv_configs.json" in installed
    assert expected - installed == set(), "missing from the installed package"
    assert installed - expected == set(), "installed but not part of the package"


def test_pytest_tests_the_checkout_while_a_copy_is_installed(venv: Venv):
    here = Path(__file__).relative_to(ROOT).as_posix()
    env = {**child_env(), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # (plugins take seconds)
    env.pop("PYTEST_ADDOPTS", None)  # (-n 2 there needs a plugin)
    run = subprocess.run(
        [venv.python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{here}::test_pytest_tests_this_checkout"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "1 passed" in run.stdout
    imported = subprocess.run(
        [venv.python, "-c", "import tapserve; print(tapserve.__file__)"],
        cwd=venv.outside, env=child_env(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert imported.stdout.strip() == str(venv.installed / "__init__.py")  # (it was there)


def test_the_command_serves_from_outside_the_checkout(venv: Venv):
    argv = [venv.command, "--device", "cpu", "--port", "0"]
    with serving(argv, venv.outside) as url:
        assert len(complete(url)["choices"][0]["extra_outputs"]["custom_output"]) == 1  # a row
        assert api_process_file(venv) == str(venv.installed / "api" / "server.py")


def test_python_m_tapserve_loads_a_custom_module_from_the_current_directory(venv: Venv):
    argv = [venv.python, "-m", "tapserve", "--device", "cpu", "--prompt", "hello world"]
    argv += ["--max-new-tokens", "2", "--custom-module", "mypkg.head:ConstantHead"]
    run = subprocess.run(
        argv, cwd=venv.outside, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert f"custom_output: {CONSTANT_OUTPUT}" in run.stdout, run.stdout


def test_local_ranks_serve_from_outside_the_checkout(venv: Venv):
    argv = [venv.command, "--device", "cpu", "--port", "0", "--nproc-per-node", "2"]
    with serving([*argv, "--custom-module", "mypkg.head:ConstantHead"], venv.outside) as url:
        assert complete(url)["choices"][0]["extra_outputs"]["custom_output"] == CONSTANT_OUTPUT
        ranks = started_by_path(venv, "launch.py")
        assert ranks == [str(venv.installed / "launch.py")] * 2, started_from(venv)
        assert api_process_file(venv) == str(venv.installed / "api" / "server.py")


def test_torchrun_runs_the_installed_module(venv: Venv):
    argv = [venv.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += ["-m", "tapserve", "--device", "cpu", "--port", "0"]
    with serving(argv, venv.outside) as url:
        complete(url)
        ranks = [a for a in started_from(venv) if a[1:4] == ["-u", "-m", "tapserve"]]
        assert len(ranks) == 2, started_from(venv)
        # the ranks imported the installed package: rank 0 starts its API process from it
        assert api_process_file(venv) == str(venv.installed / "api" / "server.py")


def test_an_editable_install_serves_from_outside_the_checkout(tmp_path):
    venv = make_venv(tmp_path, editable=True)
    top = {p.name for p in venv.site_packages.iterdir()}
    assert not top & {*PACKAGES, "bench", "launch.py", "tapserve"}, top  # a finder, not files
    argv = [venv.command, "--device", "cpu", "--port", "0"]
    with serving(argv, venv.outside) as url:
        complete(url)
        assert api_process_file(venv) == str(tmp_path / "clone" / "api" / "server.py")
