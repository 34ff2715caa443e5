"""The symmetric-memory one-shot all-reduce (model/allreduce.py, TAPSERVE_ALLREDUCE=symm or
symm_fused; issue 7 item 3). On 2 GPUs: equal to NCCL on random bf16/fp32 tensors of several
sizes, eager and replayed in CUDA graphs (tests/helpers/allreduce_check.py), and the engine with the
switch on gives the TP1 greedy tokens on the float32 tiny checkpoint. On CPU: which messages
it takes, and that the switch off (or on CPU) changes nothing."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from tapserve.model.allreduce import SymmMemAllReduce, mode_from_env, with_one_shot_all_reduce
from tapserve.model.layers import TPGroup
from tests.gpu.test_gpu_tp import NVLS_OFF, needs_2_gpus
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.tp.test_tp import GREEDY, ROOT, _assert_same_tokens_and_logprobs, _env, _requests, run_tp


def _comm(max_bytes: int = 1024) -> SymmMemAllReduce:
    """A communicator around a plain CPU buffer: enough to ask which messages it takes."""
    return SymmMemAllReduce(torch.zeros(max_bytes, dtype=torch.uint8), None, "0", fused=True)


def test_eligible_messages():
    comm = _comm()
    assert comm.eligible(torch.zeros(2, 64, dtype=torch.bfloat16))
    assert comm.eligible(torch.zeros(4, 64, dtype=torch.float32))  # 1024 bytes: the buffer
    assert not comm.eligible(torch.zeros(5, 64, dtype=torch.float32))  # over max_bytes
    assert not comm.eligible(torch.zeros(64, dtype=torch.float16))  # no one-shot kernel
    assert not comm.eligible(torch.zeros(7, dtype=torch.bfloat16))  # 14 bytes: not 16-aligned
    assert not comm.eligible(torch.zeros(0, dtype=torch.bfloat16))
    assert not comm.eligible(torch.zeros(64, 2, dtype=torch.bfloat16).t())  # not contiguous
    assert not comm.eligible(torch.zeros(76, dtype=torch.bfloat16)[4:])  # offset 8 bytes
    assert comm.eligible(torch.zeros(72, dtype=torch.bfloat16)[8:])


def test_staging_is_the_buffer_start_for_one_shot_messages():
    staged = SymmMemAllReduce(torch.zeros(1024, dtype=torch.uint8), None, "0", fused=False)
    view = staged.staging((2, 64), torch.bfloat16)
    assert view.shape == (2, 64) and view.data_ptr() == staged.buffer.data_ptr()
    assert staged.eligible(view)
    assert staged.staging((5, 64), torch.float32) is None  # over the buffer
    assert staged.staging((7,), torch.bfloat16) is None  # not 16-byte sized
    assert staged.staging((64,), torch.float16) is None
    assert _comm().staging((2, 64), torch.bfloat16) is None  # fused: its kernel copies
    tp = TPGroup(rank=0, size=2, group=None, one_shot=staged)
    assert tp.partial_sums((2, 64), torch.bfloat16).data_ptr() == staged.buffer.data_ptr()
    assert TPGroup(rank=0, size=2).partial_sums((2, 64), torch.bfloat16) is None


def test_auto_is_the_default_and_quiet_where_it_does_not_apply(monkeypatch, caplog):
    monkeypatch.delenv("TAPSERVE_ALLREDUCE", raising=False)
    assert mode_from_env() == "auto"
    tp = TPGroup(rank=0, size=2, group=None)
    with caplog.at_level(logging.WARNING, logger="tapserve.allreduce"):
        assert with_one_shot_all_reduce(tp, "auto", torch.device("cpu"), torch.float32, 1) is tp
        assert with_one_shot_all_reduce(tp, "auto", torch.device("cuda", 0), torch.float16, 1) is tp
        assert not caplog.records
        assert with_one_shot_all_reduce(tp, "symm", torch.device("cpu"), torch.float32, 1) is tp
        assert "ignored" in caplog.text  # an explicit choice that does not apply is said


class _RecordingSum:
    """A stand-in for SymmMemAllReduce on CPU (symmetric memory needs GPUs): a staging
    buffer, and a 'sum' over two ranks that doubles its input and records where it lay."""

    def __init__(self) -> None:
        self.buffer, self.seen = torch.zeros(64, 8), []

    def staging(self, shape, dtype):
        return self.buffer[: shape[0]].view(shape)

    def reduce(self, x):
        self.seen.append(x.data_ptr())
        return x * 2


def test_row_parallel_linear_writes_its_partial_sums_where_the_all_reduce_reads():
    from tapserve.model.layers import RowParallelLinear

    one_shot = _RecordingSum()
    layer = RowParallelLinear(32, 8, TPGroup(rank=0, size=2, group=None, one_shot=one_shot))
    layer.weight.data = torch.randn(8, 16)
    x = torch.randn(3, 16)
    y = layer(x)
    assert one_shot.seen == [one_shot.buffer.data_ptr()]
    torch.testing.assert_close(y, 2 * x @ layer.weight.T)


def test_switch_off_or_cpu_leaves_the_group_alone():
    tp = TPGroup(rank=0, size=2, group=None)
    assert with_one_shot_all_reduce(tp, "nccl", torch.device("cuda", 0), torch.bfloat16, 1) is tp
    assert with_one_shot_all_reduce(tp, "symm", torch.device("cpu"), torch.float32, 1) is tp
    assert (
        with_one_shot_all_reduce(tp, "symm_fused", torch.device("cuda", 0), torch.float16, 1) is tp
    )  # the one-shot kernel has no float16
    assert (
        with_one_shot_all_reduce(
            TPGroup(), "symm", torch.device("cuda", 0), torch.bfloat16, 1
        ).one_shot
        is None
    )
    with pytest.raises(ValueError, match="TAPSERVE_ALLREDUCE"):
        with_one_shot_all_reduce(tp, "nvls", torch.device("cpu"), torch.float32, 1)


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.parametrize("variant", ["staged", "fused"])
def test_gpu_one_shot_matches_nccl(tmp_path, variant):
    out = tmp_path / "allreduce.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "tests" / "helpers" / "allreduce_check.py"),
        str(out),
        variant,
    ]
    proc = subprocess.run(
        cmd, env=_env(**NVLS_OFF), cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    if not result["available"]:
        pytest.skip(f"torch {result['torch']} has no op for the {variant} variant")
    assert result["set_up"], proc.stderr[-3000:]
    # every case eager and in a graph; the staged variant's one-shot cases also written
    # straight into the buffer ("direct", TPGroup.partial_sums), summed into a new tensor
    direct = [c for c in result["cases"] if c["mode"] == "direct"]
    assert len(result["cases"]) == 24 + len(direct)
    assert len(direct) == (9 if variant == "staged" else 0)
    assert all(c["apart"] for c in direct)
    for case in result["cases"]:
        assert case["one_shot"] == case["expected_one_shot"], case
        assert case["close"] and case["same_on_all_ranks"], case
    assert result["chain"] == {"close": True, "same_on_all_ranks": True}
    if variant == "staged":
        assert result["row_parallel"] == {
            "in_buffer": True,
            "equal": True,
            "same_on_all_ranks": True,
        }


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.parametrize("mode,eager", [("symm", True), ("symm", False), ("symm_fused", False)])
def test_gpu_tp2_symm_greedy_matches_tp1(tmp_path, mode, eager):
    ckpt = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", num_key_value_heads=2)
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
    two = run_tp(tmp_path, "g", spec, 2, TAPSERVE_ALLREDUCE=mode, **NVLS_OFF)
    assert two["_allreduce"] == mode
    _assert_same_tokens_and_logprobs(one, two, len(spec["requests"]))
    assert two["_free_blocks"][0] == two["_free_blocks"][1]
