"""Triton kernels (model/kernels) against the torch reference (model/attention.py).

Two modes:
  * CUDA (`@pytest.mark.gpu`, skipped without CUDA): full sizes, contexts up to 8K, bf16 / fp16 /
    fp32, plus a CUDA-graph capture of decode.
  * CPU under the Triton interpreter: a small case set run in a subprocess with
    TRITON_INTERPRET=1 set before triton is imported (skipped when triton is not installed).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from tapserve.model.attention import AttentionMetadata, reference_attention, store_kv
from tests.helpers.interpreter import OLD_INTERPRETER, run_checks

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

# (num_kv_heads, group, head_dim, block_size)
GPU_SHAPES = [
    (8, 1, 128, 16),
    (8, 4, 128, 32),
    (4, 8, 128, 16),
    (2, 4, 64, 16),
    (4, 8, 64, 32),
    (16, 1, 64, 32),
]
TOLS = {torch.float32: 2e-4, torch.float16: 6e-3, torch.bfloat16: 2e-2}


def _make_case(
    ctx_lens: list[int],
    q_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    q_stride_pad: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q [T, H, D], random paged caches with shuffled, non-contiguous block tables, and
    the metadata of a step whose sequence i has ctx_lens[i] tokens, the last q_lens[i] new.
    q_stride_pad > 0 makes q a strided view (as when sliced from a fused QKV output)."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = [(c + block_size - 1) // block_size for c in ctx_lens]
    num_blocks = sum(n_blocks) + 7  # spare blocks hold garbage that must never be read
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(n_blocks) + 2
    block_tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(n_blocks):
        block_tables[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    heads = num_kv_heads * group
    total = sum(q_lens)
    q_full = torch.randn(total, heads, head_dim + q_stride_pad, generator=gen).to(dtype)
    q = q_full.to(device)[:, :, :head_dim]  # slice on the device so q stays strided
    slots = []
    for i, (c, ql) in enumerate(zip(ctx_lens, q_lens)):
        for pos in range(c - ql, c):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    starts = [0]
    for ql in q_lens:
        starts.append(starts[-1] + ql)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        is_decode=all(ql == 1 for ql in q_lens),
        query_start_loc_host=starts,
        context_lens_host=list(ctx_lens),
    )
    return q, k_cache.to(device), v_cache.to(device), meta


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The torch reference in float32 (from the same, already rounded inputs)."""
    return reference_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOLS[dtype]
    err = (out.float() - ref).abs().max().item()
    assert torch.isfinite(out.float()).all(), f"{what}: non-finite output"
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol}"


def check_decode(
    ctx_lens: list[int],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: str,
    num_kv_splits: int,
    seed: int = 0,
    strided: bool = False,
) -> None:
    from tapserve.model.kernels import longest_first, paged_decode_attention

    num_kv_heads, group, head_dim, block_size = shape
    q, k_cache, v_cache, meta = _make_case(
        ctx_lens,
        [1] * len(ctx_lens),
        num_kv_heads,
        group,
        head_dim,
        block_size,
        dtype,
        device,
        seed,
        q_stride_pad=8 if strided else 0,
    )
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.context_lens,
        scale,
        num_kv_splits=num_kv_splits,
    )
    _check(
        out,
        _reference(q, k_cache, v_cache, meta, scale),
        dtype,
        f"decode ctx={ctx_lens} shape={shape} {dtype} splits={num_kv_splits}",
    )
    order = longest_first(meta.context_lens)
    if len(ctx_lens) < 2:
        assert order is None
        return
    assert sorted(order.tolist()) == list(range(len(ctx_lens)))
    assert meta.context_lens[order].tolist() == sorted(ctx_lens, reverse=True)
    ordered = paged_decode_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.context_lens,
        scale,
        num_kv_splits=num_kv_splits,
        seq_order=order,
    )
    assert torch.equal(ordered, out), "the launch order changed the numbers"


def check_decode_workspace_reuse(device: str) -> None:
    """One workspace over launches of other batches and contexts, at 4 splits and at 1 (which
    writes the output itself and leaves the workspace alone)."""
    from tapserve.model.kernels import make_decode_workspace, paged_decode_attention

    for splits in (4, 1):
        ws = make_decode_workspace(4, 8, 64, splits, device)
        for seed, lens in enumerate(([7, 90, 33, 1], [64, 0, 5], [130])):
            q, k_cache, v_cache, meta = _make_case(
                lens, [1] * len(lens), 2, 4, 64, 16, torch.float32, device, seed
            )
            out = paged_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                0.125,
                num_kv_splits=splits,
                workspace=ws,
            )
            _check(
                out,
                _reference(q, k_cache, v_cache, meta, 0.125),
                torch.float32,
                f"decode reusing a workspace, splits={splits}, ctx={lens}",
            )


def check_extend(
    prefix_lens: list[int],
    q_lens: list[int],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    strided: bool = False,
) -> None:
    from tapserve.model.kernels import extend_attention

    num_kv_heads, group, head_dim, block_size = shape
    ctx_lens = [p + ql for p, ql in zip(prefix_lens, q_lens)]
    q, k_cache, v_cache, meta = _make_case(
        ctx_lens,
        q_lens,
        num_kv_heads,
        group,
        head_dim,
        block_size,
        dtype,
        device,
        seed,
        q_stride_pad=8 if strided else 0,
    )
    scale = head_dim**-0.5
    out = extend_attention(
        q, k_cache, v_cache, meta.query_start_loc, meta.context_lens, meta.block_tables, scale
    )
    _check(
        out,
        _reference(q, k_cache, v_cache, meta, scale),
        dtype,
        f"extend prefix={prefix_lens} q={q_lens} shape={shape} {dtype}",
    )


def check_extend_subset(device: str) -> None:
    """A work list over some sequences computes exactly their rows and leaves the others'."""
    import numpy as np

    from tapserve.model.kernels import extend_attention
    from tapserve.model.kernels.extend import extend_config, extend_work

    q_lens, prefix_lens = [3, 1, 40, 1, 17], [5, 30, 0, 7, 16]
    ctx_lens = [p + ql for p, ql in zip(prefix_lens, q_lens)]
    q, k_cache, v_cache, meta = _make_case(ctx_lens, q_lens, 2, 2, 64, 16, torch.float32, device)
    block_m = extend_config(4, 64)[0]
    chosen = np.array([0, 2, 4])
    work = torch.from_numpy(extend_work(np.array(q_lens), block_m, chosen)).to(device)
    out = torch.full_like(q, 7.0)
    extend_attention(
        q,
        k_cache,
        v_cache,
        meta.query_start_loc,
        meta.context_lens,
        meta.block_tables,
        0.125,
        out=out,
        work=work,
    )
    ref = _reference(q, k_cache, v_cache, meta, 0.125)
    starts = meta.query_start_loc_host
    for i in range(len(q_lens)):
        rows = slice(starts[i], starts[i + 1])
        if i in chosen:
            _check(out[rows], ref[rows], torch.float32, f"extend subset, sequence {i}")
        else:
            assert torch.equal(out[rows], torch.full_like(out[rows], 7.0)), f"sequence {i} written"


def check_backend_mixed(device: str, dtype: torch.dtype = torch.float32) -> None:
    """Non-decode steps through the Triton backend: one-row sequences (decoding rows) go to
    the decode kernel, the rest over the extend work list; a second layer reuses the step's
    split; a step of one-row sequences only, and a sequence with no new rows."""
    from tapserve.model.triton_backend import make_triton_backend

    backend = make_triton_backend(16, 8, 64, 1024, torch.device(device), num_sms=132)
    steps = [
        ([1, 40, 1, 1, 17, 1], [70, 0, 5, 130, 16, 1]),  # mixed
        ([1, 1, 1], [3, 64, 200]),  # one-row sequences only
        ([5, 0, 1], [0, 9, 20]),
    ]  # a sequence with no rows this step
    for seed, (q_lens, prefix) in enumerate(steps):
        ctx = [p + ql for p, ql in zip(prefix, q_lens)]
        q, k_cache, v_cache, meta = _make_case(
            ctx, q_lens, 2, 4, 64, 16, dtype, device, seed, q_stride_pad=8
        )
        meta.is_decode = False  # a prefill or mixed plan, whatever its rows
        ref = _reference(q, k_cache, v_cache, meta, 0.125)
        for layer in range(2):  # the second reuses the split made by the first
            out = backend.extend(q, k_cache, v_cache, meta, 0.125)
            _check(out, ref, dtype, f"backend step {q_lens} layer {layer}")
        (split,) = meta.backend_state.values()
        one_row = [i for i, n in enumerate(q_lens) if n == 1]
        starts = meta.query_start_loc_host
        rows = [] if split.decode_rows is None else split.decode_rows.tolist()
        assert rows == [starts[i] for i in one_row], (rows, one_row)
        assert sorted(set(split.work[:, 0].tolist())) == [i for i, n in enumerate(q_lens) if n > 1]


def check_store(
    num_tokens: int,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> None:
    from tapserve.model.kernels import store_kv_cache

    num_kv_heads, _, head_dim, block_size = shape
    gen = torch.Generator().manual_seed(seed)
    num_blocks = (num_tokens + block_size - 1) // block_size + 3
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    # k/v as strided slices of one fused tensor; every third row padded (slot -1)
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    slots = slots.to(device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, ref_k, ref_v, slots)
    store_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), f"store {shape} {dtype}"
    store_kv_cache(k, v, k_cache, v_cache, slots.to(torch.int32))  # int32 slots, idempotent
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# ---------------------------------------------------------------- CPU, Triton interpreter

CPU_DECODE_CTX = [1, 15, 16, 17, 33, 70]


def _cpu_store() -> None:
    check_store(20, (2, 1, 64, 16), torch.float32, "cpu")
    check_store(9, (1, 1, 128, 32), torch.bfloat16, "cpu", seed=1)


def check_longest_first(device: str) -> None:
    """The launch order: descending context, ties in row order (numpy's stable argsort of
    the negated lengths), over several BLOCK-sized chunks of rows."""
    from tapserve.model.kernels import longest_first

    gen = torch.Generator().manual_seed(0)
    for n in (2, 3, 64, 150):
        lens = torch.randint(0, 12, (n,), generator=gen, dtype=torch.int32)  # many ties
        want = np.argsort(-lens.numpy(), kind="stable")
        assert longest_first(lens.to(device)).tolist() == want.tolist(), f"n={n}"
    assert longest_first(torch.ones(1, dtype=torch.int32, device=device)) is None


def _cpu_decode() -> None:
    check_longest_first("cpu")
    check_decode(CPU_DECODE_CTX, (2, 1, 64, 16), torch.float32, "cpu", num_kv_splits=4)
    check_decode(
        CPU_DECODE_CTX, (2, 4, 128, 32), torch.float32, "cpu", num_kv_splits=3, seed=1, strided=True
    )
    check_decode([1, 40, 130], (1, 8, 64, 16), torch.float16, "cpu", num_kv_splits=16, seed=2)
    check_decode(CPU_DECODE_CTX, (2, 4, 64, 16), torch.float32, "cpu", num_kv_splits=1, seed=3)
    check_decode_workspace_reuse("cpu")
    # a padded CUDA-graph row (context 0) must give zeros, not NaN
    from tapserve.model.kernels import paged_decode_attention

    q, k_cache, v_cache, meta = _make_case([5, 1], [1, 1], 1, 4, 64, 16, torch.float32, "cpu")
    out = paged_decode_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        torch.tensor([5, 0], dtype=torch.int32),
        0.125,
        num_kv_splits=2,
    )
    assert torch.equal(out[1], torch.zeros_like(out[1])), "context 0 row must be zeros"


def _cpu_extend() -> None:
    check_extend([0, 0, 20, 33], [1, 37, 5, 40], (2, 1, 64, 16), torch.float32, "cpu")
    check_extend(
        [16, 0, 3], [16, 33, 1], (2, 4, 128, 32), torch.float32, "cpu", seed=1, strided=True
    )
    check_extend([0, 47], [70, 2], (1, 8, 64, 16), torch.float16, "cpu", seed=2)
    check_extend_subset("cpu")
    check_backend_mixed("cpu")


def _cpu_triton_available() -> None:
    from tapserve.model.kernels import triton_available

    assert triton_available("cpu"), "triton_available('cpu') False"


CPU_CHECKS = {
    "store": _cpu_store,
    "decode": _cpu_decode,
    "extend": _cpu_extend,
    "triton_available": _cpu_triton_available,
}


@pytest.fixture(scope="module")
def cpu_results() -> dict[str, str]:
    """All interpreter checks once, in one subprocess (tests/helpers/interpreter.py)."""
    return run_checks("tests.unit.test_kernels")


@needs_triton
@pytest.mark.parametrize("name", sorted(CPU_CHECKS))
def test_kernels_interpreter_cpu(name: str, cpu_results: dict[str, str]) -> None:
    if name in ("decode", "extend") and OLD_INTERPRETER:
        pytest.skip("Triton < 3.9 interpreter: no loop bounds from loaded values")
    assert cpu_results[name] == "", cpu_results[name]


def test_triton_available_reports_bool() -> None:
    from tapserve.model.kernels import triton_available

    assert isinstance(triton_available(), bool)
    if not HAS_TRITON:
        assert not triton_available("cpu")


# ---------------------------------------------------------------- CUDA, full sizes

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_decode_gpu(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    ctx = [1, 2, 15, 16, 17, 31, 32, 33, 100, 511, 1024, 1025, 4097, 8192]
    check_decode(ctx, shape, dtype, "cuda", num_kv_splits=16)
    check_decode(ctx[::-1][:6], shape, dtype, "cuda", num_kv_splits=5, seed=1, strided=True)
    check_decode(ctx, shape, dtype, "cuda", num_kv_splits=64, seed=2)  # a small batch's count
    check_decode(ctx, shape, dtype, "cuda", num_kv_splits=2, seed=3)  # a large batch's count
    check_decode(ctx, shape, dtype, "cuda", num_kv_splits=1, seed=4)
    check_longest_first("cuda")


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_extend_gpu(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    prefix = [0, 0, 0, 16, 33, 100, 1000, 4096, 0, 7000]
    q_lens = [1, 17, 300, 16, 64, 1, 129, 1000, 2048, 1192]
    check_extend(prefix, q_lens, shape, dtype, "cuda")
    check_extend([5, 0], [3, 1], shape, dtype, "cuda", seed=1, strided=True)


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_extend_work_subset_gpu() -> None:
    check_extend_subset("cuda")


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backend_mixed_step_splits_one_row_sequences(dtype: torch.dtype) -> None:
    """A mixed step through the Triton backend: one-row sequences (decoding rows) go to the
    decode kernel, the rest to the extend kernel, and together they equal the reference."""
    from tapserve.model.triton_backend import make_triton_backend

    num_kv_heads, group, head_dim, block_size = 8, 4, 128, 16
    q_lens = [1, 300, 1, 1, 64, 1, 17, 1]
    prefix = [900, 0, 5, 4000, 100, 1, 33, 63]
    q, k_cache, v_cache, meta = _make_case(
        [p + ql for p, ql in zip(prefix, q_lens)],
        q_lens,
        num_kv_heads,
        group,
        head_dim,
        block_size,
        dtype,
        "cuda",
    )
    backend = make_triton_backend(16, num_kv_heads * group, head_dim, 8192, torch.device("cuda"))
    out = backend.extend(q, k_cache, v_cache, meta, head_dim**-0.5)
    (split,) = meta.backend_state.values()
    assert split.decode_rows.tolist() == [0, 301, 302, 367, 385]
    assert sorted(set(split.work[:, 0].tolist())) == [1, 4, 6]
    _check(out, _reference(q, k_cache, v_cache, meta, head_dim**-0.5), dtype, "mixed step")
    check_backend_mixed("cuda", dtype)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_store_gpu(dtype: torch.dtype) -> None:
    for shape in GPU_SHAPES:
        check_store(700, shape, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_decode_cuda_graph_replay() -> None:
    """Capture decode once with a fixed workspace, replay with other context lengths."""
    from tapserve.model.kernels import make_decode_workspace, paged_decode_attention

    shape, dtype, splits = (8, 4, 128, 16), torch.bfloat16, 16
    num_kv_heads, group, head_dim, block_size = shape
    q, k_cache, v_cache, meta = _make_case(
        [3000, 8000, 1, 400], [1] * 4, num_kv_heads, group, head_dim, block_size, dtype, "cuda"
    )
    scale = head_dim**-0.5
    ctx = meta.context_lens.clone()
    out = torch.empty_like(q)
    ws = make_decode_workspace(8, q.shape[1], head_dim, splits, "cuda")

    def run():
        return paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            ctx,
            scale,
            out=out,
            num_kv_splits=splits,
            workspace=ws,
        )

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ([3000, 8000, 1, 400], [17, 5000, 64, 1], [0, 1, 2, 3]):
        ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        live = [i for i, c in enumerate(lens) if c > 0]
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping[live],
            query_start_loc=torch.arange(len(live) + 1, dtype=torch.int32, device="cuda"),
            context_lens=ctx[live],
            block_tables=meta.block_tables[live],
            is_decode=True,
        )
        _check(
            out[live],
            _reference(q[live], k_cache, v_cache, sub, scale),
            dtype,
            f"graph replay {lens}",
        )
        assert all(out[i].abs().max().item() == 0 for i, c in enumerate(lens) if c == 0)
