"""bench/serve.py's server: launch.py started on a port of its own (pinned to given cores),
with `--model-config FILE` expanded to a dummy-weight checkpoint and a synthetic tokenizer."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def synthetic_tokenizer(vocab_size: int, folder: Path) -> None:
    """A word-level tokenizer with ids 0..vocab_size-1 ("t0", "t1", ...), nothing special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i} ": i for i in range(vocab_size)}, unk_token="t0 "))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")


def expand_launch(launch: str, workdir: Path) -> list[str]:
    """--model-config FILE -> --model DIR --load-format dummy --tokenizer TOK."""
    argv = shlex.split(launch)
    if "--model-config" in argv:
        i = argv.index("--model-config")
        config_file = Path(argv[i + 1])
        model_dir, tok_dir = workdir / "model", workdir / "tokenizer"
        model_dir.mkdir()
        tok_dir.mkdir()
        shutil.copy(config_file, model_dir / "config.json")
        synthetic_tokenizer(json.loads(config_file.read_text())["vocab_size"], tok_dir)
        argv[i : i + 2] = [
            "--model",
            str(model_dir),
            "--load-format",
            "dummy",
            "--tokenizer",
            str(tok_dir),
        ]
    return argv


def start_server(
    argv: list[str], port: int, cores: set[int] | None = None, timeout: float = 900
) -> subprocess.Popen:
    """launch.py with `argv` on `port` (pinned to `cores` when given), once /health answers."""
    proc = subprocess.Popen(
        [sys.executable, "launch.py", *argv, "--port", str(port)],
        cwd=ROOT,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"launch.py exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("server did not become healthy")
