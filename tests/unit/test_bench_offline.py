"""bench/offline.py's roofline floor: every step's plan passes through the meter, and the
workload's floor is the sum of the floors of the steps the engine ran."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tapserve.api.sampling_params import SamplingParams
from tapserve.bench.offline import StepMeter, config_dir
from tapserve.bench.step_cost import ModelCost
from tapserve.coordinator.config import EngineConfig
from tapserve.coordinator.offline import LLM
from tests.helpers.tiny_config import TINY_QWEN3

ROOT = Path(__file__).resolve().parents[2]


def _config_json(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_QWEN3, "vocab_size": 10240}))
    return str(path)


@pytest.mark.parametrize("run_ahead", [False, True])
def test_the_floor_sums_the_floors_of_the_steps_run(tmp_path, run_ahead):
    """Two prompts (5 and 7 tokens) and 3 tokens each: one prefill step, then two decode steps
    at contexts (6, 8) and (7, 9), and under asynchronous scheduling the step launched ahead
    before the last tokens are known (8, 10), which the engine runs too. Bandwidth-bound (F
    infinite), the floor is a weight read a step plus the KV of every token attended to, over
    B."""
    llm = LLM(
        EngineConfig(
            model=config_dir(_config_json(tmp_path)),
            load_format="dummy",
            device="cpu",
            dtype="float32",
            num_kv_blocks=32,
            enable_prefix_caching=False,
            async_scheduling=run_ahead,
        )
    )
    cost = ModelCost.of(llm.runner)
    bandwidth = 1e9
    meter = StepMeter(
        llm.engine, cost, {"copy_bytes_per_s": bandwidth, "bf16_flops_per_s": math.inf}
    )
    steps_before = llm.engine.num_steps
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0)
    llm.generate([[3] * 5, [4] * 7], params)

    kinds = meter.report()
    decode_steps = 3 if run_ahead else 2
    assert {k: v["steps"] for k, v in kinds.items() if k != "idle"} == {
        "prefill": 1,
        "decode": decode_steps,
    }
    assert 1 + decode_steps == llm.engine.num_steps - steps_before
    attended = (5 + 7) + (6 + 8) + (7 + 9) + (8 + 10 if run_ahead else 0)
    weights = (1 + decode_steps) * cost.weight_bytes
    expected = (weights + attended * cost.kv_bytes_per_token) / bandwidth
    assert meter.floor_seconds == pytest.approx(expected)
    meter.reset()
    assert meter.floor_seconds == 0


def test_script_reports_its_measured_machine_and_floor(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "bench/offline.py", "--model-config", _config_json(tmp_path)]
        + ["--num-seqs", "4", "--max-input-len", "120", "--max-output-len", "110"]
        + ["--max-num-seqs", "4", "--max-model-len", "512", "--floor", "--step-kinds"]
        + ["--copy-bytes", str(1 << 20), "--gemm-size", "64", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["machine"]["device_name"].startswith("cpu")
    assert figures["machine"]["copy_bytes_per_s"] > 0
    kinds = figures["step_kinds"]
    assert figures["floor_seconds"] == pytest.approx(
        sum(k["floor_seconds"] for k in kinds.values()), abs=0.001
    )
    assert figures["ratio_to_floor"] == pytest.approx(
        figures["seconds"] / figures["floor_seconds"], rel=0.01
    )
    assert kinds["decode"]["steps"] >= 100 - 1
