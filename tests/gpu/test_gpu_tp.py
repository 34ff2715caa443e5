"""Multi-GPU tensor parallelism (issue 7): NCCL with NVLink multicast off, float32 tiny
checkpoints: TP2 greedy tokens == TP1 (eager and CUDA graphs with the all-reduce inside),
custom outputs equal and computed on rank 0 only; bfloat16 batch-1 decode at TP2 (the GEMV at
the per-rank shapes) agrees with transformers. Skipped without 2 GPUs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.tp.test_tp import (
    GREEDY,
    _assert_same_tokens_and_logprobs,
    _requests,
    compare_ahead,
    finishing_one_by_one,
    run_tp,
)

pytestmark = pytest.mark.gpu
needs_2_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

NVLS_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NVIDIA_TF32_OVERRIDE": "0",
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_torchrun_world_size_1_uses_nccl(tmp_path):
    """Issue 4 item 6: under torchrun one rank joins an NCCL group; tokens as without it."""
    ckpt = make_tiny_checkpoint(tmp_path / "ws1", "qwen3")
    spec = {
        "engine": {
            "model": str(ckpt),
            "device": "cuda",
            "dtype": "float32",
            "max_num_seqs": 8,
            "max_model_len": 256,
        },
        "requests": _requests([3, 20], GREEDY),
    }
    plain = run_tp(tmp_path, "ws1", spec, 1, **NVLS_OFF)
    nccl = run_tp(tmp_path, "ws1", spec, 1, torchrun=True, **NVLS_OFF)
    assert (plain["_backend"], nccl["_backend"]) == (None, "nccl")
    _assert_same_tokens_and_logprobs(plain, nccl, 2)


@needs_2_gpus
@pytest.mark.parametrize(
    "arch,kv_heads,eager",
    [("qwen3", 2, True), ("qwen3", 2, False), ("llama", 2, False), ("qwen3", 1, False)],
)
def test_gpu_tp2_greedy_matches_tp1(tmp_path, arch, kv_heads, eager):
    ckpt = make_tiny_checkpoint(tmp_path / arch, arch, num_key_value_heads=kv_heads)
    spec = {
        "engine": {
            "model": str(ckpt),
            "device": "cuda",
            "dtype": "float32",
            "enforce_eager": eager,
            "max_num_seqs": 16,
            "max_model_len": 256,
        },
        "requests": _requests([1, 7, 16, 17, 40, 3], GREEDY),
    }
    one = run_tp(tmp_path, "g", spec, 1, **NVLS_OFF)
    two = run_tp(tmp_path, "g", spec, 2, **NVLS_OFF)
    _assert_same_tokens_and_logprobs(one, two, len(spec["requests"]))
    assert two["_free_blocks"][0] == two["_free_blocks"][1]


@needs_2_gpus
def test_gpu_tp2_custom_outputs(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "co", "qwen3")
    reqs = _requests([6, 20, 33], {"max_new_tokens": 4, "temperature": 0})
    reqs[0]["custom_output_params"] = {"position": 0}
    engine = {
        "model": str(ckpt),
        "device": "cuda",
        "dtype": "float32",
        "custom_module": "tests.helpers.tp_handler:RecordingHead",
        "max_num_seqs": 8,
        "max_model_len": 256,
    }
    logs = {n: tmp_path / f"h{n}.log" for n in (1, 2)}
    one = run_tp(
        tmp_path,
        "co",
        {"engine": engine, "requests": reqs},
        1,
        TAPSERVE_TEST_HANDLER_LOG=str(logs[1]),
        **NVLS_OFF,
    )
    two = run_tp(
        tmp_path,
        "co",
        {"engine": engine, "requests": reqs},
        2,
        TAPSERVE_TEST_HANDLER_LOG=str(logs[2]),
        **NVLS_OFF,
    )
    for i in range(len(reqs)):
        a, b = (
            torch.frombuffer(
                bytearray(bytes.fromhex(r[str(i)]["custom_output"]["data"])), dtype=torch.float32
            )
            for r in (one, two)
        )
        assert torch.allclose(a, b, atol=1e-4)
    lines = logs[2].read_text().splitlines()
    assert [ln for ln in lines if ln.startswith("init")] == ["init rank=0"]
    assert all("rank=0" in ln for ln in lines)


@needs_2_gpus
def test_gpu_tp2_bfloat16_batch1_agreement_with_transformers(tmp_path):
    """bf16 at TP 2, every prompt decoded alone in the batch-1 graph (q/k/v, o and down on the
    project's GEMV at the per-rank shapes, the all-reduce inside): teacher-forced top-1
    agreement with transformers bf16 >= 99 % where the fp32 top-2 margin exceeds 0.1."""
    from tapserve.model.layers import GEMV_MAX_ROWS
    from tests.gpu.test_gpu_engine import _agreement, _prompts

    assert GEMV_MAX_ROWS >= 1, "run without TAPSERVE_GEMV_MAX_ROWS=0: this tests the GEMV"
    path = make_tiny_checkpoint(tmp_path / "q", "qwen3")
    prompts = _prompts(512)
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    spec = {
        "engine": {
            "model": str(path),
            "device": "cuda",
            "dtype": "bfloat16",
            "max_num_seqs": 16,
            "max_model_len": 256,
        },
        "requests": [{"prompt": p, "params": params} for p in prompts],
        "one_at_a_time": True,
    }
    two = run_tp(tmp_path, "bf16", spec, 2, **NVLS_OFF)
    # the default on two GPUs of one host: o and down write into the one-shot buffer
    assert two["_allreduce"] == "symm"
    seqs = [p + two[str(i)]["tokens"]["0"] for i, p in enumerate(prompts)]
    assert all(len(s) == len(p) + 48 for s, p in zip(seqs, prompts))
    hf, total, _, _ = _agreement(str(path), prompts, seqs)
    assert total > 100, total
    assert hf >= 0.99, (hf, total)


@needs_2_gpus
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_gpu_tp2_running_ahead_matches_synchronous_tp1(tmp_path, eager):
    """The CUDA default at TP 2 runs decode steps ahead of their sampling, the ids reaching
    rank 1 in an NCCL broadcast in the stream: float32 greedy tokens equal the synchronous
    TP 1 engine's, with requests ending one by one; no KV block leaks."""
    ckpt = make_tiny_checkpoint(tmp_path / "ahead", "qwen3")
    engine = {
        "model": str(ckpt),
        "device": "cuda",
        "dtype": "float32",
        "enforce_eager": eager,
        "max_num_seqs": 16,
        "max_model_len": 256,
    }
    _, ahead = compare_ahead(
        tmp_path, "ahead", engine, finishing_one_by_one(), 1, ahead=None, **NVLS_OFF
    )
    assert ahead["_ahead_steps"] > 10


def _stream_completion(url: str, first_id: int, max_tokens: int) -> tuple[int, str | None, bool]:
    """One streaming greedy completion: (status, its last finish reason, ended with [DONE])."""
    import httpx

    from tests.helpers.api import sse_events, sse_json

    body = {
        "model": "ckpt",
        "prompt": [1, 2, first_id],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r)
    finishes = [c["choices"][0]["finish_reason"] for c in sse_json(events) if c.get("choices")]
    return (
        r.status_code,
        next((f for f in reversed(finishes) if f), None),
        events[-1:] == ["[DONE]"],
    )


def drain_with_streams_in_flight(tmp_path, device: str, *args: str) -> None:
    """A 2-rank server (`launch.py --nproc-per-node 2`) on device gets SIGTERM (to the
    launcher, which passes it on) while 8 greedy streams decode: every stream still ends
    with its length and [DONE], and the group exits 0 within the drain time."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers.api import LiveServer

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=True)
    server = LiveServer(
        "--nproc-per-node",
        "2",
        "--model",
        str(ckpt),
        "--shutdown-timeout",
        "20",
        "--custom-module",
        "none",
        "--max-model-len",
        "512",
        *args,
        device=device,
        startup_timeout=240,
    )
    try:
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(_stream_completion, server.url, 3 + i, 500) for i in range(8)]
            time.sleep(0.4)
            start = time.monotonic()
            assert server.stop(timeout=60) == 0, server.log_tail()
            assert time.monotonic() - start < 20
            results = [s.result(60) for s in streams]
        assert all(
            status == 200 and finish == "length" and done for status, finish, done in results
        ), results
    finally:
        server.stop()


@needs_2_gpus
def test_gpu_tp2_server_drains_with_steps_in_flight(tmp_path, monkeypatch):
    """drain_with_streams_in_flight on two GPUs, asynchronous scheduling on (the CUDA
    default): no collective is left waiting when the stop plan goes out."""
    for name, value in NVLS_OFF.items():
        monkeypatch.setenv(name, value)
    drain_with_streams_in_flight(tmp_path, "cuda")
