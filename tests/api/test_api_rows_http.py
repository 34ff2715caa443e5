"""Multi-row custom outputs over HTTP, on the API process's side: the real api/server.py (as
rank 0 starts it) linked by ZeroMQ to a stand-in rank 0 here that answers as DESIGN.md "Custom
outputs over many tokens" has rank 0 send (rows as deltas, prompt rows in two prefill chunks,
"content_filter"); read with the official `openai` client and httpx. Every value is checked
against `reference_row`, the rule the stand-in builds rows by."""

from __future__ import annotations

import base64
import dataclasses
import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tokenizers
import zmq

from tapserve import checkout_entry
from tapserve.api import wire
from tapserve.api.config import ApiConfig
from tapserve.model.demo import ensure_demo_checkpoint
from tests.helpers.api import port_from_log, sse_events, sse_json, wait_healthy

ANSWER = " alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
STATS = wire.EngineStats(
    custom_output_rows=40,
    custom_output_bytes=320,
    custom_output_content_filter=2,
    custom_output_should_stop_errors=1,
)


def reference_row(seq: int, position: int, width: int | None) -> np.ndarray:
    """The stand-in head's row for sequence `seq` (-1: the prompt's) at `position`."""
    base = float(position) + 0.5 * (seq + 1)
    if width is None:
        return np.array(base, np.float32)
    return np.array([base + 16 * c for c in range(width)], np.float32)


def rows(seq: int, positions: list[int], width: int | None, dtype: str) -> dict:
    array = np.stack([reference_row(seq, p, width) for p in positions]).astype(np.float32)
    if dtype == "bfloat16":
        data = (array.view(np.uint32) >> 16).astype("<u2").tobytes()
    else:
        data = array.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    return {"dtype": dtype, "shape": list(array.shape), "data": data}


def script(add: wire.AddRequest, answer: list[int]) -> list[wire.RequestOutput]:
    """What rank 0 sends for `add` after its accept answer. custom_output_params: `prompt`
    (prompt positions), `width` (None: a 1-D head), `dtype`, `flag` (sequence 0 is flagged
    by should_stop after this many tokens)."""
    rid, cop, sp = add.request_id, add.custom_output_params or {}, add.sampling_params
    width, dtype = cop.get("width"), cop.get("dtype", "float32")
    n_prompt, n, max_new = len(add.prompt_token_ids), sp["n"], sp["max_new_tokens"]
    chosen = sorted(p if p >= 0 else n_prompt + p for p in cop.get("prompt", []))
    outs = [
        wire.RequestOutput(rid, custom_rows=rows(-1, part, width, dtype), custom_positions=part)
        for part in (chosen[:1], chosen[1:])
        if part
    ]
    if max_new == 0:
        outs.append(
            wire.RequestOutput(
                rid, sequences=[wire.SequenceOutput(i, finish_reason="length") for i in range(n)]
            )
        )
        outs[-1].finished = True
        return outs
    sent = [0] * n
    flag = cop.get("flag")
    while any(s < max_new for s in sent):
        sequences = []
        for seq in range(n):
            limit = flag if seq == 0 and flag is not None else max_new
            if sent[seq] >= max_new:
                continue
            count = min(1 + (seq + len(outs)) % 2, limit - sent[seq])
            ids = answer[seq + sent[seq] : seq + sent[seq] + count]
            positions = [n_prompt + sent[seq] + i for i in range(count)]
            done = sent[seq] + count >= limit
            reason = ("content_filter" if limit < max_new else "length") if done else None
            if reason == "content_filter":
                positions.append(n_prompt + limit)  # the flagged token's row, not its id
            sequences.append(
                wire.SequenceOutput(
                    seq,
                    ids,
                    [-0.25] * count if sp["logprobs"] else None,
                    [[[t, -0.25]] for t in ids] if sp["logprobs"] else None,
                    reason,
                    None,
                    None,
                    rows(seq, positions, width, dtype) if positions else None,
                    positions or None,
                )
            )
            sent[seq] = max_new if done else sent[seq] + count
        outs.append(wire.RequestOutput(rid, sequences=sequences))
    outs[-1].finished = True
    return outs


class StandInRank0:
    """Rank 0's two sockets: stats every 0.2 s, and each AddRequest answered by its accept
    and then `script`'s outputs, one message each; with custom_output_params `paced`, each
    output after the first with tokens waits for a `permits` release (a chunk the test read)."""

    def __init__(self, ipc_dir: Path, answer: list[int]):
        self.ctx = zmq.Context()
        self.incoming = self.ctx.socket(zmq.PULL)
        self.incoming.bind(f"ipc://{ipc_dir}/{wire.TO_ENGINE}")
        self.outgoing = self.ctx.socket(zmq.PUSH)
        self.outgoing.bind(f"ipc://{ipc_dir}/{wire.FROM_ENGINE}")
        self.answer = answer
        self.permits = threading.Semaphore(0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            self.outgoing.send(wire.encode(STATS))
            if not self.incoming.poll(200):
                continue
            message = wire.decode(self.incoming.recv())
            if isinstance(message, wire.AddRequest):
                accept = wire.RequestOutput(
                    message.request_id, num_prompt_tokens=len(message.prompt_token_ids)
                )
                paced = (message.custom_output_params or {}).get("paced")
                started = False
                for out in [accept, *script(message, self.answer)]:
                    if paced and started:
                        assert self.permits.acquire(timeout=60), "the test read no chunk"
                    started = started or bool(out.sequences)
                    out.num_prompt_tokens = len(message.prompt_token_ids)
                    self.outgoing.send(wire.encode(wire.Outputs([out])))

    def close(self) -> None:
        self.outgoing.send(wire.encode(wire.Shutdown("engine stopped", stopped=True)))
        self.stop.set()
        self.thread.join(5)
        self.ctx.destroy(0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    demo = ensure_demo_checkpoint()
    tmp = tmp_path_factory.mktemp("rows")
    ipc_dir = tmp / "ipc"
    ipc_dir.mkdir(mode=0o700)
    tokenizer = tokenizers.Tokenizer.from_file(str(demo / "tokenizer.json"))
    answer = tokenizer.encode(ANSWER * 4, add_special_tokens=False).ids
    rank0 = StandInRank0(ipc_dir, answer)
    config = ApiConfig(ipc_dir=str(ipc_dir), tokenizer=str(demo), served_model_name="demo", port=0)
    config = dataclasses.replace(config, parent_pid=os.getpid())
    log = tmp / "api.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*checkout_entry("api/server.py"), *config.to_argv()], stderr=out, stdout=out, env=env
        )
    try:
        config = dataclasses.replace(config, port=port_from_log(log, proc, 60))
        assert wait_healthy(config.url, proc, 60) == "healthy", log.read_text()[-4000:]
        yield config.url, tokenizer, rank0
    finally:
        rank0.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def prompt_len(url: str, prompt: str) -> int:
    return httpx.post(url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["count"]


def expected(seq: int, n_prompt: int, prompt: list[int], generated: int, width) -> tuple:
    """A choice's positions and reference values: its prompt rows, then `generated` rows."""
    positions = sorted(p if p >= 0 else n_prompt + p for p in prompt)
    own = [n_prompt + i for i in range(generated)]
    values = [reference_row(-1, p, width) for p in positions]
    values += [reference_row(seq, p, width) for p in own]
    return positions + own, np.stack(values)


def test_completions_n2_rows_per_choice_and_per_chunk(server):
    """Non-streamed: each choice's rows (prompt + its tokens) with positions; top level the
    last choice's. Streamed with logprobs: every chunk carries exactly its tokens' rows (the
    first its prompt rows too); the chunks reassemble to the non-streamed answer."""
    url, _, rank0 = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    prompt = "score every token of this"
    n_prompt = prompt_len(url, prompt)
    cop = {"prompt": [1, -1], "width": 3, "dtype": "bfloat16"}
    kwargs = dict(model="demo", prompt=prompt, n=2, max_tokens=5, logprobs=1, temperature=1.0)
    whole = client.completions.create(**kwargs, extra_body={"custom_output_params": cop})
    assert whole.usage.completion_tokens == 10
    fields = []
    for choice in whole.choices:
        extra = choice.model_extra["extra_outputs"]
        positions, values = expected(choice.index, n_prompt, [1, -1], 5, 3)
        assert extra["custom_output_positions"] == positions
        np.testing.assert_array_equal(np.array(extra["custom_output"], np.float32), values)
        fields.append(extra)
    assert whole.model_extra["extra_outputs"] == fields[-1]
    stream = client.completions.create(
        **kwargs, stream=True, extra_body={"custom_output_params": {**cop, "paced": True}}
    )
    chunks = []
    for chunk in stream:  # (read to the end before checking: rank 0 waits on each read)
        chunks.append(chunk)
        rank0.permits.release()  # rank 0's next output comes after this chunk
    seen = {i: {"rows": [], "pos": [], "tokens": 0, "chunks": 0} for i in (0, 1)}
    for chunk in chunks:
        (choice,) = chunk.choices
        mine = seen[choice.index]
        extra = (choice.model_extra or {}).get("extra_outputs", {})
        assert (chunk.model_extra or {}).get("extra_outputs", {}) == extra  # its own delta
        carried = len(choice.logprobs.tokens) if choice.logprobs else 0
        want = [] if mine["chunks"] else sorted([1, n_prompt - 1])
        want += [n_prompt + mine["tokens"] + i for i in range(carried)]
        assert extra.get("custom_output_positions", []) == want, (chunk, mine)
        mine["rows"] += extra.get("custom_output", [])
        mine["pos"] += want
        mine["tokens"] += carried
        mine["chunks"] += 1
    assert seen[0]["chunks"] >= 3 and seen[1]["chunks"] >= 2  # deltas, not the whole value
    for choice, extra in zip(whole.choices, fields):
        mine = seen[choice.index]
        assert mine["pos"] == extra["custom_output_positions"]
        assert mine["rows"] == extra["custom_output"]


def test_chat_content_filter_stream(server):
    """Sequence 0 is flagged after 3 tokens: finish_reason "content_filter", the flagged row
    last in the final chunk, 3 tokens of text and logprobs, 4 in usage."""
    url, tokenizer, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    cop = {"flag": 3}
    messages = [{"role": "user", "content": "tell me"}]
    common = dict(model="demo", messages=messages, max_tokens=6, logprobs=True)
    whole = client.chat.completions.create(**common, extra_body={"custom_output_params": cop})
    (choice,) = whole.choices
    assert choice.finish_reason == "content_filter"
    assert len(choice.logprobs.content) == 3 and whole.usage.completion_tokens == 4
    answer = tokenizer.encode(ANSWER * 4, add_special_tokens=False).ids
    assert choice.message.content == tokenizer.decode(answer[:3])
    extra = choice.model_extra["extra_outputs"]
    n_prompt = whole.usage.prompt_tokens
    positions, values = expected(0, n_prompt, [], 4, None)
    assert extra["custom_output_positions"] == positions  # the flagged token's row is last
    np.testing.assert_array_equal(np.array(extra["custom_output"], np.float32), values)
    chunks = list(
        client.chat.completions.create(
            **common,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"custom_output_params": cop},
        )
    )
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["content_filter"]
    assert finals[0].choices[0].model_extra["extra_outputs"]["custom_output_positions"][-1] == (
        n_prompt + 3
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == 4


def test_api_cut_stop_string_drops_the_rows_of_cut_tokens(server):
    url, tokenizer, _ = server
    body = {
        "model": "demo",
        "prompt": "list",
        "max_tokens": 16,
        "stop": [" gamma"],
        "custom_output_params": {"prompt": [0]},
    }
    answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "stop" and choice["text"] == " alpha beta"
    kept = answer["usage"]["completion_tokens"]
    n_prompt = answer["usage"]["prompt_tokens"]
    assert 8 < kept < 16  # (the demo tokenizer spells " alpha beta" in 8 tokens)
    positions, values = expected(0, n_prompt, [0], kept, None)
    assert choice["extra_outputs"]["custom_output_positions"] == positions
    assert choice["extra_outputs"]["custom_output"] == values.tolist()


def test_generate_base64_per_sequence_streamed_and_whole(server):
    """Native /generate, two sequences, base64: each sequence's rows bit-exact with their
    positions; the stream's deltas, joined per sequence, are the same bytes."""
    url, _, _ = server
    cop = {"prompt": [0, 2], "width": 2, "dtype": "float16"}
    body = {
        "prompt": "native rows",
        "generate_config": {"max_new_tokens": 4, "num_return_sequences": 2, "do_sample": True},
        "custom_output_params": cop,
        "custom_output_encoding": "base64",
    }
    whole = httpx.post(url + "/generate", json=body, timeout=60).json()
    n_prompt = prompt_len(url, "native rows")
    for seq in (0, 1):
        positions, values = expected(seq, n_prompt, [0, 2], 4, 2)
        value = whole["custom_output"][seq]
        assert value["dtype"] == "float16" and value["shape"] == [len(positions), 2]
        assert base64.b64decode(value["data"]) == values.astype("<f2").tobytes()
        assert whole["custom_output_positions"][seq] == positions
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        events = sse_json(sse_events(r))
    joined = {0: b"", 1: b""}
    positions = {0: [], 1: []}
    for event in events:
        for seq, value in enumerate(event.get("custom_output") or [None, None]):
            if value is not None:
                joined[seq] += base64.b64decode(value["data"])
                positions[seq] += event["custom_output_positions"][seq]
            else:
                assert event.get("custom_output_positions", [None, None])[seq] is None
    assert events[-1]["finished"]
    for seq in (0, 1):
        assert joined[seq] == base64.b64decode(whole["custom_output"][seq]["data"])
        assert positions[seq] == whole["custom_output_positions"][seq]


def test_custom_output_batch_scores_each_prompts_positions(server):
    url, _, _ = server
    prompts = ["first prompt to score", "a second, longer prompt to score here"]
    body = {"prompts": prompts, "custom_output_params": {"prompt": [0, 1, -1], "width": 2}}
    outputs = httpx.post(url + "/custom_output", json=body, timeout=60).json()["outputs"]
    for prompt, out in zip(prompts, outputs):
        n_prompt = prompt_len(url, prompt)
        positions, values = expected(0, n_prompt, [0, 1, -1], 0, 2)
        assert out["custom_output_positions"] == positions and out["input_len"] == n_prompt
        assert out["custom_output"] == values.tolist()


def test_metrics_show_the_rows_counters(server):
    url, _, _ = server
    text = httpx.get(url + "/metrics", timeout=30).text
    for line in (
        "tapserve_custom_output_rows_total 40.0",
        "tapserve_custom_output_bytes_total 320.0",
        "tapserve_content_filter_finishes_total 2.0",
        "tapserve_custom_output_should_stop_errors_total 1.0",
    ):
        assert line in text.splitlines(), line
