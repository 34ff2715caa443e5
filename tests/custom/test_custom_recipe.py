"""docs/custom_output.md "Write your own head", run as written: the blocks marked
`<!-- recipe: NAME -->` are written to a fresh folder (NAME is the file's path; `launch` is
the console line that starts the server), the weights script runs there, the server starts
there on the demo model with the page's `--custom-module`, and the client script's printed
lines are checked: three scores a token, `None` for the skip (-1), the 605 for a typo, and
`/custom_output`'s value of token 1 equal to the completion's."""

from __future__ import annotations

import ast
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tests.helpers.api import ROOT, port_from_log, wait_healthy  # noqa: E402

DOC = ROOT / "docs" / "custom_output.md"
PAGE_PORT = "localhost:8000"


def recipe_blocks() -> dict[str, str]:
    """NAME -> the fenced block that follows `<!-- recipe: NAME -->`, in page order."""
    found = re.findall(r"<!-- recipe: (\S+) -->\n```\w+\n(.*?)\n```", DOC.read_text(), re.S)
    return dict(found)


def run_python(folder: Path, source: str, name: str) -> str:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(path)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def launch_argv(block: str) -> list[str]:
    """The page's `$ python launch.py ...` line, as this checkout's launch.py on `--port 0`
    (a port of the kernel's choice, which the API process logs)."""
    (line,) = [x[2:] for x in block.splitlines() if x.startswith("$ ")]
    argv = shlex.split(line)
    assert argv[:2] == ["python", "launch.py"], line
    args = argv[2:]
    args[args.index("--port") + 1] = "0"
    return [sys.executable, str(ROOT / "launch.py"), *args, "--device", "cpu"]


def scores(line: str, label: str) -> list[float]:
    assert line.startswith(label), line
    value = ast.literal_eval(line[len(label) :].strip())
    assert len(value) == 1 and len(value[0]) == 3, line  # one row of three scores
    return value[0]


def test_the_write_your_own_head_recipe_runs_as_written(tmp_path) -> None:
    blocks = recipe_blocks()
    assert list(blocks) == ["write_weights.py", "my_head/my_head.py", "launch", "client.py"]
    run_python(tmp_path, blocks["write_weights.py"], "write_weights.py")
    assert (tmp_path / "my_head" / "my_head.safetensors").is_file()
    (tmp_path / "my_head" / "my_head.py").write_text(blocks["my_head/my_head.py"] + "\n")
    log = open(tmp_path / "server.log", "w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TAPSERVE_API_KEY", None)
    server = subprocess.Popen(
        launch_argv(blocks["launch"]),
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        port = port_from_log(tmp_path / "server.log", server, 180)
        state = wait_healthy(f"http://127.0.0.1:{port}", server, 180)
        assert state == "healthy", (state, (tmp_path / "server.log").read_text()[-3000:])
        client = blocks["client.py"].replace(PAGE_PORT, f"127.0.0.1:{port}")
        assert client != blocks["client.py"]
        lines = run_python(tmp_path, client, "client.py").splitlines()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            code = server.wait(10)
        log.close()
    assert code == 0
    assert len(lines) == 6, lines
    last, token1 = scores(lines[0], "last token:"), scores(lines[1], "token 1:")
    assert last != token1  # two tokens, two values
    assert lines[2] == "skipped: None"  # -1: no output, the field absent
    assert lines[3] == "refused: 400 custom output selection: unknown custom_output_params ['pos']"
    assert lines[4].startswith("scored: 4 ") and lines[5].startswith("scored: 6 ")
    scored = scores(lines[4].replace("scored: 4", "scored:"), "scored:")
    assert scored == pytest.approx(token1, abs=1e-4)  # the same token of the same prompt
    scores(lines[5].replace("scored: 6", "scored:"), "scored:")
