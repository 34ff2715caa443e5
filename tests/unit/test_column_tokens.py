"""The API process's queue of column tokens (api/engine_client.py): a request's plain decode
tokens queued one by one read as one output holding them all, in order, never across
another output of the same request (the live API tests stream through it: texts, stop
strings and the chunk rules unchanged)."""

from __future__ import annotations

from tapserve.api import wire
from tapserve.api.engine_client import ColumnToken, coalesced


def tokens_of(out: wire.RequestOutput) -> list[int]:
    return out.sequences[0].new_token_ids


def test_runs_join_per_request_and_keep_their_order() -> None:
    full = wire.RequestOutput("a", True, [wire.SequenceOutput(0, [9], new_logprobs=[-0.5])])
    items = [ColumnToken("a", 1), ColumnToken("b", 2), ColumnToken("a", 3), full]
    items += [ColumnToken("a", 4), ColumnToken("b", 5), ColumnToken("a", 6)]
    out = coalesced(items)
    assert [(o.request_id, tokens_of(o)) for o in out] == [
        ("a", [1, 3]),
        ("b", [2, 5]),
        ("a", [9]),
        ("a", [4, 6]),
    ]
    assert out[2] is full
    assert all(o.accepted and not o.finished and o.sequences[0].index == 0 for o in out)
    assert coalesced([]) == [] and coalesced([full]) == [full]
