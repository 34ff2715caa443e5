"""The Triton temperature-sampling kernel (model/kernels/sample.py) against softmax(x / T).

The kernel's draws must follow softmax(logits / temperature): the empirical frequencies of
many rows with the same logits are compared with those probabilities (a bound several
standard errors wide). Also: a seed fixes the draw, a large margin always wins, columns past
the first loop block are reachable, each row keeps its own temperature, and the token does
not depend on how many chunks a row is split into (ties, NaN and -inf included).
CPU: under the Triton interpreter (tests/helpers/interpreter.py); CUDA: `@pytest.mark.gpu`, with the
engine's batch draw taking the kernel.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.interpreter import OLD_INTERPRETER, run_checks

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def check_distribution(
    device: str,
    rows: int,
    logits: list[float],
    temperatures: list[float],
    dtype: torch.dtype = torch.float32,
) -> None:
    """Frequencies over `rows` draws within 5 standard errors of softmax(logits / T)."""
    from tapserve.model.kernels.sample import gumbel_sample

    x = torch.tensor(logits, dtype=dtype)
    for temperature in temperatures:
        want = torch.softmax(x.float() / temperature, dim=0).double()
        batch = x.to(device).repeat(rows, 1)
        temps = torch.full((rows,), temperature)
        got = gumbel_sample(batch, temps, seed=11).cpu()
        freq = torch.bincount(got, minlength=len(logits)).double() / rows
        bound = 5 * (want * (1 - want) / rows).sqrt() + 1e-3
        assert ((freq - want).abs() <= bound).all(), (temperature, freq, want)
        few = slice(0, 20)
        again = gumbel_sample(batch[few], temps[few], seed=11).cpu()
        assert torch.equal(again, got[few]), (
            "a seed fixes the draw (hashed counters per row and column)"
        )
        assert not torch.equal(gumbel_sample(batch[few], temps[few], seed=12).cpu(), got[few])


def check_wide_rows(device: str, vocab: int) -> None:
    """A margin of 50 logits wins at temperature 0.5 wherever it sits, also in the last
    (partial) loop block; rows have their own temperatures."""
    from tapserve.model.kernels.sample import gumbel_sample

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen)
    winners = [0, 1023, 1024, vocab // 2, 4096, vocab - 1]  # quarters and loop steps
    for row, col in enumerate(winners):
        logits[row, col] = 60.0
    temps = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    got = gumbel_sample(logits.to(device), temps, seed=3).cpu().tolist()
    assert got == winners
    # a huge temperature spreads the same row's draws over the vocabulary
    spread = gumbel_sample(logits[:1].to(device).repeat(24, 1), torch.full((24,), 1e4), seed=5)
    assert len(set(spread.cpu().tolist())) > 12
    # a list of equal temperatures travels as one float: the same draws as the tensor
    assert gumbel_sample(logits.to(device), [0.5] * 6, seed=3).cpu().tolist() == winners
    same = logits[3:4].to(device).repeat(24, 1)
    assert torch.equal(
        gumbel_sample(same, [1e4] * 24, seed=5), gumbel_sample(same, torch.full((24,), 1e4), seed=5)
    )
    # a list of different temperatures: each row its own
    mixed = gumbel_sample(same, [1e-3, 1e4] * 12, seed=5).cpu().tolist()
    assert mixed[0::2] == [winners[3]] * 12 and len(set(mixed[1::2])) > 6


def _keyed_hash(x: torch.Tensor, key: torch.Tensor | int) -> torch.Tensor:
    """The kernel's hash in int64 torch arithmetic (low 32 bits kept after each multiply)."""
    mask = 0xFFFFFFFF
    x = x & mask
    x ^= x >> 16
    x = (x * 0x7FEB352D) & mask
    x ^= key
    x ^= x >> 15
    x = (x * 0x846CA68B) & mask
    return x ^ (x >> 16)


def _uniforms(seed: int, rows: int, vocab: int) -> torch.Tensor:
    """The kernel's u for every (row, column), float32."""
    counters = torch.arange(rows * vocab, dtype=torch.int64).view(rows, vocab)
    bits = _keyed_hash(counters, _keyed_hash(torch.tensor(seed), 0))
    return ((bits >> 9).float() + 0.5) * (1.0 / 2**23)


def check_matches_reference(
    device: str, rows: int, vocab: int, splits_blocks: list[tuple[int | None, int]]
) -> None:
    """The kernel's draws are those of the documented recipe, recomputed here in float32
    torch: u from the keyed hash of row * vocab + v, 23 bits; the argmax over v of
    x log2(e) / T - log2(-log2 u). A different log implementation may flip a near tie, so a
    row may differ only where its two scores are within float rounding of each other. Every
    (chunks a row, loop block) in splits_blocks draws the very same tokens."""
    from tapserve.model.kernels.sample import gumbel_sample

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=gen)
    temps = torch.rand(rows, generator=gen) + 0.5
    seed = 123457
    inv_temp = (1.4426950408889634 / temps)[:, None]
    score = logits * inv_temp - torch.log2(-torch.log2(_uniforms(seed, rows, vocab)))
    want = score.argmax(dim=1)
    got = gumbel_sample(logits.to(device), temps, seed).cpu()
    assert (got == want).float().mean() >= 0.9, (got != want).nonzero()
    picked = score.gather(1, got[:, None])[:, 0]
    best = score.max(dim=1).values
    assert ((best - picked) <= 1e-4 * best.abs().clamp(min=1)).all(), (best - picked).max()
    for splits, block in splits_blocks:
        again = gumbel_sample(logits.to(device), temps, seed, _splits=splits, _block=block).cpu()
        assert torch.equal(again, got), (splits, block, (again != got).nonzero())


def check_splits_agree(device: str, vocab: int, block: int, splits: list[int | None]) -> None:
    """Splitting a row into chunks changes no token: each split count draws what one chunk a
    row draws, on random rows and on ties across chunks (the first column wins), a winner in
    the last chunk, NaN (never drawn) and rows with no score above -inf (column 0)."""
    from tapserve.model.kernels.sample import gumbel_sample

    gen = torch.Generator().manual_seed(2)
    inf, nan, early, last = float("inf"), float("nan"), block + 1, vocab - 3
    late = early + (last - early) // block * block  # early's lane, in the last block
    logits = torch.randn(10, vocab, generator=gen) * 3
    logits[0] = -inf
    logits[1] = nan
    logits[2, ::2] = nan
    logits[3, [early, late]] = inf  # ties: +inf scores whatever the noise
    logits[4, [early, last]] = 1e30  # ties: the noise is far below 1e30's rounding step
    logits[5, [early, late]] = torch.tensor([1e29, 1e30])  # the best in the last chunk
    logits[6] = -inf
    logits[6, late] = 0.0
    temps = torch.rand(10, generator=gen) + 0.5
    draws = [
        gumbel_sample(logits.to(device), temps, 7, _splits=n, _block=block).cpu()
        for n in [1, *splits]
    ]
    for n, got in zip(splits, draws[1:]):
        assert torch.equal(got, draws[0]), (n, (got != draws[0]).nonzero())
    assert draws[0][:2].tolist() == [0, 0] and draws[0][2] % 2 == 1
    assert draws[0][3:7].tolist() == [early, early, late, late]
    # equal logits: seed 90717 gives row 0's columns 65 and 590 the same top u of its first
    # 1000 columns, so the same score: an exact tie from the hash, the first column wins
    seed, tie = 90717, [65, 590]
    u = _uniforms(seed, 1, 1000)[0]
    assert (u == u.max()).nonzero()[:, 0].tolist() == tie
    equal = torch.full((1, vocab), -inf)
    equal[0, :1000] = 0.0
    for n in [1, *splits]:
        got = gumbel_sample(equal.to(device), [0.9], seed, _splits=n, _block=block).item()
        assert got == tie[0], (n, got)


def check_largest_uniform_cannot_win(device: str) -> None:
    """Seed 19481 gives column 1 of row 0 a hash whose top 24 bits are all ones, so u is the
    top of its range (1 - 2**-24, checked here): its noise is the largest a draw can have,
    and still a logit 1000 below the rest never wins. (24 bits with the same half-step
    rounded u up to 1.0 there: log2(-log2 1) = -inf, a win whatever the logit, which hit
    ~0.9 % of 151,936-wide rows.)"""
    from tapserve.model.kernels.sample import gumbel_sample

    seed, col, vocab = 19481, 1, 700
    assert _uniforms(seed, 1, vocab)[0, col] == 1 - 2**-24
    logits = torch.zeros(1, vocab)
    logits[0, col] = -1000.0
    assert gumbel_sample(logits.to(device), [1.0], seed).item() != col


def _cpu_reference() -> None:
    check_matches_reference("cpu", rows=8, vocab=700, splits_blocks=[(1, 64), (3, 64), (None, 64)])
    check_largest_uniform_cannot_win("cpu")


def _cpu_distribution() -> None:  # the interpreter runs ~20 ms a row: few rows, far-apart p
    check_distribution("cpu", rows=150, logits=[0.0, 1.0, 2.0], temperatures=[0.8])


def _cpu_wide() -> None:
    check_wide_rows("cpu", vocab=5000)


def _cpu_splits() -> None:  # 1,000 columns in 8 blocks of 128
    check_splits_agree("cpu", vocab=1000, block=128, splits=[2, 3, 8])


CPU_CHECKS = {
    "distribution": _cpu_distribution,
    "wide": _cpu_wide,
    "reference": _cpu_reference,
    "splits": _cpu_splits,
}


@pytest.fixture(scope="module")
def cpu_results() -> dict[str, str]:
    return run_checks("tests.unit.test_kernels_sample")


@needs_triton
@pytest.mark.parametrize("name", sorted(CPU_CHECKS))
def test_sample_interpreter_cpu(name: str, cpu_results: dict[str, str]) -> None:
    if OLD_INTERPRETER:
        pytest.skip("Triton < 3.9 interpreter: no loop bound from a kernel argument")
    assert cpu_results[name] == "", cpu_results[name]


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_distribution_gpu(dtype: torch.dtype) -> None:
    check_distribution(
        "cuda",
        rows=200_000,
        logits=[1.0, 0.0, 2.5, -1.0, 0.5, 2.0],
        temperatures=[0.7, 1.5],
        dtype=dtype,
    )


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_sample_matches_reference_gpu() -> None:
    check_matches_reference(
        "cuda", rows=64, vocab=151_936, splits_blocks=[(1, 4096), (1, 2048), (5, 2048), (128, 1024)]
    )
    check_largest_uniform_cannot_win("cuda")


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("block", [64, 2048])
def test_sample_splits_agree_gpu(block: int) -> None:
    check_splits_agree("cuda", vocab=151_936, block=block, splits=[2, 7, 64, 128, None])


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_sample_batch_sizes_compile_once() -> None:
    """The split count and chunk width follow the row count, but reach the kernels as
    runtime ints: once 300 rows have run (one temperature for all, then one per row), 1 to
    256 rows compile no new variant of either pass."""
    from tapserve.model.kernels.sample import _chunk_best_kernel, _pick_kernel, gumbel_sample

    logits = torch.randn(300, 151_936, device="cuda")

    def draw(rows: int) -> None:
        gumbel_sample(logits[:rows], [0.8] * rows, seed=rows)
        gumbel_sample(logits[:rows], [0.8, 0.9] * (rows // 2) + [0.7] * (rows % 2), seed=16 * rows)

    def variants() -> list[int]:
        device = torch.cuda.current_device()
        return [len(k.device_caches[device][0]) for k in (_chunk_best_kernel, _pick_kernel)]

    draw(300)
    before = variants()
    for rows in [1, 2, 3, 16, 17, 32, 64, 100, 256]:
        draw(rows)
    assert variants() == before


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_sample_a_far_lower_logit_never_wins_gpu() -> None:
    """14,000 rows of 151,936 columns (8.5 GB), one at logit 0 and the rest at -1e4: every
    draw is the 0. 2.1e9 noise values, so u's top value occurs ~250 times."""
    from tapserve.model.kernels.sample import gumbel_sample

    logits = torch.full((14_000, 151_936), -1e4, device="cuda")
    logits[:, 0] = 0.0
    got = gumbel_sample(logits, [1.0] * 14_000, seed=5)
    assert int((got != 0).sum()) == 0


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_sample_wide_rows_gpu() -> None:
    check_wide_rows("cuda", vocab=151_936)


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_engine_batch_draw_takes_the_kernel() -> None:
    """The sampler's temperature-only path runs the kernel on CUDA, and its draws follow
    softmax(x / T) there too."""
    from tapserve.api.sampling_params import BatchDraw, SamplingParams
    from tapserve.coordinator.sampler import Sampler

    sampler = Sampler(0, "cuda")
    assert SamplingParams(temperature=0.8).batch_draw is BatchDraw.TEMPERATURE
    temps = [0.8] * 50_000
    logits = torch.tensor([0.0, 1.0, 2.0], device="cuda").repeat(50_000, 1)
    got = torch.tensor(sampler.sample_temperature(logits, temps))
    freq = torch.bincount(got, minlength=3).double() / 50_000
    want = torch.softmax(torch.tensor([0.0, 1.0, 2.0]) / 0.8, dim=0).double()
    assert ((freq - want).abs() < 0.015).all(), (freq, want)
    again = sampler.sample_temperature(logits, temps)  # the next call draws new noise
    assert again != got.tolist()
