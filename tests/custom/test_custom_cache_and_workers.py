"""Prefix reuse policies (omit / recompute, scoring-only always scores, cached-token counts) and
output dispatch (--output-workers: per-request order, rows captured by value, identical
results for any N)."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from tapserve.api.sampling_params import SamplingParams
from tapserve.coordinator.output_dispatch import OutputDispatcher
from tests.helpers.custom import BLOCK, assert_close, greedy, make_llm, prompt, run

torch.set_num_threads(1)
pytest_plugins = ["tests.helpers.custom_fixtures"]  # ckpt, ref, llm, plain_llm
pytest.importorskip("transformers")


def expected_cached(ids: list[int], cached_prompt: list[int], cap: int | None = None) -> int:
    """Whole blocks of the common prefix, never the last token, never at or past the cap."""
    common = 0
    while common < min(len(ids), len(cached_prompt)) and ids[common] == cached_prompt[common]:
        common += 1
    limit = min(common, len(ids) - 1, cap if cap is not None else len(ids))
    return limit // BLOCK * BLOCK


def reuse_case(seed: int):
    base = prompt(40, seed)
    covered = base[:32] + prompt(13, seed + 1)  # selected token 10: inside the shared prefix
    uncovered = base[:32] + prompt(11, seed + 2)  # selected token 36: after it
    return base, [("covered", covered, 10), ("uncovered", uncovered, 36)]


def test_omit_policy(ckpt, ref) -> None:
    llm = make_llm(ckpt, custom_output_reuse="omit")
    base, cases = reuse_case(seed=10)
    run(llm, [("warm", base, greedy(max_new_tokens=2), None)])
    r = run(
        llm, [(rid, ids, greedy(max_new_tokens=3), {"position": pos}) for rid, ids, pos in cases]
    )
    for rid, ids, pos in cases:
        cached = r.final(rid).num_cached_tokens
        assert cached == expected_cached(ids, base) and cached > 0
        assert r.final(rid).error_code is None
        assert len(r.tokens(rid)[0]) >= 1
        if pos < cached:
            assert all(o.custom_output is None for o in r.outputs[rid])  # absent, not an error
        else:
            assert_close(r.value(rid), ref.head(ids, pos))
    assert r.final("covered").custom_output is None and r.final("uncovered").custom_output


@pytest.mark.parametrize("length", [BLOCK + 1, 2 * BLOCK + 1])
@pytest.mark.parametrize("max_new_tokens", [0, 1, 3])
def test_last_prompt_token_alone_after_a_cache_hit(llm, ref, length, max_new_tokens) -> None:
    """All but the last prompt token come from the prefix cache: that token is computed alone
    (a decode-shaped step) and still gets its custom row; tokens are unchanged."""
    ids = prompt(length, 700 + length + max_new_tokens)
    params = greedy(max_new_tokens=max_new_tokens)
    first = run(llm, [("first", ids, params, None)])  # default selector: the last token
    again = run(llm, [("again", ids, params, None)])
    assert again.final("again").num_cached_tokens == length - 1
    for r, rid in ((first, "first"), (again, "again")):
        assert_close(r.value(rid), ref.head(ids, length - 1))
    assert again.tokens("again") == first.tokens("first")


def test_recompute_policy(ckpt, ref) -> None:
    llm = make_llm(ckpt, custom_output_reuse="recompute")
    base, cases = reuse_case(seed=20)
    run(llm, [("warm", base, greedy(max_new_tokens=2), None)])
    reqs = [(rid, ids, greedy(max_new_tokens=3), {"position": pos}) for rid, ids, pos in cases]
    r = run(llm, reqs)
    for rid, ids, pos in cases:
        cached = r.final(rid).num_cached_tokens
        assert cached == expected_cached(ids, base, cap=pos) and cached <= pos
        assert_close(r.value(rid), ref.head(ids, pos))
    assert r.final("covered").num_cached_tokens < expected_cached(cases[0][1], base)
    # a request without a selected token keeps full reuse
    no_value = base[:32] + prompt(9, 23)
    r = run(llm, [("no_value", no_value, greedy(max_new_tokens=2), {"none": True})])
    assert r.final("no_value").num_cached_tokens == expected_cached(no_value, base) > 0


def test_scoring_only_always_scores_under_omit(ckpt, ref) -> None:
    llm = make_llm(ckpt, custom_output_reuse="omit")
    base = prompt(40, 30)
    run(llm, [("warm", base, greedy(max_new_tokens=1), None)])
    r = run(
        llm,
        [
            ("score", base, SamplingParams(max_new_tokens=0), {"position": 20}),
            ("gen", base, greedy(max_new_tokens=1), {"position": 20}),
        ],
    )
    assert r.final("score").num_cached_tokens == expected_cached(base, base, cap=20)
    assert_close(r.value("score"), ref.head(base, 20))
    assert r.tokens("score") == {0: []} and r.finish_reasons("score") == {0: "length"}
    # the same position in a generating request is covered by reuse: omitted
    assert r.final("gen").num_cached_tokens > 20 and r.final("gen").custom_output is None


@pytest.mark.parametrize("policy", ["omit", "recompute"])
def test_preemption_keeps_values_computed_once(ckpt, ref, policy) -> None:
    """A KV cache too small for the batch: requests are preempted and recomputed; each value is
    still the transformers one and the handler scores each selected token once."""
    llm = make_llm(
        ckpt,
        num_kv_blocks=14,
        max_num_batched_tokens=24,
        custom_output_reuse=policy,
        max_model_len=None,
    )  # the context the small cache holds
    calls_before = len(llm.engine.handler.calls)
    reqs = [
        (
            f"r{i}",
            prompt(20 + i, 900 + i),
            greedy(max_new_tokens=30, ignore_eos=True),
            {"position": 5 + i},
        )
        for i in range(4)
    ]
    r = run(llm, reqs)
    computed = sum(plan.input_ids.size for plan, _ in r.steps)
    without_preemption = sum(len(ids) + 30 - 1 for _, ids, _, _ in reqs)
    assert computed > without_preemption, "the workload should preempt (and recompute)"
    assert sum(llm.engine.handler.calls[calls_before:]) == len(reqs)
    for rid, ids, _, cop in reqs:
        assert r.final(rid).error_code is None and len(r.tokens(rid)[0]) == 30
        assert_close(r.value(rid), ref.head(ids, cop["position"]))


# ---- output dispatch ---------------------------------------------------------------------------
def workload():
    """Several steps with rows, n > 1, seeded sampling, a scoring-only request, a -1 selection
    and one prompt that shares a prefix with another."""
    shared = prompt(24, 40)
    reqs = [
        (
            "a",
            prompt(30, 41),
            SamplingParams(max_new_tokens=4, n=2, temperature=0.8, seed=5),
            {"position": 3},
        ),
        ("b", shared + prompt(5, 42), greedy(max_new_tokens=5), None),
        ("c", prompt(45, 43), SamplingParams(max_new_tokens=0), {"position": 40}),
        (
            "d",
            prompt(9, 44),
            SamplingParams(
                max_new_tokens=3, temperature=1.0, seed=9, logprobs=True, top_logprobs=2
            ),
            {"none": True},
        ),
        ("e", shared + prompt(7, 45), greedy(max_new_tokens=4), {"position": 27}),
    ]
    reqs += [
        (f"x{i}", prompt(6 + i, 50 + i), greedy(max_new_tokens=2), {"position": i})
        for i in range(6)
    ]
    return reqs


def test_output_workers_give_identical_results(ckpt) -> None:
    results = []
    for workers in (0, 2):
        llm = make_llm(ckpt, output_workers=workers)
        assert llm.engine.dispatcher.workers == workers
        submitted = []
        submit = llm.engine.dispatcher.submit
        llm.engine.dispatcher.submit = lambda key, *a: submitted.append(key) or submit(key, *a)
        try:
            r = run(llm, workload())
        finally:
            llm.engine.close()
        values = [rid for rid, *_ in workload() if r.final(rid).custom_output is not None]
        assert sorted(submitted) == sorted(values) and len(values) >= 8
        assert sum(1 for plan, _ in r.steps if plan.custom_rows.size) >= 2
        results.append(r.outputs)
    assert results[0] == results[1]  # every output of every request, values' bytes included


def test_dispatcher_keeps_each_requests_order() -> None:
    rng = random.Random(0)
    seen: dict[str, list[int]] = {}
    lock = threading.Lock()

    def task(key: str, i: int) -> int:
        time.sleep(rng.random() * 0.002)
        with lock:
            seen.setdefault(key, []).append(i)
        return i

    with OutputDispatcher(3) as d:
        futures = [
            (k, i, d.submit(k, task, k, i)) for i in range(30) for k in ("r1", "r2", "r3", "r4")
        ]
        assert [f.result() for _, _, f in futures] == [i for _, i, _ in futures]
        assert {d.shard_of(k) for k in ("r1", "r2", "r3", "r4")} <= {0, 1, 2}
    assert seen == {k: list(range(30)) for k in ("r1", "r2", "r3", "r4")}


@pytest.mark.parametrize("workers", [0, 2])
def test_dispatcher_captures_rows_by_value(workers: int) -> None:
    gate = threading.Event()
    buffer = np.arange(12, dtype=np.float32).reshape(4, 3)
    original = buffer.copy()

    def encode(row: np.ndarray) -> bytes:
        gate.wait(5)
        return row.tobytes()

    if workers == 0:
        gate.set()
    with OutputDispatcher(workers) as d:
        futures = [d.submit(f"req{i}", encode, buffer[i : i + 1]) for i in range(4)]
        buffer[:] = -1  # the step's host buffer is reused before the tasks ran
        gate.set()
        assert [f.result() for f in futures] == [original[i : i + 1].tobytes() for i in range(4)]


def test_dispatcher_reports_task_errors_through_futures() -> None:
    def boom() -> None:
        raise RuntimeError("encode failed")

    for workers in (0, 1):
        with OutputDispatcher(workers) as d:
            with pytest.raises(RuntimeError, match="encode failed"):
                d.submit("r", boom).result()
    with pytest.raises(ValueError):
        OutputDispatcher(-1)
