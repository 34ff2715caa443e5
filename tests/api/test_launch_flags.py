"""Launcher flags outside testers misused (15th and 2026-12-01s): each is refused at start-up
with a clear message, before any rank or model loads (a --max-model-len the KV cache cannot
hold: once the cache is sized); and the single-node launcher's ranks run one OpenMP thread
each, as torchrun's do."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tapserve.api.tokenizer import chat_template_text
from tapserve.ranks.local_group import run_local_group

REPO = Path(__file__).resolve().parents[2]


def _launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "launch.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_a_leading_tilde_is_expanded_in_every_path_flag(tmp_path, monkeypatch):
    """A reviewer found `--generation-config=~/gc` made into <cwd>/~/gc (the shell expands
    only a ~ that starts a word); an inline template starting with ~ stays as it is."""
    from tapserve.launch import parse_args

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "gc").mkdir()
    (tmp_path / "h.py").write_text("")
    (tmp_path / "t.jinja").write_text("{{ 1 }}")
    args = parse_args(
        [
            "--model=~/m",
            "--tokenizer=~/tok",
            "--generation-config=~/gc",
            "--custom-module=~/h.py:Head",
            "--chat-template=~/t.jinja",
        ]
    )
    assert (
        args.model,
        args.tokenizer,
        args.generation_config,
        args.custom_module,
        args.chat_template,
    ) == (
        f"{tmp_path}/m",
        f"{tmp_path}/tok",
        f"{tmp_path}/gc",
        f"{tmp_path}/h.py:Head",
        f"{tmp_path}/t.jinja",
    )
    assert parse_args(["--chat-template=~{{ 1 }}"]).chat_template == "~{{ 1 }}"


def test_chat_template_is_a_file_or_a_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert chat_template_text(str(path)) == path.read_text()
    assert chat_template_text("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        chat_template_text(str(tmp_path / "missing.jinja"))
    # a real template inline: a part between slashes over 255 bytes (is_file raised OSError)
    long = "{% for m in messages %}" + "{{ m['content'] }}" * 30 + "</s>{% endfor %}"
    assert chat_template_text(long) == long


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["--chat-template", "/nonexistent/t.jinja"], None, "neither a file nor a Jinja template"),
        (["--nproc-per-node", "0"], None, "--nproc-per-node needs a value >= 1"),
        (["--nproc-per-node", "2"], {"RANK": "0"}, "not under torchrun"),
        (["--generation-config", "/nonexistent"], None, "auto, vllm, or a folder"),
        (["--max-model-len", "100000"], None, "exceeds the model's max_position_embeddings"),
        (["--max-model-len", "64", "--num-kv-blocks", "1"], None, "does not fit the KV cache"),
        (["--prompt", "hi", "--tp", "2"], None, "--prompt runs one process"),
        (["--prompt", "hi"], {"WORLD_SIZE": "2"}, "--prompt runs one process"),
        (["--prompt", "hi", "--max-model-len", "100000"], None, "exceeds the model's max_position"),
        (["--kv-cache-memory", "inf"], None, "kv_cache_memory must be a positive number"),
        (["--kv-cache-memory", "nan"], None, "kv_cache_memory must be a positive number"),
        (["--device", "foo"], None, "device must be cpu, cuda or cuda:N"),
        (["--port", "70000"], None, "--port must be in [0, 65535]"),
        # found by an outside tester of 2026-12-01 (advice to start 0 ranks; auto unnamed)
        (["--tp", "0"], None, "--tp must be at least 1"),
        ([], {"TAPSERVE_API_KEY": "\udcff\udcfe"}, "is not valid UTF-8"),  # bytes ff fe
        (["--dtype", "foo"], None, "choose from ['auto', "),
        (["--shutdown-timeout", "-1"], None, "--shutdown-timeout must be >= 0"),
        # found by an outside tester (tracebacks after the model loaded)
        (["--num-kv-blocks", "0"], None, "num_kv_blocks must be >= 1"),
        (["--max-num-seqs", "0"], None, "max_num_seqs must be >= 1"),
        (["--max-num-batched-tokens", "0"], None, "max_num_batched_tokens must be >= 1"),
        (["--block-size", "0"], None, "block_size must be one of 8, 16, 32, 64, 128"),
        # found by a reviewer of 2026-12-06 (after the ranks had started, or a traceback)
        (["--block-size", "17"], None, "block_size must be one of 8, 16, 32, 64, 128"),
        (
            ["--prompt", "hi"],
            {"TAPSERVE_GEMV_MAX_ROWS": "one"},
            "TAPSERVE_GEMV_MAX_ROWS must be an integer",
        ),
        (["--max-queued-requests", "-1"], None, "--max-queued-requests must be >= 0"),
        # found by an outside tester of 2026-12-01 (tracebacks, or errors only after loading)
        (["--seed", str(2**70)], None, "seed must fit in 64 bits"),
        (["--api-key="], None, "is empty"),
        (["--api-key", "   "], None, "is empty"),
        ([], {"TAPSERVE_API_KEY": ""}, "$TAPSERVE_API_KEY) is empty"),
        (
            ["--chat-template", "{% for m in messages %}{{ m }}"],
            None,
            "--chat-template does not compile",
        ),
        (
            ["--custom-module", "nosuchpkg.mod:H"],
            None,
            "cannot import custom module 'nosuchpkg.mod'",
        ),
        (["--model", "/nonexistent"], None, "model folder not found: /nonexistent"),
        # found by an outside tester of 2026-12-06 (the allocator's traceback; a million
        # thread pools built before start-up went on)
        (["--output-workers", "1000000"], None, "output_workers must be in [0, 64]"),
        (
            ["--kv-cache-memory", "100000", "--max-num-seqs", "100000"],
            None,
            "does not fit the host's available memory",
        ),
    ],
)
def test_misused_flags_fail_at_once(args, env, message):
    proc = _launch(*args, env=env)
    assert proc.returncode != 0 and message in proc.stderr, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_broken_checkpoints_and_modules_are_one_line_errors(tmp_path):
    """A corrupt or incomplete checkpoint, tokenizer or custom module ends the start-up with
    one line naming the file (they were tracebacks, some only after the model loaded; a
    corrupt JSON or safetensors file named no file)."""
    import json
    import shutil

    from tests.helpers.checkpoints import make_tiny_checkpoint

    good = make_tiny_checkpoint(tmp_path / "good", "qwen3", tokenizer=True)

    def variant(name: str, change) -> str:
        shutil.copytree(good, tmp_path / name)
        change(tmp_path / name)
        return str(tmp_path / name)

    def retype(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "two"}))

    (tmp_path / "two.py").write_text(
        "class A:\n    def select_token_position(self, i, p): return -1\n"
        "    def forward(self, h): return h\nclass B(A): pass\n"
    )
    cases = [
        (
            ["--model", variant("json", lambda f: (f / "config.json").write_text('{"a": '))],
            "config.json: not valid JSON",
        ),
        (["--model", variant("type", retype)], "num_hidden_layers must be an integer, got 'two'"),
        (
            [
                "--model",
                variant("st", lambda f: (f / "model.safetensors").write_bytes(b"\x07" * 99)),
            ],
            "model.safetensors: not a readable safetensors file",
        ),
        (
            ["--model", variant("tok", lambda f: (f / "tokenizer.json").write_text('{"a":'))],
            "cannot be loaded (tokenizer.json, tokenizer_config.json)",
        ),
        (
            [
                "--model",
                variant(
                    "index",
                    lambda f: (f / "model.safetensors.index.json").write_text(
                        json.dumps({"weight_map": {"x": "gone.safetensors"}})
                    ),
                ),
            ],
            "names shards that are not there",
        ),
        (["--custom-module", str(tmp_path / "two.py")], "name the handler class"),
    ]
    for args, message in cases:
        proc = _launch(*args, "--device", "cpu")
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, (args, proc.stderr[-2000:])


def test_errors_every_rank_finds_alike_print_once_under_both_launchers(tmp_path):
    """Under torchrun and `--nproc-per-node 2`, a start-up error from the flags or the node's
    files prints once (local rank 0's), with no traceback; an outside tester found (2026-12-06)
    the argparse, chat-template and generation-config errors, and those of reading the
    weights, printed by every rank (and two ranks' lines run together)."""
    import json
    import shutil

    from tests.helpers.checkpoints import make_tiny_checkpoint

    good = make_tiny_checkpoint(tmp_path / "good", "qwen3", tokenizer=True)

    def variant(name: str, change) -> str:
        shutil.copytree(good, tmp_path / name)
        change(tmp_path / name)
        return str(tmp_path / name)

    def drop_tensor(folder):  # a checkpoint missing one layer tensor
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
        save_file({n: t for n, t in tensors.items() if n != name}, folder / "model.safetensors")

    def bad_template(folder):  # the checkpoint's own chat template does not compile
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": "{% for %}"})
        )
        (folder / "chat_template.jinja").unlink(missing_ok=True)

    cases = [
        (["--max-num-seqs", "abc"], "argument --max-num-seqs: invalid int value"),
        (["--chat-template", "{% for %}"], "--chat-template does not compile"),
        (["--generation-config", str(tmp_path / "none")], "auto, vllm, or a folder"),
        (
            [
                "--model",
                variant("gen", lambda f: (f / "generation_config.json").write_text('{"a":')),
            ],
            "generation_config.json",
        ),
        (["--model", variant("weights", drop_tensor)], "down_proj"),
        (
            [
                "--model",
                variant(
                    "dir",
                    lambda f: (
                        (f / "model.safetensors").unlink(),
                        (f / "model.safetensors").mkdir(),
                    ),
                ),
            ],
            "model.safetensors: not a readable safetensors file",
        ),
        (["--model", variant("template", bad_template)], "does not compile"),
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    for launcher in (torchrun, [sys.executable]):
        for args, message in cases:
            extra = [] if launcher is torchrun else ["--nproc-per-node", "2"]
            proc = subprocess.run(
                [*launcher, "launch.py", *extra, "--device", "cpu", "--port", "0", *args],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            # (torchrun adds its own failure report, with the failing rank's exit status)
            ours = proc.stderr.split("Traceback")[0] if launcher is torchrun else proc.stderr
            assert proc.returncode != 0 and ours.count(message) == 1, (args, proc.stderr[-3000:])
            if launcher is not torchrun:
                assert "Traceback" not in proc.stderr, (args, proc.stderr[-2000:])


def test_local_ranks_run_one_openmp_thread(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, pathlib, sys\n"
        "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text("
        "os.environ.get('OMP_NUM_THREADS', 'unset'))\n"
    )
    assert run_local_group(2, [str(script), str(tmp_path)]) == 0
    assert [(tmp_path / r).read_text() for r in ("0", "1")] == ["1", "1"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a user's own setting stands
    assert run_local_group(2, [str(script), str(tmp_path)]) == 0
    assert [(tmp_path / r).read_text() for r in ("0", "1")] == ["3", "3"]


def test_a_rank_ended_by_a_signal_gives_the_shells_status():
    """The local launcher returned a signalled rank's negative status, which sys.exit turned
    into 256 - N (241 for a SIGTERM during start-up; an outside tester): now 128 + N. And a
    later rank's failure is seen while an earlier one runs (any() polled only the first)."""
    import signal

    from tapserve.ranks.local_group import _wait

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    victim.send_signal(signal.SIGTERM)
    start = time.monotonic()
    assert _wait([sleeper, victim], grace_s=5) == 128 + signal.SIGTERM
    assert sleeper.poll() is not None and time.monotonic() - start < 10  # stopped, not awaited
    # the first failure's status, not that of a rank the launcher then stopped
    stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 30"])
    failing = subprocess.Popen(["bash", "-c", "sleep 0.3; exit 3"])
    assert _wait([stubborn, failing], grace_s=1) == 3


def test_the_early_custom_module_check_imports_nothing(tmp_path, monkeypatch):
    """Rank 0 checks --custom-module before the model loads, without running it: the module
    is imported once, later, with the process group up (the early check imported it: a file
    module ran twice, and one reading the process group at import was refused)."""
    from tapserve.model.custom_output import (
        HandlerLoadError,
        check_handler_spec,
        load_handler_class,
    )

    module = tmp_path / "loud.py"
    module.write_text("raise RuntimeError('imported')\n")
    check_handler_spec(f"{module}:Head")  # found; not run
    check_handler_spec("json:JSONDecoder")
    with pytest.raises(HandlerLoadError, match="imported"):
        load_handler_class(f"{module}:Head")
    for missing in (str(tmp_path / "gone.py"), "nosuchpkg.mod:H"):
        with pytest.raises(HandlerLoadError):
            check_handler_spec(missing)
    package = tmp_path / "loudpkg"  # a package's __init__ does not run either
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_handler_spec("loudpkg.mod:Head")


def test_relative_paths_are_read_from_where_the_launch_ran(tmp_path):
    """--model and --chat-template relative to the caller's folder (an outside tester: the
    API process, which runs in the repository's folder, could not find them, and the server
    died after the model had loaded)."""
    import signal

    import httpx

    from tests.helpers.api import port_from_log, wait_healthy
    from tests.helpers.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=True)
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "launch.py"),
                "--model",
                "ckpt",
                "--chat-template",
                "t.jinja",
                "--custom-module",
                "none",
                "--device",
                "cpu",
                "--port",
                "0",  # (a port picked here could be taken before the server binds it)
            ],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    try:
        url = f"http://127.0.0.1:{port_from_log(log, proc, 120)}"
        assert wait_healthy(url, proc, 120) == "healthy"
        r = httpx.post(
            url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60
        )
        assert r.status_code == 200 and "".join(r.json()["token_strs"]) == "hi|"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0, log.read_text()[-2000:]


def test_a_layout_every_rank_refuses_is_reported_once(tmp_path):
    """A model or --tp the ranks cannot split is found by every rank alike: rank 0 alone
    prints it (each rank printed the same line), and the hint fits both launchers."""
    from tests.helpers.checkpoints import make_tiny_checkpoint

    odd = make_tiny_checkpoint(
        tmp_path / "odd",
        "qwen3",
        tokenizer=True,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=16,
    )
    kv = make_tiny_checkpoint(
        tmp_path / "kv",
        "qwen3",
        tokenizer=True,  # 2 KV heads at 3 ranks
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
    )
    cases = [
        ("2", ["--model", str(odd)], "num_attention_heads (3) is not divisible"),
        (
            "3",
            ["--model", str(kv)],
            "tensor-parallel size 3 is not a multiple of num_key_value_heads (2)",
        ),
        # every error the ranks find alike, before loading or once they agreed on the
        # KV cache (an outside tester of 2026-12-06: each printed twice)
        ("2", ["--block-size", "7"], "block_size must be one of"),
        ("2", ["--dtype", "float8"], "unknown dtype 'float8'"),
        ("2", ["--model", str(tmp_path / "gone")], "model folder not found"),
        ("2", ["--num-kv-blocks", "4", "--max-model-len", "100"], "does not fit the KV cache"),
        ("2", ["--num-kv-blocks", str(10**11)], "does not fit the host's available memory"),
        ("2", ["--tp", "1"], "--tp 1 does not match the number of ranks started (2)"),
    ]
    for ranks, args, message in cases:
        proc = _launch("--nproc-per-node", ranks, "--device", "cpu", "--port", "0", *args)
        assert proc.returncode != 0 and proc.stderr.count(message) == 1, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "launch.py --nproc-per-node 1" in proc.stderr
    # rank 1 alone allocates by max_num_seqs (the allocator's traceback before): its one line;
    # rank 0, which may have started serving by then, then ends as for any lost rank
    proc = _launch(
        "--nproc-per-node", "2", "--device", "cpu", "--port", "0", "--max-num-seqs", str(10**10)
    )
    message = "start-up ran out of memory on cpu"
    assert proc.returncode != 0 and proc.stderr.count(message) == 1, proc.stderr[-2000:]
    assert "alloc_cpu.cpp" not in proc.stderr, proc.stderr[-2000:]


def test_port_0_logs_the_port_the_server_got(tmp_path):
    """--port 0 takes a port of the kernel's choice, and the API process's log names it (an
    outside tester: the log said http://127.0.0.1:0); an IPv6 host is written in brackets."""
    import signal

    from tapserve.api.config import http_url
    from tests.helpers.api import port_from_log, wait_healthy

    assert http_url("::1", 8000) == "http://[::1]:8000"
    assert http_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    log = tmp_path / "server.log"
    with open(log, "w") as out:  # (the API process logs to the same stream)
        proc = subprocess.Popen(
            [sys.executable, "launch.py", "--device", "cpu", "--port", "0"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    try:
        port = port_from_log(log, proc, 120)  # read as it is written, for at most 120 s
        assert port != 0
        assert wait_healthy(f"http://127.0.0.1:{port}", proc, 120) == "healthy"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0, log.read_text()[-2000:]
