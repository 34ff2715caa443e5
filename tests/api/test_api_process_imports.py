"""The running API process loads no torch and no engine code: started as rank 0 starts it
(`checkout_entry("api/server.py")` + `ApiConfig.to_argv()`, ZeroMQ sockets bound here where
rank 0's are), it serves /health, a chat /tokenize and a completion, and the modules it
imported (Python's import-time log) and the libraries it mapped (/proc) hold none of them."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import tokenizers
import transformers
import zmq

from tapserve import checkout_entry
from tapserve.api import wire
from tapserve.api.config import ApiConfig
from tapserve.model.demo import ensure_demo_checkpoint
from tests.helpers.api import port_from_log, wait_healthy

FORBIDDEN = (
    "torch",
    "transformers",
    "triton",
    "tapserve.coordinator",
    "tapserve.ranks",
    "tapserve.model",
    "tapserve.cuda_graphs",
    "tapserve.launch",
)
ANSWER = " the model server"  # what the stand-in engine generates


class StandInRank0:
    """Rank 0's two sockets in the ipc dir, answering as the coordinator does: stats every
    0.2 s (so /health answers), and each AddRequest with its accept answer and then the
    tokens of `answer`, finished."""

    def __init__(self, ipc_dir: Path, answer: list[int]):
        self.ctx = zmq.Context()
        self.incoming = self.ctx.socket(zmq.PULL)
        self.incoming.bind(f"ipc://{ipc_dir}/{wire.TO_ENGINE}")
        self.outgoing = self.ctx.socket(zmq.PUSH)
        self.outgoing.bind(f"ipc://{ipc_dir}/{wire.FROM_ENGINE}")
        self.answer, self.added = answer, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            self.outgoing.send(wire.encode(wire.EngineStats()))
            if not self.incoming.poll(200):
                continue
            message = wire.decode(self.incoming.recv())
            if isinstance(message, wire.AddRequest):
                self.added.append(message)
                rid = message.request_id
                done = wire.SequenceOutput(0, self.answer, finish_reason="length")
                prompt = len(message.prompt_token_ids)
                self.outgoing.send(
                    wire.encode(
                        wire.Outputs(
                            [
                                wire.RequestOutput(rid, num_prompt_tokens=prompt),
                                wire.RequestOutput(rid, sequences=[done], finished=True),
                            ]
                        )
                    )
                )

    def close(self) -> None:
        self.outgoing.send(wire.encode(wire.Shutdown("engine stopped", stopped=True)))
        self.stop.set()
        self.thread.join(5)
        self.ctx.destroy(0)


def imported_modules(stderr: str) -> set[str]:
    """The modules in a `-X importtime` log (`import time: self | cumulative | name`)."""
    lines = [line for line in stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip() for line in lines[1:]}


def mapped_files(pid: int) -> set[str]:
    """The files a live process has mapped: its shared libraries among them."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in lines if len(line.split(maxsplit=5)) == 6}


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_a_serving_api_process_loads_no_torch_and_no_engine_module(tmp_path):
    demo = ensure_demo_checkpoint()
    ipc_dir = tmp_path / "ipc"
    ipc_dir.mkdir(mode=0o700)
    tokenizer = tokenizers.Tokenizer.from_file(str(demo / "tokenizer.json"))
    answer = tokenizer.encode(ANSWER, add_special_tokens=False).ids
    rank0 = StandInRank0(ipc_dir, answer)
    config = ApiConfig(
        ipc_dir=str(ipc_dir),
        tokenizer=str(demo),
        served_model_name="demo",
        port=0,  # the API process binds a port of the kernel's choice and logs it
        parent_pid=os.getpid(),
    )
    stderr = tmp_path / "api.stderr"
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "OMP_NUM_THREADS": "1"}
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [*checkout_entry("api/server.py"), *config.to_argv()], stderr=err, env=env
        )
    try:
        config = dataclasses.replace(config, port=port_from_log(stderr, proc, 60))
        assert wait_healthy(config.url, proc, 60) == "healthy", stderr.read_text()[-4000:]
        messages = [{"role": "user", "content": "hello world"}]
        tokenized = httpx.post(config.url + "/tokenize", json={"messages": messages}, timeout=30)
        assert tokenized.status_code == 200, tokenized.text
        reference = transformers.AutoTokenizer.from_pretrained(str(demo))
        expected = reference.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert tokenized.json()["tokens"] == expected
        body = {"model": "demo", "prompt": "hello", "max_tokens": len(answer)}
        completion = httpx.post(config.url + "/v1/completions", json=body, timeout=30)
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"] == tokenizer.decode(answer)
        assert [m.prompt_token_ids for m in rank0.added] == [tokenizer.encode("hello").ids]
        libraries = {f for f in mapped_files(proc.pid) if "torch" in Path(f).parts}
        assert not libraries, f"the API process mapped torch's files: {sorted(libraries)[:5]}"
    finally:
        rank0.close()  # the engine has stopped: a signal ends serving at once
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    modules = imported_modules(stderr.read_text())
    assert {"tapserve.api.openai", "tapserve.api.tokenizer", "uvicorn", "jinja2"} <= modules
    loaded = sorted(m for m in modules if within(m, FORBIDDEN))
    assert not loaded, f"the API process imported {loaded}"


@pytest.mark.parametrize(
    "log, module",
    [
        ("import time:       800 |       9000 |   torch._C", "torch._C"),
        ("import time:         5 |          5 | tapserve.model.demo", "tapserve.model.demo"),
    ],
)
def test_the_import_log_is_read_as_the_interpreter_writes_it(log, module):
    header = "import time: self [us] | cumulative | imported package"
    assert within(module, FORBIDDEN) and imported_modules(f"{header}\n{log}\n") == {module}
