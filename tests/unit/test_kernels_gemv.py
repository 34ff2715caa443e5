"""The Triton GEMV (model/kernels/gemv.py) against F.linear.

* CPU under the Triton interpreter (one subprocess, tests/helpers/interpreter.py): small shapes,
  ragged K and N, bias, 1 to 8 rows, every dtype the kernel takes.
* CUDA (`gpu`, skipped without it): the model's shapes with the configs the layers use, the
  `linear` dispatch of model/layers.py (few rows -> GEMV, more rows or fp32 -> cuBLAS), and a
  CUDA-graph capture + replay.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.interpreter import OLD_INTERPRETER, run_checks

HAS_TRITON = importlib.util.find_spec("triton") is not None
GEMV_TABLE = Path(__file__).resolve().parents[2] / "model" / "kernels" / "gemv_configs.json"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def check_gemv(
    rows: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    device: str,
    bias: bool = False,
    config=None,
    seed: int = 0,
) -> None:
    from tapserve.model.kernels.gemv import DEFAULT_CONFIG, gemv, gemv_config

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if bias else None
    config = config or gemv_config(n, k, rows) or DEFAULT_CONFIG
    out = gemv(x, w, b, config)
    # the reference in fp32 from the same rounded inputs; the kernel accumulates in fp32 and
    # rounds once, so the error is the output's own rounding plus summation order
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.shape == (rows, n) and out.dtype == dtype
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    if device == "cpu" and dtype == torch.bfloat16:
        rtol = 4e-2  # the interpreter rounds fp32 -> bf16 by truncation
    torch.testing.assert_close(
        out.float(),
        ref,
        rtol=rtol,
        atol=rtol * 2,
        msg=f"gemv rows={rows} n={n} k={k} {dtype} {config}",
    )
    x3 = x.view(rows, 1, k)
    assert gemv(x3, w, b, config).shape == (rows, 1, n)
    dest = torch.full((rows, 1, n), float("nan"), device=device, dtype=dtype)
    assert gemv(x3, w, b, config, out=dest) is not None and torch.equal(dest.view(rows, n), out)
    with pytest.raises(ValueError, match="out"):  # the shape of x3's result, not x's
        gemv(x, w, b, config, out=dest)
    wide = torch.randn(rows, k + 24, generator=gen).to(device=device, dtype=dtype)
    x_strided = wide[:, 8 : 8 + k]  # rows k + 24 apart: the kernel's row stride
    torch.testing.assert_close(
        gemv(x_strided, w, b, config).float(),
        F.linear(x_strided.float(), w.float(), None if b is None else b.float()),
        rtol=rtol,
        atol=rtol * 2,
        msg=f"gemv strided x rows={rows}",
    )


# ---------------------------------------------------------------- CPU, Triton interpreter


def _cpu_shapes():
    from tapserve.model.kernels.gemv import GemvConfig

    small = GemvConfig(block_n=8, block_k=64, num_warps=4)
    for i, dtype in enumerate([torch.float32, torch.float16, torch.bfloat16]):
        check_gemv(1, 64, 256, dtype, "cpu", config=small, seed=i)  # even K
        check_gemv(3, 50, 200, dtype, "cpu", bias=True, config=small, seed=i)  # ragged N and K
        check_gemv(8, 24, 64, dtype, "cpu", config=small, seed=i)  # MAX_ROWS
        check_gemv(5, 16, 100, dtype, "cpu", config=GemvConfig(4, 128, 2), seed=i)  # K < block
        each = GemvConfig(block_n=4, block_k=64, num_warps=1, reduce_each=True)
        check_gemv(1, 64, 256, dtype, "cpu", config=each, seed=i)  # tiles summed as they come
        check_gemv(3, 50, 200, dtype, "cpu", bias=True, config=each, seed=i)


def _cpu_refusals():
    from tapserve.model.kernels.gemv import MAX_ROWS, gemv

    w = torch.randn(16, 32)
    for bad_x, bad_w in [
        (torch.randn(MAX_ROWS + 1, 32), w),
        (torch.randn(1, 32), w.t()),
        (torch.randn(1, 31), w),
    ]:
        with pytest.raises(ValueError):
            gemv(bad_x, bad_w)


CPU_CHECKS = {"shapes": _cpu_shapes, "refusals": _cpu_refusals}


@pytest.fixture(scope="module")
def cpu_results() -> dict[str, str]:
    return run_checks("tests.unit.test_kernels_gemv")


@needs_triton
@pytest.mark.parametrize("name", sorted(CPU_CHECKS))
def test_gemv_interpreter_cpu(name: str, cpu_results: dict[str, str]) -> None:
    if OLD_INTERPRETER and name == "shapes":
        pytest.skip("Triton < 3.9 interpreter: no loop bound from a kernel argument")
    assert cpu_results[name] == "", cpu_results[name]


def test_linear_into_out_on_cpu() -> None:
    from tapserve.model.layers import linear

    x, w = torch.randn(3, 8), torch.randn(5, 8)
    out = torch.full((3, 5), float("nan"))
    assert linear(x, w, out=out) is out and torch.equal(out, F.linear(x, w))


def test_linear_on_cpu_is_torch() -> None:
    """CPU tensors never take the kernel: `linear` is F.linear there, bit for bit."""
    from tapserve.model.layers import linear

    x, w, b = torch.randn(1, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


@needs_triton
def test_gemv_config_measured_shapes_and_wide_weights() -> None:
    """Every linear of the reference models at TP 1 and 2 (bench/gemv.py's shapes of each
    config.json) and the 8B models' LM heads take a measured config at one row; more rows
    never do. Other weights of WIDE_ROWS rows or more (qwen3-32b's LM head) stay on cuBLAS."""
    from tapserve.bench.gemv import linear_shapes
    from tapserve.model.kernels.gemv import DEFAULT_CONFIG, MEASURED_CONFIGS, WIDE_ROWS, gemv_config

    configs = Path(__file__).resolve().parents[2] / "bench" / "configs"
    for model in ("qwen3-0.6b", "qwen3-8b", "qwen3-32b", "llama-3.1-8b"):
        config = json.loads((configs / f"{model}.json").read_text())
        for tp in (1, 2):
            for name, (n, k) in linear_shapes(config, tp).items():
                if name != "lm_head" or "8b" in model:
                    assert MEASURED_CONFIGS[(n, k)] is not None, (model, tp, name)
                    assert gemv_config(n, k, 1) is MEASURED_CONFIGS[(n, k)]
                    assert gemv_config(n, k, 2) in (DEFAULT_CONFIG, None)
    assert gemv_config(WIDE_ROWS, 4000, 1) is None and gemv_config(151936, 5120, 1) is None
    assert gemv_config(WIDE_ROWS - 1, 4000, 1) is DEFAULT_CONFIG


@needs_triton
def test_measured_config_table_is_read_strictly(tmp_path) -> None:
    """The table's entries: a config's fields, or {"cublas": true} (cuBLAS won: None), each
    with its measured notes; an unknown field is an error, not a silent fallback."""
    from tapserve.model.kernels.gemv import GemvConfig, load_measured_configs

    notes = {"tbs": 4.0, "cublas_tbs": 3.0, "linear": "x"}
    table = {
        "sources": [],
        "configs": {
            "64x128": {
                "block_n": 2,
                "block_k": 512,
                "num_warps": 1,
                "num_stages": 1,
                "reduce_each": True,
                **notes,
            },
            "128x64": {"cublas": True, **notes},
        },
    }
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    assert dict(load_measured_configs(path)) == {
        (64, 128): GemvConfig(2, 512, 1, 1, True),
        (128, 64): None,
    }
    table["configs"]["64x128"]["reduce_eac"] = True
    path.write_text(json.dumps(table))
    with pytest.raises(TypeError):
        load_measured_configs(path)


@needs_triton
def test_pdl_is_off_for_cpu_tensors() -> None:
    """The interpreter has no grid dependency control: CPU launches never ask for PDL."""
    from tapserve.model.kernels.pdl import pdl_options

    assert pdl_options(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}


# ---------------------------------------------------------------- CUDA

# (N, K) of qwen3-8b's linears at TP 1 and 2, qwen3-0.6b's, an LM head, a small odd one, and
# every shape of the measured table (its configs)
TABLE_SHAPES = [
    tuple(map(int, shape.split("x"))) for shape in json.loads(GEMV_TABLE.read_text())["configs"]
]
MODEL_SHAPES = sorted(
    {
        (6144, 4096),
        (4096, 4096),
        (24576, 4096),
        (4096, 12288),
        (151936, 4096),
        (3072, 4096),
        (4096, 2048),
        (4096, 6144),
        (4096, 1024),
        (1024, 2048),
        (200, 72),
        *TABLE_SHAPES,
    }
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", MODEL_SHAPES)
def test_gemv_model_shapes_cuda(n: int, k: int) -> None:
    for rows in (1, 2, 3, 4, 8):
        check_gemv(rows, n, k, torch.bfloat16, "cuda", bias=rows == 3, seed=rows)
    for rows in (1, 2):  # one row: the table's config, measured in bf16
        check_gemv(rows, n, k, torch.float16, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_linear_dispatch_and_graph_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """One row of a 16-bit model takes the GEMV; two rows, fp32 and wide weights of shapes
    not measured take cuBLAS exactly; a captured GEMV replays with new inputs. Run without
    TAPSERVE_GEMV_MAX_ROWS: it pins the default (one row). Which path ran is counted, not
    inferred from the bits: the GEMV and cuBLAS sum in different orders, yet their bf16
    results are often equal to the last bit."""
    import tapserve.model.kernels.gemv as gemv_module
    from tapserve.model.kernels.gemv import WIDE_ROWS
    from tapserve.model.layers import GEMV_MAX_ROWS, linear

    assert GEMV_MAX_ROWS == 1
    calls = []
    kernel = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    two = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(two, w), F.linear(two, w))
    w32, x32 = w.float(), two[:1].float()
    assert torch.equal(linear(x32, w32), F.linear(x32, w32))
    # wide and not in the measured table
    wide = torch.randn(WIDE_ROWS + 16, 4096, device="cuda", dtype=torch.bfloat16) / 64
    assert torch.equal(linear(two[:1], wide), F.linear(two[:1], wide))
    assert not calls
    torch.testing.assert_close(
        linear(two[:1], w).float(), F.linear(two[:1], w).float(), rtol=1.6e-2, atol=3e-2
    )
    assert len(calls) == 1  # the kernel ran
    x = torch.zeros(1, 4096, device="cuda", dtype=torch.bfloat16)
    linear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear(x, w)
    x.copy_(two[:1])
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(
        y.float(), F.linear(two[:1].float(), w.float()), rtol=1.6e-2, atol=3e-2
    )
