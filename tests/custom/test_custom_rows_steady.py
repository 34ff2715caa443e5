"""A steady run-ahead batch of every-generated-token requests: after a step whose rows and
tokens all went out plainly, the next step's rows leave without a per-row check (RowSteps'
steady memory). The rows still equal transformers', and anything that breaks the steadiness
(a sequence finishing, an abort) sends the next step through the per-row check."""

from __future__ import annotations

import pytest
import torch

from tapserve.coordinator import row_steps
from tapserve.model.custom_output import CustomOutputHandler
from tests.helpers.custom import Run, greedy, make_llm, prompt, run
from tests.helpers.custom_rows import check_against_reference

torch.set_num_threads(1)
pytest_plugins = ["tests.helpers.custom_fixtures"]  # ckpt, ref
pytest.importorskip("transformers")

ALL = CustomOutputHandler.ALL_GENERATED


def watch_steady(monkeypatch) -> list[bool | None]:
    """Per run-ahead step with rows: whether they followed the steady batch (True), did not
    (False), or no batch was steady (None)."""
    answers: list[bool | None] = []
    next_of, place_ahead = row_steps._SteadyRows.next_of, row_steps.RowSteps.place_ahead

    def watched_next_of(self, rows, num_finished):
        answers[-1] = next_of(self, rows, num_finished)
        return answers[-1]

    def watched_place_ahead(self, rows, columns):
        answers.append(None)
        return place_ahead(self, rows, columns)

    monkeypatch.setattr(row_steps._SteadyRows, "next_of", watched_next_of)
    monkeypatch.setattr(row_steps.RowSteps, "place_ahead", watched_place_ahead)
    return answers


def test_steady_rows_match_transformers(ckpt, ref, monkeypatch) -> None:
    """Three lengths: the memory carries the steps between finishes, each finish breaks it
    for one step, and every row and token is the synchronous engine's and transformers'."""
    answers = watch_steady(monkeypatch)
    reqs = [
        (f"r{i}", prompt(7 + i, 40 + i), greedy(m), {"position": [ALL]})
        for i, m in enumerate([14, 20, 26])
    ]
    sync = run(make_llm(ckpt, async_scheduling=False), reqs)
    assert not answers
    llm = make_llm(ckpt, async_scheduling=True)
    r = run(llm, reqs)
    assert llm.engine.num_ahead_steps > 20
    # the first step and the step after each of two finishes are checked row by row
    assert answers.count(True) > 15 and answers.count(None) >= 3
    for rid, ids, params, _ in reqs:
        positions = check_against_reference(r, rid, ids, ref)
        assert len(positions[0]) == params.max_new_tokens
        assert r.tokens(rid) == sync.tokens(rid)


def test_an_abort_ends_the_steady_memory(ckpt, ref, monkeypatch) -> None:
    """A request aborted between steady steps: the next step's rows are checked one by one
    (the abort finished a sequence), the aborted request's rows stop with its tokens, and
    the others' rows still match transformers."""
    answers = watch_steady(monkeypatch)
    llm = make_llm(ckpt, async_scheduling=True)
    reqs = [(f"r{i}", prompt(9, 50 + i), greedy(24), {"position": [ALL]}) for i in range(3)]
    r = Run()
    for rid, ids, params, sel in reqs:
        llm.engine.add_request(rid, ids, params, sel)
    while answers.count(True) < 5:
        for out in llm.engine.step():
            r.outputs.setdefault(out.request_id, []).append(out)
    llm.engine.abort_request("r1")
    seen = len(answers)
    r = run(llm, [], r)
    assert answers[seen] is False and answers.count(True) > 10
    for rid, ids, _, _ in (reqs[0], reqs[2]):
        assert len(check_against_reference(r, rid, ids, ref)[0]) == 24
    assert r.final("r1").finished
    assert 0 < len(r.tokens("r1")[0]) < 24
    check_against_reference(r, "r1", reqs[1][1], ref)
