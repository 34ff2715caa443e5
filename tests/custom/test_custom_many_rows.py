"""Multi-row selections on rank 0 (DESIGN.md "Custom outputs over many tokens"), against
transformers: every row equals the head on transformers' final hidden state of prompt +
returned ids at its position. Prompt lists (chunked prefill), every generated token (-3) under
greedy, seeded n = 3, beams and asynchronous scheduling; the wire rule (each output carries
exactly the rows of its tokens, once); prefix reuse under omit and recompute; preemption;
should_stop and content_filter; the 605s of the selection rules and the byte bound."""

from __future__ import annotations

import pytest
import torch

from tapserve.api.sampling_params import SamplingParams
from tapserve.api.wire import EXECUTION_EXCEPTION, INVALID_PARAMS
from tapserve.coordinator.scheduler import Scheduler
from tapserve.model.custom_output import CustomOutputHandler
from tests.helpers.custom import greedy, make_llm, prompt, run
from tests.helpers.custom_rows import check_against_reference, expected_rows, rows_by_sequence

torch.set_num_threads(1)
pytest_plugins = ["tests.helpers.custom_fixtures"]  # ckpt, ref
pytest.importorskip("transformers")

ALL = CustomOutputHandler.ALL_GENERATED
LAST = CustomOutputHandler.LAST_GENERATED
STOP_PROBE = "tests.helpers.custom:StopProbe"


# ---- selection rules --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "answer, max_new, message",
    [
        ([3, 3], 4, "repeats"),
        ([3, -1], 4, "outside"),
        ([LAST, ALL], 4, "both"),
        ([True], 4, "not an int"),
        ([2.0], 4, "not an int"),
        ([], 0, "scoring-only"),
        ([ALL], 0, "scoring-only"),
        ([LAST, 2], 0, "scoring-only"),
        ([40], 4, "outside"),
        (ALL, 4, "outside"),  # a bare int -3 stays a 605
    ],
)
def test_selection_rules_are_605(ckpt, answer, max_new, message) -> None:
    llm = make_llm(ckpt, custom_module=STOP_PROBE)
    r = run(llm, [("a", prompt(20, 1), greedy(max_new), {"position": answer})])
    error = r.errors["a"]
    assert error.code == INVALID_PARAMS and error.param == "custom_output_params"
    assert message in error.message, error.message


def test_empty_list_is_no_custom_output(ckpt) -> None:
    llm = make_llm(ckpt, custom_module=STOP_PROBE)
    r = run(llm, [("a", prompt(20, 1), greedy(3), {"position": []})])
    assert all(o.custom_rows is None and o.custom_output is None for o in r.outputs["a"])
    assert all(s.custom_rows is None for o in r.outputs["a"] for s in o.sequences)
    assert llm.engine.handler.calls == [1]  # the dry run only


def test_byte_bound_is_605_at_admission(ckpt) -> None:
    row = 3 * 4  # [rows, 3] float32
    bound = row * (2 + 8) * 2  # 2 prompt rows + 8 tokens, n = 2: exactly at the bound
    llm = make_llm(ckpt, custom_module=STOP_PROBE, max_custom_output_bytes=bound)
    ids, sel = prompt(20, 1), {"position": [1, 2, ALL]}
    params = SamplingParams(max_new_tokens=8, n=2, temperature=1.0, seed=3)
    wider = SamplingParams(max_new_tokens=8, n=3, temperature=1.0, seed=3)
    r = run(llm, [("ok", ids, params, sel), ("over", ids, wider, sel)])
    assert "ok" not in r.errors
    assert r.errors["over"].code == INVALID_PARAMS
    assert r.errors["over"].param == "custom_output_params"
    assert "max-custom-output-bytes" in r.errors["over"].message


# ---- prompt positions -------------------------------------------------------------------------
def test_prompt_positions_across_prefill_chunks(ckpt, ref) -> None:
    """70 prompt tokens in chunks of 32: positions in any order, served ascending, each row
    sent once, one handler call per step."""
    llm = make_llm(ckpt)  # max_num_batched_tokens 32
    ids = prompt(70, 2)
    chosen = [69, 0, 31, 32, 45, 5]
    r = run(llm, [("a", ids, greedy(2), {"position": chosen})])
    positions, rows = rows_by_sequence(r, "a")
    assert positions[0] == sorted(chosen)
    torch.testing.assert_close(rows[0], expected_rows(ref, ids, sorted(chosen)))
    assert sum(1 for o in r.outputs["a"] if o.custom_rows is not None) >= 2  # chunk by chunk
    assert all(calls <= 1 for _, calls in r.steps)


def test_scoring_only_prompt_rows(ckpt, ref) -> None:
    llm = make_llm(ckpt)
    ids = prompt(30, 3)
    r = run(llm, [("a", ids, greedy(0, n=2), {"position": [4, 29, 11]})])
    positions, rows = rows_by_sequence(r, "a")
    assert positions == {0: [4, 11, 29], 1: [4, 11, 29]}
    torch.testing.assert_close(rows[1], expected_rows(ref, ids, [4, 11, 29]))
    assert r.finish_reasons("a") == {0: "length", 1: "length"}


# ---- every generated token --------------------------------------------------------------------
def test_all_generated_greedy_matches_transformers(ckpt, ref) -> None:
    llm = make_llm(ckpt)
    a, b = prompt(21, 4), prompt(9, 5)
    r = run(
        llm,
        [
            ("a", a, greedy(7), {"position": [ALL]}),
            ("b", b, greedy(5), {"position": [len(b) - 1, 3, ALL]}),
            ("one", prompt(12, 6), greedy(3), None),  # a one-row request beside them
        ],
    )
    pa = check_against_reference(r, "a", a, ref)
    pb = check_against_reference(r, "b", b, ref)
    assert pa[0] == list(range(21, 28))
    assert pb[0] == [3, 8] + list(range(9, 14))
    assert r.final("one").custom_output is not None and r.final("one").custom_rows is None
    assert all(calls <= 1 for _, calls in r.steps)  # one handler call per step


def test_all_generated_rows_match_the_plain_engines_tokens(ckpt, plain_llm) -> None:
    """Greedy with a -3 head is token-identical to the engine without a head."""
    llm = make_llm(ckpt)
    ids = prompt(15, 7)
    with_rows = run(llm, [("a", ids, greedy(9), {"position": [ALL]})])
    plain = run(plain_llm, [("a", ids, greedy(9), None)])
    assert with_rows.tokens("a") == plain.tokens("a")


def test_all_generated_sampled_n3_and_async(ckpt, ref) -> None:
    ids = prompt(17, 8)
    params = SamplingParams(max_new_tokens=6, n=3, temperature=1.0, seed=11, logprobs=1)
    results = []
    for async_scheduling in (False, True):
        llm = make_llm(ckpt, async_scheduling=async_scheduling)
        r = run(llm, [("a", ids, params, {"position": [0, ALL]})])
        positions = check_against_reference(r, "a", ids, ref)
        for i, out in r.tokens("a").items():
            assert positions[i] == [0] + list(range(17, 17 + len(out)))
        results.append(r.tokens("a"))
    assert results[0] == results[1]


def test_all_generated_with_beams(ckpt, ref) -> None:
    llm = make_llm(ckpt)
    ids = prompt(13, 9)
    params = SamplingParams(max_new_tokens=5, num_beams=3, n=2)
    r = run(llm, [("a", ids, params, {"position": [2, ALL]})])
    positions = check_against_reference(r, "a", ids, ref)
    assert len(positions) == 2
    for i, out in r.tokens("a").items():
        assert positions[i] == [2] + list(range(13, 13 + len(out)))


def test_last_generated_in_a_list(ckpt, ref) -> None:
    llm = make_llm(ckpt)
    ids = prompt(11, 10)
    params = SamplingParams(max_new_tokens=4, n=2, temperature=1.0, seed=5)
    r = run(llm, [("a", ids, params, {"position": [1, LAST]})])
    positions = check_against_reference(r, "a", ids, ref)
    for i, out in r.tokens("a").items():
        assert positions[i] == [1, len(ids) + len(out) - 1]


def test_preempted_request_never_repeats_a_row(ckpt, ref, monkeypatch) -> None:
    """A KV cache too small for both: one is preempted and recomputed mid-generation."""
    preempted: list[str] = []
    original = Scheduler._preempt

    def counting(self, seqs, batch):
        preempted.append(seqs[0].request.request_id)
        original(self, seqs, batch)

    monkeypatch.setattr(Scheduler, "_preempt", counting)
    llm = make_llm(ckpt, num_kv_blocks=12, max_num_batched_tokens=64, max_model_len=96)
    a, b = prompt(30, 12), prompt(30, 13)
    r = run(
        llm, [(rid, ids, greedy(30), {"position": [5, ALL]}) for rid, ids in (("a", a), ("b", b))]
    )
    assert preempted
    for rid, ids in (("a", a), ("b", b)):
        positions = check_against_reference(r, rid, ids, ref)
        assert positions[0] == [5] + list(range(30, 30 + len(r.tokens(rid)[0])))


@pytest.mark.parametrize("policy", ["omit", "recompute"])
def test_prefix_reuse_policies(ckpt, ref, policy) -> None:
    llm = make_llm(ckpt, custom_output_reuse=policy)
    ids = prompt(40, 14)  # 5 full blocks of 8
    sel = {"position": [3, 20, 39, ALL]}
    run(llm, [("warm", ids, greedy(2), sel)])
    r = run(llm, [("a", ids, greedy(3), sel)])
    positions = check_against_reference(r, "a", ids, ref)
    cached = r.final("a").num_cached_tokens
    if policy == "omit":
        assert cached > 20
        assert positions[0][:1] == [39] and r.final("a").custom_output_omitted == "prefix_reuse"
    else:
        assert cached <= 3 and r.final("a").custom_output_omitted is None
        assert positions[0][:3] == [3, 20, 39]


# ---- should_stop ------------------------------------------------------------------------------
def test_should_stop_ends_with_content_filter(ckpt, ref) -> None:
    ids = prompt(19, 15)
    free = run(
        make_llm(ckpt, custom_module=STOP_PROBE), [("a", ids, greedy(8), {"position": [ALL]})]
    )
    free_tokens = free.tokens("a")[0]
    _, free_rows = rows_by_sequence(free, "a")
    threshold = float(free_rows[0][3, 0])  # the first row at or above it is flagged
    flagged_at = int((free_rows[0][:, 0] >= threshold).nonzero()[0])
    llm = make_llm(ckpt, custom_module=STOP_PROBE)
    params = greedy(8, logprobs=1)
    r = run(llm, [("a", ids, params, {"position": [ALL], "threshold": threshold})])
    assert r.finish_reasons("a") == {0: "content_filter"}
    assert r.tokens("a")[0] == free_tokens[:flagged_at]  # no id of the flagged token, nor later
    positions, rows = rows_by_sequence(r, "a")
    assert positions[0] == list(range(19, 19 + flagged_at + 1))  # its row is returned
    full = ids + free_tokens[: flagged_at + 1]
    torch.testing.assert_close(rows[0], expected_rows(ref, full, positions[0]))
    logprobs = [lp for o in r.outputs["a"] for s in o.sequences for lp in (s.new_logprobs or [])]
    assert len(logprobs) == flagged_at
    assert llm.engine.custom_stats.content_filter == 1
    assert set(llm.engine.handler.stop_calls) == {1}  # -3 rows only, one per step


def test_should_stop_sees_only_generated_rows_and_other_sequences_go_on(ckpt) -> None:
    llm = make_llm(ckpt, custom_module=STOP_PROBE)
    ids = prompt(16, 16)
    r = run(
        llm,
        [
            ("stop", ids, greedy(6), {"position": [2, 5, ALL], "threshold": -1e9}),
            ("go", ids, greedy(6), {"position": [2, ALL]}),
            ("prompt_only", ids, greedy(6), {"position": [2, 5], "threshold": -1e9}),
        ],
    )
    assert r.finish_reasons("stop") == {0: "content_filter"}
    assert r.tokens("stop") == {0: []}  # the first generated token is flagged
    assert r.finish_reasons("go") == {0: "length"} and len(r.tokens("go")[0]) == 6
    assert r.finish_reasons("prompt_only") == {0: "length"}


@pytest.mark.parametrize("mode", ["raise", "float", "short"])
def test_should_stop_failure_is_606_for_its_requests_only(ckpt, mode) -> None:
    llm = make_llm(ckpt, custom_module=STOP_PROBE)
    llm.engine.handler.stop_mode = mode
    ids = prompt(14, 17)
    r = run(
        llm,
        [
            ("rows", ids, greedy(4), {"position": [ALL]}),
            ("prompt_rows", ids, greedy(4), {"position": [1, 2]}),
            ("one_row", ids, greedy(4), None),
        ],
    )
    assert r.final("rows").error_code == EXECUTION_EXCEPTION
    assert "should_stop" in r.final("rows").error_message
    for rid in ("prompt_rows", "one_row"):
        assert r.final(rid).error_code is None and len(r.tokens(rid)[0]) == 4
    assert llm.engine.custom_stats.should_stop_errors >= 1


# ---- asynchronous scheduling ------------------------------------------------------------------
def test_all_generated_runs_ahead(ckpt, ref) -> None:
    """Single -3 requests run ahead of their sampling (the handler queued right after each
    step's forward): the same tokens and rows as the synchronous engine, a stop included."""
    reqs = [
        (f"r{i}", prompt(n, 20 + i), greedy(m), {"position": sel})
        for i, (n, m, sel) in enumerate([(9, 12, [ALL]), (14, 7, [3, ALL]), (6, 15, [ALL])])
    ]
    plain = [("plain", prompt(11, 30), greedy(9), None), ("one", prompt(7, 31), greedy(5), {})]
    runs = {}
    for async_scheduling in (False, True):
        llm = make_llm(ckpt, async_scheduling=async_scheduling)
        in_columns = []
        step = llm.engine.step
        llm.engine.step = lambda: in_columns.append(step()) or in_columns[-1]
        runs[async_scheduling] = r = run(llm, reqs + plain)  # beside plain requests
        assert {rid: len(r.tokens(rid)[0]) for rid, *_ in plain} == {"plain": 9, "one": 5}
        assert r.final("one").custom_output is not None  # (its default: the last prompt token)
        assert (llm.engine.num_ahead_steps > 0) == async_scheduling
        # running ahead, a plain token leaves with its row in the outputs' row columns
        assert any(o.row_request_ids for o in in_columns) == async_scheduling
        for rid, ids, params, _ in reqs:
            positions = check_against_reference(r, rid, ids, ref)
            out = r.tokens(rid)[0]
            assert len(out) == params.max_new_tokens
            assert positions[0][-len(out) :] == list(range(len(ids), len(ids) + len(out)))
    for rid, *_ in reqs + plain:
        assert runs[True].tokens(rid) == runs[False].tokens(rid)


def test_should_stop_while_running_ahead(ckpt) -> None:
    ids = prompt(19, 15)
    free = run(
        make_llm(ckpt, custom_module=STOP_PROBE), [("a", ids, greedy(10), {"position": [ALL]})]
    )
    _, free_rows = rows_by_sequence(free, "a")
    threshold = float(free_rows[0][5, 0])
    flagged_at = int((free_rows[0][:, 0] >= threshold).nonzero()[0])
    llm = make_llm(ckpt, custom_module=STOP_PROBE, async_scheduling=True)
    sel = {"position": [ALL], "threshold": threshold}
    r = run(
        llm, [("a", ids, greedy(10), sel), ("b", prompt(8, 3), greedy(10), {"position": [ALL]})]
    )
    assert llm.engine.num_ahead_steps > 0
    assert r.finish_reasons("a") == {0: "content_filter"}
    assert r.tokens("a")[0] == free.tokens("a")[0][:flagged_at]
    positions, _ = rows_by_sequence(r, "a")
    assert positions[0] == list(range(19, 19 + flagged_at + 1))
    assert r.finish_reasons("b") == {0: "length"} and len(r.tokens("b")[0]) == 10


def test_flagged_beams_end_as_hypotheses(ckpt, ref) -> None:
    """Every row flagged: each beam ends at its first generated token as a content_filter
    hypothesis holding no token and that token's row."""
    llm = make_llm(ckpt, custom_module=STOP_PROBE)
    ids = prompt(12, 18)
    params = SamplingParams(max_new_tokens=5, num_beams=3, n=2)
    r = run(llm, [("a", ids, params, {"position": [1, ALL], "threshold": -1e9})])
    assert r.finish_reasons("a") == {0: "content_filter", 1: "content_filter"}
    assert r.tokens("a") == {0: [], 1: []}
    positions, rows = rows_by_sequence(r, "a")
    assert positions == {0: [1, 12], 1: [1, 12]}
    torch.testing.assert_close(rows[0][0], rows[1][0])  # the shared prompt row
    assert not torch.equal(rows[0][1], rows[1][1])  # two beams' different first tokens
    torch.testing.assert_close(rows[0][:1], expected_rows(ref, ids, [1]))


def test_rows_kept_past_the_next_call_are_copies(ckpt, ref) -> None:
    """A head that returns a view of a buffer it overwrites: beams keep their history's rows
    over many steps, and they still match transformers."""
    llm = make_llm(ckpt, custom_module="tests.helpers.custom:ReusedBufferProbe")
    ids = prompt(13, 19)
    params = SamplingParams(max_new_tokens=6, num_beams=2, n=2)
    r = run(llm, [("a", ids, params, {"position": [2, ALL]})])
    positions = check_against_reference(r, "a", ids, ref)
    assert all(len(p) == 1 + len(r.tokens("a")[i]) for i, p in positions.items())


def test_offline_results_join_row_columns(ckpt, ref) -> None:
    """LLM.generate running ahead (rows in the outputs' row columns) gives each sequence the
    rows and positions of the synchronous engine."""
    prompts = [prompt(9, 40), prompt(15, 41)]
    sel = [{"position": [1, ALL]}, {"position": [ALL]}]
    got = {}
    for async_scheduling in (False, True):
        llm = make_llm(ckpt, async_scheduling=async_scheduling)
        got[async_scheduling] = llm.generate(prompts, greedy(8), custom_output_params=sel)
    for sync, ahead, ids in zip(got[False], got[True], prompts):
        (s,), (a,) = sync.outputs, ahead.outputs
        assert a.token_ids == s.token_ids and a.custom_output_positions == s.custom_output_positions
        torch.testing.assert_close(a.custom_output, s.custom_output)
        torch.testing.assert_close(
            a.custom_output, expected_rows(ref, ids + a.token_ids, a.custom_output_positions)
        )
