"""wire.Outputs' row columns: a plain token of an every-generated-token request and its row
travel in columns; encoding round-trips them and iterating expands each into the RequestOutput
a full output would have carried."""

from __future__ import annotations

import numpy as np

from tapserve.api import wire


def test_row_columns_round_trip_and_expand() -> None:
    rows = np.arange(6, dtype="<f4").reshape(3, 2)
    out = wire.Outputs(
        [wire.RequestOutput("full", True, [wire.SequenceOutput(0, [9])])],
        ["plain"],
        [7],
        ["a", "b", "a2"],
        [11, 12, 13],
        [5, 40, 6],
        {"dtype": "float32", "shape": [3, 2], "data": rows.tobytes()},
    )
    decoded = wire.decode(wire.encode(out))
    assert decoded == out and len(decoded) == 5
    expanded = list(decoded)
    assert [o.request_id for o in expanded] == ["full", "plain", "a", "b", "a2"]
    for o, want, token, position in zip(expanded[2:], rows, [11, 12, 13], [5, 40, 6]):
        (seq,) = o.sequences
        assert seq.new_token_ids == [token] and seq.custom_positions == [position]
        assert seq.custom_rows["shape"] == [1, 2]
        got = np.frombuffer(seq.custom_rows["data"], "<f4")
        assert got.tolist() == want.tolist()


def test_outputs_without_row_columns_keep_their_bytes() -> None:
    out = wire.Outputs([], ["r"], [3])
    body = wire.decode(wire.encode(out))
    assert body == out and body.rows is None and not body.row_request_ids
    assert b"row_request_ids" not in wire.encode(out)
