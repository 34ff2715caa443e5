"""bench/roofline.py on the CPU with small sizes, and decode_sweep's FLOPs of a decode step
against torch's FLOP counter on transformers' own model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tapserve.bench import roofline
from tests.helpers.tiny_config import TINY_QWEN3

ROOT = Path(__file__).resolve().parents[2]
TINY = TINY_QWEN3


def test_copy_bandwidth_on_cpu_is_plausible():
    # a CPU copies at 1 GB/s to 1 TB/s (read + written); a wrong byte count or unit is far off
    bandwidth = roofline.measure_copy_bandwidth("cpu", nbytes=4 << 20, repeats=3)
    assert 1e9 < bandwidth < 1e12


def test_copy_counts_read_and_written_bytes(monkeypatch):
    """2 x nbytes over the best copy's seconds: the convention of DESIGN.md's B."""
    timed = []

    def best_of(work, device, repeats):
        timed.append(repeats)
        work()
        return 2.0

    monkeypatch.setattr(roofline, "_best_seconds", best_of)
    assert roofline.measure_copy_bandwidth("cpu", nbytes=1000, repeats=3) == 2 * 1000 / 2.0
    assert timed == [3]


def test_bf16_gemm_on_cpu_is_plausible():
    flops = roofline.measure_bf16_flops("cpu", size=64, repeats=3)
    assert 1e6 < flops < 1e14


@pytest.mark.parametrize(
    ("nbytes", "flops", "expected"),
    [
        (4e9, 1e12, 2.0),  # bandwidth-bound: 4e9 / 2e9 = 2 s against 1e12 / 1e12 = 1 s
        (1e9, 3e12, 3.0),  # compute-bound
        (2e9, 1e12, 1.0),  # equal
    ],
)
def test_step_floor_is_the_larger_bound(nbytes, flops, expected):
    assert roofline.step_floor(nbytes, flops, 2e9, 1e12) == expected


def test_measure_records_the_device_and_both_figures():
    figures = roofline.measure("cpu", copy_bytes=1 << 20, gemm_size=32)
    assert figures["device_name"].startswith("cpu")
    assert figures["copy_bytes"] == 1 << 20 and figures["gemm_size"] == 32
    assert figures["copy_bytes_per_s"] > 0 and figures["bf16_flops_per_s"] > 0
    assert all(math.isfinite(figures[k]) for k in ("copy_bytes_per_s", "bf16_flops_per_s"))


def test_decode_sweep_measures_its_floor_in_the_run(tmp_path):
    """bench/decode_sweep.py on the CPU: B and F measured and recorded with the device's name,
    each row's floor and ratio to it from them."""
    config, out = tmp_path / "config.json", tmp_path / "sweep.json"
    config.write_text(json.dumps(TINY))
    proc = subprocess.run(
        [sys.executable, "bench/decode_sweep.py", "--model-config", str(config)]
        + ["--batch-sizes", "1,2", "--context", "16", "--steps", "2", "--json", str(out)]
        + ["--copy-bytes", str(1 << 20), "--gemm-size", "32"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["machine"]["device_name"].startswith("cpu")
    assert figures["machine"]["copy_bytes_per_s"] > 0 < figures["machine"]["bf16_flops_per_s"]
    assert [row["batch"] for row in figures["rows"]] == [1, 2]
    for row in figures["rows"]:
        assert row["floor_ms"] > 0
        rounding = 0.00005 / row["floor_ms"] + 0.0005 / row["step_ms"]  # of the ms figures
        assert row["ratio_to_floor"] == pytest.approx(
            row["step_ms"] / row["floor_ms"], rel=rounding + 0.001
        )


def test_roofline_script_prints_its_figures():
    proc = subprocess.run(
        [sys.executable, "bench/roofline.py", "--device", "cpu"]
        + ["--copy-bytes", str(1 << 20), "--gemm-size", "32"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["copy_bytes_per_s"] > 0 and "TB/s" in proc.stdout


@pytest.mark.parametrize("context", [0, 24])
def test_decode_flops_match_torch_flop_counter(context):
    """decode_sweep.decode_flops against FlopCounterMode over one decode step of transformers'
    Qwen3 (batch 3, `context` tokens cached): matmuls and attention; decode_flops also counts
    the norm weights (2 FLOPs each, well under 1 % here)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    from tapserve.bench.decode_sweep import decode_flops
    from tapserve.model.config import ModelConfig
    from tapserve.model.decoder import CausalLM
    from tapserve.model.layers import TPGroup

    batch = 3
    torch.manual_seed(0)
    config = Qwen3Config(**TINY)
    config._attn_implementation = "eager"  # attention as matmuls, which the counter counts
    hf = Qwen3ForCausalLM(config).eval()
    cache = DynamicCache()
    with torch.no_grad():
        if context:
            hf(torch.randint(0, 512, (batch, context)), past_key_values=cache, use_cache=True)
        with FlopCounterMode(display=False) as counter:
            hf(torch.randint(0, 512, (batch, 1)), past_key_values=cache, use_cache=True)
    cfg = ModelConfig.from_dict(TINY)
    runner = SimpleNamespace(model=CausalLM(cfg, TPGroup()), model_cfg=cfg, tp=TPGroup())
    ours = decode_flops(runner, batch, mean_context=context + 1)
    assert ours == pytest.approx(counter.get_total_flops(), rel=0.01)
