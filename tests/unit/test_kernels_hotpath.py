"""Hot-path Triton kernels (model/kernels/{norm,rotary,activation}.py) against the torch code of
model/layers.py and model/rotary.py.

Two modes, as tests/unit/test_kernels.py:
  * CPU under the Triton interpreter: small cases in one subprocess with TRITON_INTERPRET=1 set
    before triton is imported (skipped when triton is not installed). The interpreter rounds
    fp32 -> bf16 by truncation (the GPU rounds to nearest even), so bf16 gets a looser bound
    there; fp32 and fp16 are held tight.
  * CUDA (`@pytest.mark.gpu`, skipped without CUDA): model shapes, bf16 / fp16 / fp32, the
    module dispatch (RMSNorm / SiluAndMul / RotaryEmbedding take the kernels on CUDA) and a
    CUDA-graph capture + replay of all of them.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tapserve.model.layers import RMSNorm, SiluAndMul, use_triton
from tapserve.model.rotary import RotaryEmbedding, _apply, rotary_with_qk_norm
from tests.helpers.interpreter import run_checks

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
EPS = 1e-6

# ---------------------------------------------------------------- torch references (any device)


def ref_rms_norm(x, weight, eps, residual=None):
    """The torch code of RMSNorm.forward, callable on CUDA tensors too."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, residual)


def ref_rotary(q, k, cos_cache, sin_cache, positions):
    cos, sin = cos_cache[positions].unsqueeze(1), sin_cache[positions].unsqueeze(1)
    return _apply(q, cos, sin), _apply(k, cos, sin)


def ref_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# (rtol, atol) per dtype; "interp" for bf16 under the interpreter (truncating casts)
TOLS = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}
INTERP_BF16 = (4e-2, 3e-2)


def _close(out, ref, what, tol):
    rtol, atol = tol
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        f"{what}: {tuple(out.shape)} {out.dtype} vs {tuple(ref.shape)} {ref.dtype}"
    )
    assert torch.isfinite(out.float()).all(), f"{what}: non-finite output"
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol, msg=what)


def _tol(dtype, interp):
    return INTERP_BF16 if interp and dtype == torch.bfloat16 else TOLS[dtype]


def _rand(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


# ---------------------------------------------------------------- checks (CPU or CUDA)


def check_norm(hidden, rows, dtype, device, seed=0, interp=False):
    from tapserve.model.kernels import fused_add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(seed)
    tol = _tol(dtype, interp)
    w = _rand(hidden, dtype, device, gen)
    x = _rand((rows, hidden), dtype, device, gen, 3.0)
    r = _rand((rows, hidden), dtype, device, gen)
    what = f"hidden={hidden} rows={rows} {dtype}"
    _close(rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS), f"rms_norm {what}", tol)
    x0, r0 = x.clone(), r.clone()
    out, res = fused_add_rms_norm(x, r, w, EPS)
    assert torch.equal(x, x0) and torch.equal(r, r0), "fused_add_rms_norm modified its inputs"
    ref_out, ref_res = ref_rms_norm(x, w, EPS, r)
    _close(out, ref_out, f"fused_add_rms_norm {what}", tol)
    if not (interp and dtype == torch.bfloat16):  # one rounding of x + r: exact elsewhere
        assert torch.equal(res, ref_res), f"fused residual {what}"
    else:
        _close(res, ref_res, f"fused residual {what}", tol)
    # `out=` honoured, 3 leading dims, 1-D input, zero rows
    buf = torch.empty_like(x)
    assert rms_norm(x, w, EPS, out=buf) is buf
    _close(buf, ref_rms_norm(x, w, EPS), f"rms_norm out= {what}", tol)
    x4 = _rand((2, 3, 2, hidden), dtype, device, gen)
    _close(rms_norm(x4, w, EPS), ref_rms_norm(x4, w, EPS), f"rms_norm 4-D {what}", tol)
    _close(rms_norm(x[0], w, EPS), ref_rms_norm(x[0], w, EPS), f"rms_norm 1-D {what}", tol)
    assert rms_norm(x[:0], w, EPS).shape == (0, hidden)


def check_head_norm(tokens, heads, kv_heads, head_dim, dtype, device, seed=0, interp=False):
    """Per-head norm of q / k taken as strided views of a fused QKV output (no copy)."""
    from tapserve.model.kernels import rms_norm

    gen = torch.Generator().manual_seed(seed)
    tol = _tol(dtype, interp)
    qkv = _rand((tokens, (heads + 2 * kv_heads) * head_dim), dtype, device, gen, 2.0)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    w = _rand(head_dim, dtype, device, gen)
    for name, t in (("q", q), ("k", k)):
        _close(
            rms_norm(t, w, EPS),
            ref_rms_norm(t, w, EPS),
            f"head norm {name} T={tokens} H={t.shape[1]} D={head_dim} {dtype}",
            tol,
        )


def _qkv_views(tokens, heads, kv_heads, head_dim, dtype, device, gen):
    qkv = _rand((tokens, (heads + 2 * kv_heads) * head_dim), dtype, device, gen, 2.0)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return q, k


def check_rotary(
    tokens,
    heads,
    kv_heads,
    head_dim,
    dtype,
    device,
    seed=0,
    interp=False,
    max_pos=4096,
    scaling=None,
):
    from tapserve.model.kernels import apply_rotary, qk_norm_rotary

    gen = torch.Generator().manual_seed(seed)
    tol = _tol(dtype, interp)
    rope = RotaryEmbedding(head_dim, max_pos, 1e6 if scaling is None else 5e5, scaling).to(device)
    q, k = _qkv_views(tokens, heads, kv_heads, head_dim, dtype, device, gen)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    positions[:1] = max_pos - 1
    what = f"T={tokens} H={heads}/{kv_heads} D={head_dim} {dtype}"
    q0, k0 = q.clone(), k.clone()
    ref_q, ref_k = ref_rotary(q, k, rope.cos, rope.sin, positions)
    for pos in (positions, positions.to(torch.int32)):
        out_q, out_k = apply_rotary(q, k, rope.cos, rope.sin, pos)
        _close(out_q, ref_q, f"rotary q {what}", tol)
        _close(out_k, ref_k, f"rotary k {what}", tol)
    assert torch.equal(q, q0) and torch.equal(k, k0), "apply_rotary modified its inputs"
    # fused Qwen3 q/k norm + rotary: the model uses it for bf16 and fp32 only (in fp16 it rounds
    # once where the unfused path rounds twice, which exceeds the fp16 tolerance on the H200)
    if dtype == torch.float16:
        return
    qw, kw = _rand(head_dim, dtype, device, gen), _rand(head_dim, dtype, device, gen)
    ref_q, ref_k = ref_rotary(
        ref_rms_norm(q, qw, EPS), ref_rms_norm(k, kw, EPS), rope.cos, rope.sin, positions
    )
    out_q, out_k = qk_norm_rotary(q, k, qw, kw, EPS, rope.cos, rope.sin, positions)
    _close(out_q, ref_q, f"qk_norm_rotary q {what}", tol)
    _close(out_k, ref_k, f"qk_norm_rotary k {what}", tol)
    empty = apply_rotary(q[:0], k[:0], rope.cos, rope.sin, positions[:0])
    assert empty[0].shape == (0, heads, head_dim) and empty[1].shape == (0, kv_heads, head_dim)


def check_rotary_store(
    tokens, heads, kv_heads, head_dim, dtype, device, seed=0, page=16, slot_dtype=torch.int64
):
    """The rotary kernel that also stores k and v (model.rotary.rotary_into_cache's) equals
    rotary then store_kv bit for bit: the same q, and the same cache (slot -1 rows skipped,
    every other slot untouched), with and without Qwen3's q/k norm. k is a view of a fused
    QKV output; v and the v cache have layouts of their own (other strides than k's), so a
    stride taken for the other tensor's shows."""
    from tapserve.model.attention import store_kv
    from tapserve.model.kernels import apply_rotary, qk_norm_rotary
    from tapserve.model.kernels.rotary import KVStore, qk_norm_rotary_store, rotary_store

    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(head_dim, 2048, 1e6, None).to(device)
    qk = _rand((tokens, (heads + kv_heads) * head_dim), dtype, device, gen, 2.0)
    q, k = qk.split([heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = (x.view(tokens, -1, head_dim) for x in (q, k))
    v = _rand((tokens, kv_heads + 1, head_dim + 8), dtype, device, gen)[:, 1:, 4:-4]
    positions = torch.randint(0, 2048, (tokens,), generator=gen).to(device)
    num_blocks = tokens // page + 3
    slots = torch.randperm(num_blocks * page, generator=gen)[:tokens]
    slots[::3] = -1
    slots = slots.to(device=device, dtype=slot_dtype)
    k_cache0 = _rand((num_blocks, page, kv_heads, head_dim), dtype, device, gen)
    v_padded = _rand((num_blocks, page, kv_heads, head_dim + 16), dtype, device, gen)
    qw, kw = _rand(head_dim, dtype, device, gen), _rand(head_dim, dtype, device, gen)
    what = f"T={tokens} H={heads}/{kv_heads} D={head_dim} {dtype} slots {slot_dtype}"
    for norm in (False, True):
        if norm:
            want_q, want_k = qk_norm_rotary(q, k, qw, kw, EPS, rope.cos, rope.sin, positions)
        else:
            want_q, want_k = apply_rotary(q, k, rope.cos, rope.sin, positions)
        # the v caches: views of padded rows (clone() of a view would make it contiguous)
        want_kc, want_vc = k_cache0.clone(), v_padded.clone()[..., :head_dim]
        store_kv(want_k, v, want_kc, want_vc, slots.long())
        k_cache, v_cache = k_cache0.clone(), v_padded.clone()[..., :head_dim]
        store = KVStore(v, k_cache, v_cache, slots)
        got_q = (
            qk_norm_rotary_store(q, k, qw, kw, EPS, rope.cos, rope.sin, positions, store)
            if norm
            else rotary_store(q, k, rope.cos, rope.sin, positions, store)
        )
        assert torch.equal(got_q, want_q), f"rotary_store q norm={norm} {what}"
        assert torch.equal(k_cache, want_kc), f"rotary_store k cache norm={norm} {what}"
        assert torch.equal(v_cache, want_vc), f"rotary_store v cache norm={norm} {what}"
    other = KVStore(
        v,
        k_cache0.to(torch.float16 if dtype != torch.float16 else torch.float32),
        v_padded[..., :head_dim],
        slots,
    )
    with pytest.raises(ValueError):  # one rounding, where rotary then store rounds twice
        rotary_store(q, k, rope.cos, rope.sin, positions, other)


def check_silu(rows, inter, dtype, device, seed=0, interp=False):
    from tapserve.model.kernels import silu_and_mul

    gen = torch.Generator().manual_seed(seed)
    tol = _tol(dtype, interp)
    x = _rand((rows, 2 * inter), dtype, device, gen, 3.0)
    what = f"rows={rows} I={inter} {dtype}"
    _close(silu_and_mul(x), ref_silu_and_mul(x), f"silu_and_mul {what}", tol)
    x3 = _rand((2, rows, 2 * inter + 6), dtype, device, gen)[..., 3:-3]  # strided rows
    _close(silu_and_mul(x3), ref_silu_and_mul(x3), f"silu_and_mul strided {what}", tol)
    buf = torch.empty(rows, inter, dtype=dtype, device=device)
    assert silu_and_mul(x, out=buf) is buf
    _close(buf, ref_silu_and_mul(x), f"silu_and_mul out= {what}", tol)
    assert silu_and_mul(x[:0]).shape == (0, inter)


# ---------------------------------------------------------------- CPU, Triton interpreter

CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cpu_norm():
    for i, dtype in enumerate(CPU_DTYPES):
        check_norm(96, 5, dtype, "cpu", seed=i, interp=True)  # not a power of two
        check_norm(256, 3, dtype, "cpu", seed=i + 3, interp=True)
        check_head_norm(3, 4, 2, 64, dtype, "cpu", seed=i, interp=True)


def _cpu_rotary():
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    for i, dtype in enumerate(CPU_DTYPES):
        check_rotary(5, 4, 2, 64, dtype, "cpu", seed=i, interp=True, max_pos=512)
        check_rotary(
            3, 6, 3, 128, dtype, "cpu", seed=i + 3, interp=True, max_pos=1024, scaling=llama3
        )  # non-power-of-two head counts


def _cpu_rotary_store():
    for i, dtype in enumerate(CPU_DTYPES):
        check_rotary_store(7, 4, 2, 64, dtype, "cpu", seed=i)
        check_rotary_store(5, 6, 3, 128, dtype, "cpu", seed=i + 3, page=32, slot_dtype=torch.int32)
        check_rotary_store(4, 8, 1, 64, dtype, "cpu", seed=i + 6, page=1)  # one KV head


def _cpu_silu():
    for i, dtype in enumerate(CPU_DTYPES):
        check_silu(3, 40, dtype, "cpu", seed=i, interp=True)
        check_silu(2, 1500, dtype, "cpu", seed=i + 3, interp=True)  # > one column block


CPU_CHECKS = {
    "norm": _cpu_norm,
    "rotary": _cpu_rotary,
    "rotary_store": _cpu_rotary_store,
    "silu": _cpu_silu,
}


@pytest.fixture(scope="module")
def cpu_results() -> dict[str, str]:
    """All interpreter checks once, in one subprocess (tests/helpers/interpreter.py)."""
    return run_checks("tests.unit.test_kernels_hotpath")


@needs_triton
@pytest.mark.parametrize("name", sorted(CPU_CHECKS))
def test_hotpath_interpreter_cpu(name: str, cpu_results: dict[str, str]) -> None:
    assert cpu_results[name] == "", cpu_results[name]


def test_cpu_modules_keep_torch_path() -> None:
    """CPU tensors never take a kernel: the modules equal the torch code bit for bit."""
    gen = torch.Generator().manual_seed(0)
    for dtype in CPU_DTYPES:
        x, r = _rand((4, 64), dtype, "cpu", gen), _rand((4, 64), dtype, "cpu", gen)
        assert not use_triton(x)
        norm = RMSNorm(64, EPS).to(dtype)
        norm.weight.data.copy_(_rand(64, dtype, "cpu", gen))
        assert torch.equal(norm(x), ref_rms_norm(x, norm.weight, EPS))
        out, res = norm(x, r)
        ref_out, ref_res = ref_rms_norm(x, norm.weight, EPS, r)
        assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
        assert torch.equal(SiluAndMul()(x), ref_silu_and_mul(x))
        rope = RotaryEmbedding(16, 32, 1e4, None)
        q, k = x.view(4, 4, 16), r.view(4, 4, 16)
        pos = torch.tensor([0, 5, 31, 2])
        for a, b in zip(rope(pos, q, k), ref_rotary(q, k, rope.cos, rope.sin, pos)):
            assert torch.equal(a, b)
        qn, kn = RMSNorm(16, EPS).to(dtype), RMSNorm(16, EPS).to(dtype)
        got = rotary_with_qk_norm(rope, pos, q, k, qn, kn)
        want = rope(pos, qn(q), kn(k))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------- CUDA, model shapes

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_norm_gpu(dtype: torch.dtype) -> None:
    for hidden in (896, 1024, 4096, 5120):
        for rows in (1, 2, 7, 256, 4099):
            check_norm(hidden, rows, dtype, "cuda", seed=rows)
    for tokens in (1, 33, 2048):
        check_head_norm(tokens, 32, 8, 128, dtype, "cuda")
        check_head_norm(tokens, 14, 2, 64, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_rotary_gpu(dtype: torch.dtype) -> None:
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    for tokens in (1, 3, 64, 4096):
        check_rotary(tokens, 32, 8, 128, dtype, "cuda", seed=tokens, max_pos=40960)
        check_rotary(tokens, 16, 8, 64, dtype, "cuda", seed=tokens, max_pos=4096)
        check_rotary(
            tokens, 32, 8, 128, dtype, "cuda", seed=tokens + 1, max_pos=16384, scaling=llama3
        )


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_rotary_store_gpu(dtype: torch.dtype) -> None:
    for tokens in (1, 3, 64, 4096):
        check_rotary_store(tokens, 32, 8, 128, dtype, "cuda", seed=tokens)
        check_rotary_store(tokens, 64, 8, 128, dtype, "cuda", seed=tokens, page=32)
        check_rotary_store(
            tokens, 16, 2, 64, dtype, "cuda", seed=tokens + 1, slot_dtype=torch.int32
        )
        check_rotary_store(tokens, 8, 1, 128, dtype, "cuda", seed=tokens + 2)  # one KV head


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_silu_gpu(dtype: torch.dtype) -> None:
    for inter in (3072, 4864, 12288, 14336):
        for rows in (1, 5, 512):
            check_silu(rows, inter, dtype, "cuda", seed=rows)


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_modules_dispatch_to_kernels_gpu() -> None:
    """On CUDA the modules run the kernels (same results as calling them directly)."""
    from tapserve.model.kernels import (
        apply_rotary,
        fused_add_rms_norm,
        qk_norm_rotary,
        rms_norm,
        silu_and_mul,
    )

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    x, r = _rand((9, 4096), dtype, "cuda", gen), _rand((9, 4096), dtype, "cuda", gen)
    assert use_triton(x)
    norm = RMSNorm(4096, EPS).to(device="cuda", dtype=dtype)
    assert torch.equal(norm(x), rms_norm(x, norm.weight, EPS))
    for a, b in zip(norm(x, r), fused_add_rms_norm(x, r, norm.weight, EPS)):
        assert torch.equal(a, b)
    assert torch.equal(SiluAndMul()(x), silu_and_mul(x))
    rope = RotaryEmbedding(128, 1024, 1e6, None).cuda()
    q, k = _qkv_views(9, 32, 8, 128, dtype, "cuda", gen)
    pos = torch.arange(9, device="cuda") * 7
    for a, b in zip(rope(pos, q, k), apply_rotary(q, k, rope.cos, rope.sin, pos)):
        assert torch.equal(a, b)
    qn = RMSNorm(128, EPS).to(device="cuda", dtype=dtype)
    kn = RMSNorm(128, EPS).to(device="cuda", dtype=dtype)
    got = rotary_with_qk_norm(rope, pos, q, k, qn, kn)
    want = qk_norm_rotary(q, k, qn.weight, kn.weight, EPS, rope.cos, rope.sin, pos)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_hotpath_cuda_graph_replay() -> None:
    """Capture norm + fused norm + q/k-norm rotary + rotary + silu once; replay on new data."""
    from tapserve.model.kernels import (
        apply_rotary,
        fused_add_rms_norm,
        qk_norm_rotary,
        rms_norm,
        silu_and_mul,
    )

    gen = torch.Generator().manual_seed(0)
    dtype, t = torch.bfloat16, 4
    x, r = _rand((t, 4096), dtype, "cuda", gen), _rand((t, 4096), dtype, "cuda", gen)
    w = _rand(4096, dtype, "cuda", gen)
    q, k = _qkv_views(t, 32, 8, 128, dtype, "cuda", gen)
    qw, kw = _rand(128, dtype, "cuda", gen), _rand(128, dtype, "cuda", gen)
    g = _rand((t, 2 * 12288), dtype, "cuda", gen)
    rope = RotaryEmbedding(128, 4096, 1e6, None).cuda()
    pos = torch.zeros(t, dtype=torch.int64, device="cuda")

    def step():
        return (
            rms_norm(x, w, EPS),
            *fused_add_rms_norm(x, r, w, EPS),
            *qk_norm_rotary(q, k, qw, kw, EPS, rope.cos, rope.sin, pos),
            *apply_rotary(q, k, rope.cos, rope.sin, pos),
            silu_and_mul(g),
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        for buf in (x, r, q, k, g):
            buf.copy_(_rand(buf.shape, dtype, "cuda", gen))
        pos.copy_(torch.randint(0, 4096, (t,), generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        for i, (a, b) in enumerate(zip(outs, want)):
            assert torch.equal(a, b), f"graph output {i} differs from eager (seed {seed})"
