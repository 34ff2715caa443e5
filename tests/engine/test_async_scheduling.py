"""Asynchronous scheduling (coordinator/run_ahead.py): plain decode steps launched before the
step before them has its tokens on the host. On the CPU it is off by default (nothing runs
in parallel there); these engines switch it on so that its bookkeeping runs for real, and
compare every token and finish with the same engine run synchronously.

The engines are watched (tests/helpers/invariants.py): every plan scheduled ahead is checked row by
row against the sequences one token behind it, the block accounting after every step, and
no KV block may leak at the end.
"""

from __future__ import annotations

import pytest

from tapserve.api.sampling_params import SamplingParams
from tests.helpers.engine import count_preemptions, greedy, make_llm, random_prompts, run, token_ids


@pytest.fixture(scope="module")
def demo_dir():
    from tapserve.model.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint()


def _pair(demo_dir, **kwargs):
    """The same engine synchronous and asynchronous."""
    kwargs = {"num_kv_blocks": 96, "max_model_len": 256, **kwargs}
    return (
        make_llm(demo_dir, async_scheduling=False, **kwargs),
        make_llm(demo_dir, async_scheduling=True, **kwargs),
    )


def _finishes(results) -> list[tuple[list[int], str]]:
    return [(r.outputs[0].token_ids, r.outputs[0].finish_reason) for r in results]


def test_greedy_tokens_and_finishes_equal_the_synchronous_engine(demo_dir):
    """Lengths that end one by one, and stop tokens that end some requests early: a row
    finishing in a step was already scheduled into the next one, whose token must vanish."""
    sync, ahead = _pair(demo_dir)
    prompts = random_prompts([20, 35, 17, 48, 9, 26], 1000, seed=11)
    params = [greedy(20 + 7 * i) for i in range(len(prompts))]
    first = run(sync, prompts, params)
    for i in (1, 4):  # stop at a token the request generates mid-way
        params[i] = greedy(20 + 7 * i, stop_token_ids=[first[i].outputs[0].token_ids[9]])
    want = run(sync, prompts, params)
    assert [r.outputs[0].finish_reason for r in want].count("stop") == 2
    got = run(ahead, prompts, params)
    assert _finishes(got) == _finishes(want)
    assert ahead.engine.num_ahead_steps > 0.6 * ahead.engine.steps_checked, (
        ahead.engine.num_ahead_steps,
        ahead.engine.steps_checked,
    )
    assert sync.engine.num_ahead_steps == 0


def test_temperature_draws_equal_the_synchronous_engine(demo_dir):
    """One temperature for all, all ending together: the shared generator draws the same
    noise in the same order, so the sampled tokens are the synchronous engine's."""
    sync, ahead = _pair(demo_dir, seed=5)
    prompts = random_prompts([14, 30, 22], 1000, seed=12)
    params = SamplingParams(max_new_tokens=25, temperature=0.8, ignore_eos=True)
    want = run(sync, prompts, params)
    got = run(ahead, prompts, params)
    assert token_ids(got) == token_ids(want)
    assert ahead.engine.num_ahead_steps > 15


def test_a_batch_mixing_draws_runs_ahead_with_the_synchronous_tokens(demo_dir):
    """Greedy, temperature-only and top-k/top-p/min-p rows in one batch: drawn on the device
    by Sampler.plain_tensor as the synchronous engine's sample_plain draws them (the same
    generator, in the same order while no row finishes early)."""
    sync, ahead = _pair(demo_dir, seed=9)
    prompts = random_prompts([14, 30, 22, 17], 1000, seed=17)
    params = [
        SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=0.9, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=0.7, top_p=0.8, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=1.1, top_k=5, min_p=0.05, ignore_eos=True),
    ]
    want = run(sync, prompts, params)
    got = run(ahead, prompts, params)
    assert token_ids(got) == token_ids(want)
    assert ahead.engine.num_ahead_steps > 15


def test_arrivals_and_rows_that_cannot_run_ahead_drain_the_pipeline(demo_dir):
    """A request arriving mid-decode is admitted the next step (the pipeline drains for the
    general pass); a request asking for logprobs keeps its batch synchronous while it runs."""
    sync, ahead = _pair(demo_dir)
    prompts = random_prompts([18, 22, 9, 31], 1000, seed=13)
    outs = {}
    for llm in (sync, ahead):
        engine = llm.engine
        got: dict[str, list[int]] = {}
        finished: dict[str, int] = {}

        def step():
            for out in engine.step():  # wire.Outputs' order: full outputs, then the columns
                assert not finished.get(out.request_id), f"news after {out.request_id}'s end"
                got.setdefault(out.request_id, []).extend(out.sequences[0].new_token_ids)
                finished[out.request_id] = finished.get(out.request_id, 0) + out.finished

        for i in range(2):
            engine.add_request(f"r{i}", prompts[i], greedy(30))
        for _ in range(6):
            step()
        engine.add_request("late", prompts[2], greedy(8))
        engine.add_request("lp", prompts[3], greedy(6, logprobs=True))
        while engine.has_work():
            step()
        assert finished == {"r0": 1, "r1": 1, "late": 1, "lp": 1}, finished
        outs[llm is ahead] = got
    assert outs[True] == outs[False]
    assert all(len(v) == 30 for k, v in outs[True].items() if k.startswith("r"))
    assert ahead.engine.num_ahead_steps > 10


@pytest.mark.parametrize("arrival_step", range(2, 16))
def test_an_arrival_draining_the_pipeline_keeps_each_request_in_order(demo_dir, arrival_step):
    """A request arrives at each step in turn while r0 and r1 decode, so that the drain
    lands on r0's last steps too: wire.Outputs is read full outputs first, columns last, so
    one engine step must never hold a drained step's column token and a later final output
    of the same request (found in review: r0's last two tokens came out swapped)."""
    prompts = random_prompts([18, 22, 9], 1000, seed=13)
    results = {}
    for run_ahead in (False, True):
        engine = make_llm(
            demo_dir, num_kv_blocks=96, max_model_len=256, async_scheduling=run_ahead
        ).engine
        engine.add_request("r0", prompts[0], greedy(12))
        engine.add_request("r1", prompts[1], greedy(40))
        got: dict[str, list[int]] = {}
        steps = 0
        while engine.has_work():
            if steps == arrival_step:
                engine.add_request("late", prompts[2], greedy(5))
            for out in engine.step():
                assert out.request_id not in results.get(run_ahead, {}), "news after the end"
                got.setdefault(out.request_id, []).extend(out.sequences[0].new_token_ids)
                if out.finished:
                    results.setdefault(run_ahead, {})[out.request_id] = got[out.request_id]
            steps += 1
        assert sorted(results[run_ahead]) == ["late", "r0", "r1"]
    assert results[True] == results[False]


def test_an_abort_while_a_step_is_in_flight_gets_one_final_output(demo_dir):
    _, llm = _pair(demo_dir)
    engine = llm.engine
    for i, prompt in enumerate(random_prompts([18, 22, 27], 1000, seed=14)):
        engine.add_request(f"r{i}", prompt, greedy(30))
    for _ in range(5):
        engine.step()
    assert engine._ahead is not None, "a step in flight was expected"
    in_flight = engine.num_ahead_steps
    engine.abort_request("r1")
    finals, tokens_after = {}, {}
    while engine.has_work():
        step = engine.step()
        for out in step.outputs:
            finals[out.request_id] = finals.get(out.request_id, 0) + out.finished
            if out.request_id == "r1":
                assert out.finished and out.sequences[0].finish_reason == "abort"
        for rid in step.token_request_ids:
            tokens_after[rid] = tokens_after.get(rid, 0) + 1
    assert finals == {"r1": 1, "r0": 1, "r2": 1}
    assert "r1" not in tokens_after
    assert engine.num_ahead_steps > in_flight + 10  # the other two went on running ahead


def test_preemption_under_a_tiny_cache_gives_the_tokens_of_a_roomy_one(demo_dir):
    prompts = random_prompts([30, 26, 33, 21, 40], 1000, seed=15)
    tiny = make_llm(
        demo_dir, num_kv_blocks=12, block_size=16, max_model_len=160, async_scheduling=True
    )
    with count_preemptions(tiny) as preempted:
        got = run(tiny, prompts, greedy(60))
    assert preempted and tiny.engine.num_ahead_steps > 0
    roomy = make_llm(
        demo_dir, num_kv_blocks=128, block_size=16, max_model_len=160, async_scheduling=False
    )
    assert token_ids(got) == token_ids(run(roomy, prompts, greedy(60)))


def _admissions(llm, prompts, params) -> tuple[dict[str, int], int]:
    """Each request's first forward step as a running sequence, and the engine's step()
    calls that ran no forward (a drained pipeline: the host's turn not overlapped)."""
    engine, admitted = llm.engine, {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    for calls in range(1, 1000):
        engine.step()
        for seq in engine.scheduler.running:
            admitted.setdefault(seq.request.request_id, engine.num_steps)
        if not engine.has_work():
            return admitted, calls - engine.num_steps
    raise AssertionError("no progress in 1000 steps")


def test_a_queue_that_does_not_fit_the_cache_does_not_stop_running_ahead(demo_dir):
    """Two requests fill the cache and four wait for their blocks. The pipeline drains only
    for a request the general pass would admit (about once per admission; it drained at
    every step while anything waited before 2026-11-30: 35 such calls here), each
    waiting request is admitted within two steps of when the synchronous engine admits it
    (blocks freed in the step in flight show a step late), and the tokens are the
    synchronous engine's."""
    sync, ahead = _pair(demo_dir, num_kv_blocks=11, block_size=16, max_model_len=128)
    prompts = random_prompts([60, 58, 62, 57, 61, 59], 1000, seed=17)
    params = [greedy(n) for n in (12, 30, 20, 8, 25, 15)]  # rows finish one by one
    (want, _), (got, drained) = (
        _admissions(sync, prompts, params),
        _admissions(ahead, prompts, params),
    )
    assert all(want[r] <= got[r] <= want[r] + 2 for r in want), (want, got)
    assert drained <= len(prompts), drained
    assert token_ids(run(ahead, prompts, params)) == token_ids(run(sync, prompts, params))


def test_max_model_len_reached_while_running_ahead(demo_dir):
    """A row at the model's length limit is already scheduled into one more step, whose
    position is still inside the limit (its own last token's): no table outgrows it."""
    sync, ahead = _pair(demo_dir, max_model_len=64, block_size=16)
    prompts = random_prompts([40, 47, 33], 1000, seed=16)
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    want, got = run(sync, prompts, params), run(ahead, prompts, params)
    assert _finishes(got) == _finishes(want)
    assert all(len(p) + len(r.outputs[0].token_ids) == 64 for p, r in zip(prompts, got))


def test_async_scheduling_defaults_to_on_for_cuda_at_any_tp():
    import torch

    from tapserve.coordinator.engine import Engine
    from tapserve.model.layers import TPGroup

    class Runner:  # what the choice could read: the device and the TP group
        def __init__(self, device: str):
            self.device = torch.device(device)
            self.tp = TPGroup(rank=0, size=2)

    assert Engine._wants_run_ahead(None, Runner("cuda")) is True
    assert Engine._wants_run_ahead(None, Runner("cpu")) is False
    assert Engine._wants_run_ahead(True, Runner("cpu")) is True
    assert Engine._wants_run_ahead(False, Runner("cuda")) is False


@pytest.mark.parametrize("ranks", [1, 2], ids=["tp1", "tp2"])
def test_a_live_server_running_ahead_streams_the_synchronous_tokens(demo_dir, ranks):
    """`launch.py --async-scheduling` on the CPU (one rank, or two: `--nproc-per-node 2`, the
    ids reaching rank 1 in a gloo broadcast), driven by the official openai client: 16
    concurrent streaming greedy completions of different lengths (rows finishing one by one
    while others run ahead) give the synchronous offline engine's text, the steps that ran
    ahead show in /metrics, and every block is free at the end."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai

    from tests.helpers import wait_for
    from tests.helpers.api import LiveServer, metric

    prompts = random_prompts([5 + 3 * i for i in range(16)], 1000, seed=18)
    lengths = [4 + 3 * i for i in range(16)]
    sync = make_llm(demo_dir, num_kv_blocks=256, async_scheduling=False)
    want = [run(sync, [p], greedy(n))[0].outputs[0].token_ids for p, n in zip(prompts, lengths)]
    server = LiveServer(
        "--async-scheduling",
        "--custom-module",
        "none",
        *(["--nproc-per-node", str(ranks)] if ranks > 1 else []),
    )
    try:
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )

        def stream(i: int) -> str:
            chunks = client.completions.create(
                model="tapserve-demo",
                prompt=prompts[i],
                max_tokens=lengths[i],
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(stream, range(16)))
        for text, ids in zip(texts, want):
            expected = httpx.post(
                server.url + "/detokenize",
                timeout=30,
                json={"tokens": ids, "skip_special_tokens": True},
            )
            assert text == expected.json()["prompt"]
        assert wait_for(lambda: metric(server, "tapserve_engine_steps_ahead_total") > 0, 60)
        assert wait_for(lambda: metric(server, "tapserve_kv_blocks_used") == 0, 60)
    finally:
        assert server.stop() == 0, server.log_tail()


def test_a_drain_ends_only_after_the_step_in_flight(demo_dir, tmp_path):
    """When the last request finishes in the host work of a step run ahead, the step after
    it (its row wasted) is already launched. The serving loop's drain waits for that step
    to finish too: at TP > 1 the stop plan must not let the other ranks leave while its
    collectives are queued on the GPUs."""
    import time

    from tapserve.coordinator.loop import CoordinatorLoop, LoopSettings

    engine = make_llm(demo_dir, num_kv_blocks=96, max_model_len=256, async_scheduling=True).engine
    engine.add_request("last", random_prompts([12], 1000, seed=3)[0], greedy(6))
    loop = CoordinatorLoop(engine, LoopSettings(ipc_dir=str(tmp_path)), None, None)
    try:
        loop.stop_requested_at = time.monotonic()
        in_flight_after_the_last_output = 0
        while engine.has_work():
            engine.step()
            if not engine.requests and engine.has_work():
                in_flight_after_the_last_output += 1
                assert not loop._drained()
        assert in_flight_after_the_last_output == 1
        assert loop._drained()
    finally:
        loop.incoming.close(0)
        loop.outgoing.close(0)
        loop.zmq.term()
