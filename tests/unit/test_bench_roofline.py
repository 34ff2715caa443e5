"""bench/roofline.py on the CPU with small sizes, and decode_sweep's FLOPs of a decode step
against torch's FLOP counter on transformers' own model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tapserve.bench import roofline
from tapserve.bench.step_cost import ModelCost
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


def _tiny_models():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tapserve.model.config import ModelConfig
    from tapserve.model.decoder import CausalLM
    from tapserve.model.layers import TPGroup

    torch.manual_seed(0)
    config = Qwen3Config(**TINY)
    config._attn_implementation = "eager"  # attention as matmuls, which the counter counts
    cfg = ModelConfig.from_dict(TINY)
    cost = ModelCost.of_model(CausalLM(cfg, TPGroup()), cfg, 1, kv_bytes_per_token=0)
    return Qwen3ForCausalLM(config).eval(), cost


@pytest.mark.parametrize("context", [0, 24])
def test_decode_flops_match_torch_flop_counter(context):
    """ModelCost.decode_flops against FlopCounterMode over one decode step of transformers'
    Qwen3 (batch 3, `context` tokens cached): matmuls and attention; the cost model also counts
    the norm weights (2 FLOPs each, well under 1 % here)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import DynamicCache

    batch = 3
    hf, cost = _tiny_models()
    cache = DynamicCache()
    with torch.no_grad():
        if context:
            hf(torch.randint(0, 512, (batch, context)), past_key_values=cache, use_cache=True)
        with FlopCounterMode(display=False) as counter:
            hf(torch.randint(0, 512, (batch, 1)), past_key_values=cache, use_cache=True)
    assert cost.decode_flops(batch, mean_context=context + 1) == pytest.approx(
        counter.get_total_flops(), rel=0.01
    )


def test_step_flops_of_a_mixed_plan_match_torch_flop_counter():
    """A mixed step's plan (a decode row, a whole prompt, a prompt's second chunk; logits for
    the last token of each) against FlopCounterMode over transformers running each sequence's
    new tokens on its cached ones: the counter's eager attention computes the whole
    queries x keys square, so the causal mask's unused half is taken off it."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import DynamicCache

    from tapserve.ranks.plan import StepKind, StepPlan

    hf, cost = _tiny_models()
    cached_and_new = [(30, 1), (0, 40), (16, 20)]
    counted = masked = 0.0
    with torch.no_grad():
        for cached, new in cached_and_new:
            cache = DynamicCache()
            if cached:
                hf(torch.randint(0, 512, (1, cached)), past_key_values=cache, use_cache=True)
            with FlopCounterMode(display=False) as counter:
                hf(
                    torch.randint(0, 512, (1, new)),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            counted += counter.get_total_flops()
            masked += cost.attention_flops_per_pair * new * (new - 1) / 2
    news = [n for _, n in cached_and_new]
    ends = np.cumsum([0, *news])
    plan = StepPlan(
        StepKind.MIXED,
        input_ids=np.zeros(ends[-1], np.int64),
        query_start_loc=ends.astype(np.int32),
        context_lens=np.array([c + n for c, n in cached_and_new], np.int32),
        logit_rows=ends[1:] - 1,
    )
    assert cost.step_flops(plan) == pytest.approx(counted - masked, rel=0.01)


def test_step_bytes_and_floor():
    """Weights once plus the KV of every token attended to; the floor is the larger of the
    two times."""
    from tapserve.ranks.plan import StepKind, StepPlan

    cost = ModelCost(1000, 10, 5, kv_bytes_per_token=2, attention_flops_per_pair=4)
    plan = StepPlan(
        StepKind.DECODE,
        input_ids=np.zeros(2, np.int64),
        query_start_loc=np.array([0, 1, 2], np.int32),
        context_lens=np.array([7, 9], np.int32),
        logit_rows=np.array([0, 1]),
    )
    assert cost.step_bytes(plan) == 1000 + 2 * 16
    assert cost.step_flops(plan) == 2 * 10 * 2 + 2 * 5 * 2 + 4 * 16
    assert cost.step_floor(plan, bytes_per_s=1032.0, flops_per_s=1e9) == pytest.approx(1.0)
    assert cost.step_floor(plan, bytes_per_s=1e9, flops_per_s=124.0) == pytest.approx(1.0)
