"""The API process's side of multi-row custom outputs (DESIGN.md "Custom outputs over many
tokens"): api/custom_rows.py, and api/generation.py driven by hand-built wire outputs as rank 0
sends them (rows as deltas, prompt rows in prefill chunks, "content_filter", API-cut stop
strings). The reference values come from `reference_row`, the rule the outputs were built by."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tapserve.api import wire
from tapserve.api.custom_rows import Rows, client_fields, join
from tapserve.api.engine_client import RequestGroup
from tapserve.api.generation import Generation
from tapserve.api.metrics import ApiMetrics
from tapserve.api.sampling_params import SamplingParams
from tapserve.api.tokenizer import TextTokenizer
from tapserve.model.demo import ensure_demo_checkpoint


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_dir(ensure_demo_checkpoint())


def reference_row(seq: int, position: int, width: int | None) -> np.ndarray:
    """The row a test head gives sequence `seq` at `position`: [] or [width] float32 values
    exact in bfloat16 (prompt rows, seq -1, are shared)."""
    base = float(position) + 0.5 * (seq + 1)
    if width is None:
        return np.array(base, np.float32)
    return np.array([base + 16 * c for c in range(width)], np.float32)


def wire_rows(array: np.ndarray, dtype: str = "float32") -> dict:
    """A wire value of `array`'s rows in `dtype` (bfloat16: the high halves of float32)."""
    array = np.ascontiguousarray(array, np.float32)
    if dtype == "bfloat16":
        data = (array.view(np.uint32) >> 16).astype("<u2").tobytes()
    else:
        data = array.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    return {"dtype": dtype, "shape": list(array.shape), "data": data}


def rows_at(seq: int, positions: list[int], width: int | None, dtype: str = "float32") -> dict:
    return wire_rows(np.stack([reference_row(seq, p, width) for p in positions]), dtype)


class _Client:
    """The RequestGroup's client: records aborts (what Generation asks of it)."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def release(self, group: RequestGroup) -> None:
        pass


def generation(tok: TextTokenizer, prompt: list[int], **params) -> Generation:
    group = RequestGroup(_Client(), ["r0"])
    return Generation(tok, group, [(prompt, SamplingParams(**params))], None, (2,))


def decoded_json(fields: dict) -> tuple[np.ndarray, list[int]]:
    return np.array(fields["custom_output"], np.float32), fields["custom_output_positions"]


# ---- api/custom_rows.py ---------------------------------------------------------------------
def test_rows_join_select_and_sort_on_raw_bytes():
    a = Rows.from_wire(rows_at(0, [7, 3], 2, "bfloat16"), [7, 3])
    b = Rows.from_wire(rows_at(0, [5], 2, "bfloat16"), [5])
    both = join([a, b])
    assert both.positions == [7, 3, 5] and bytes(both.data) == bytes(a.data) + bytes(b.data)
    ordered = both.sorted()
    assert ordered.positions == [3, 5, 7]
    fields = client_fields(both, "json")  # sent in position order
    assert fields["custom_output_positions"] == [3, 5, 7]
    want = np.stack([reference_row(0, p, 2) for p in (3, 5, 7)])
    np.testing.assert_array_equal(np.array(fields["custom_output"], np.float32), want)
    assert both.select(lambda p: p != 3).positions == [7, 5]
    assert both.since(1).positions == [3, 5] and both.since(5).positions == []
    assert client_fields(Rows(), "json") == {}


@pytest.mark.parametrize(
    "value, positions, message",
    [
        (rows_at(0, [1, 2], 3), [1], "do not match"),
        ({"dtype": "float32", "shape": [2], "data": b"\0" * 4}, [1, 2], "hold 4 bytes"),
        ({"dtype": "float64", "shape": [1], "data": b"\0" * 8}, [1], "unknown"),
        (rows_at(0, [1], None), None, "together"),
    ],
)
def test_malformed_wire_rows_are_refused(value, positions, message):
    with pytest.raises(ValueError, match=message):
        Rows.from_wire(value, positions)


def test_rows_of_another_shape_cannot_follow():
    rows = Rows.from_wire(rows_at(0, [1], 2), [1])
    with pytest.raises(ValueError, match="cannot follow"):
        rows.extend(Rows.from_wire(rows_at(0, [2], 3), [2]))


# ---- Generation -------------------------------------------------------------------------------
def test_n2_streamed_deltas_carry_their_tokens_rows_and_reassemble(tok):
    """n = 2, a 2-D head, prompt rows in two prefill chunks, -3 rows with their tokens: each
    choice's first delta holds the prompt rows, every delta the rows of its tokens; the deltas
    joined equal the whole value, which equals the reference."""
    prompt = tok.encode("the prompt of a scoring request")
    n_prompt, width = len(prompt), 3
    gen = generation(tok, prompt, n=2, max_new_tokens=8, logprobs=True)
    words = tok.encode(" one two three four five six seven eight")
    tokens = {0: words[:4], 1: words[4:7]}
    script = [
        wire.RequestOutput("r0", custom_rows=rows_at(-1, [1, 3], width), custom_positions=[1, 3]),
        wire.RequestOutput("r0", custom_rows=rows_at(-1, [5], width), custom_positions=[5]),
    ]
    sent = {0: 0, 1: 0}
    for step, counts in enumerate([(1, 0), (2, 2), (1, 1)]):
        sequences = []
        for seq, count in enumerate(counts):
            if not count:
                continue
            ids = tokens[seq][sent[seq] : sent[seq] + count]
            positions = [n_prompt + sent[seq] + i for i in range(count)]
            sequences.append(
                wire.SequenceOutput(
                    seq,
                    ids,
                    [-0.5] * count,
                    [[[t, -0.5]] for t in ids],
                    "length" if step == 2 else None,
                    custom_rows=rows_at(seq, positions, width),
                    custom_positions=positions,
                )
            )
            sent[seq] += count
        script.append(wire.RequestOutput("r0", sequences=sequences, finished=step == 2))
    streamed: dict[int, list[Rows]] = {0: [], 1: []}
    tokens_seen = {0: 0, 1: 0}
    for out in script:
        for delta in gen.apply(out):
            want = [] if streamed[delta.index] else [1, 3, 5]
            want += [n_prompt + tokens_seen[delta.index] + i for i in range(len(delta.token_ids))]
            assert delta.rows.positions == want, (delta.index, delta.rows.positions)
            assert len(delta.logprobs) == len(delta.token_ids)
            tokens_seen[delta.index] += len(delta.token_ids)
            streamed[delta.index].append(delta.rows)
            chunk = gen.delta_fields(delta.index, delta.rows, "json")
            assert chunk.get("custom_output_positions", []) == want
    for index in (0, 1):
        whole = gen.value_fields(index, "json")
        assert client_fields(join(streamed[index]), "json") == whole
        values, positions = decoded_json(whole)
        generated = [n_prompt + i for i in range(len(tokens[index]))]
        assert positions == [1, 3, 5] + generated
        want = [reference_row(-1, p, width) for p in (1, 3, 5)]
        want += [reference_row(index, p, width) for p in generated]
        np.testing.assert_array_equal(values, np.stack(want))
    assert gen.usage()["completion_tokens"] == len(tokens[0]) + len(tokens[1])


def test_content_filter_keeps_the_flagged_row_but_not_its_token(tok):
    """The flagged token (not on the wire) has no text or id; its row is the last, at the
    position after the delivered tokens; it counts in usage; held bytes are dropped."""
    prompt = tok.encode("moderate this")
    n_prompt = len(prompt)
    ids = tok.encode("ok 日")
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:i]))
    delivered = ids[:cut]  # the last of them opens a character the flagged token would end
    gen = generation(tok, prompt, max_new_tokens=16)
    first = [n_prompt + i for i in range(cut - 1)]
    flagged = n_prompt + cut
    deltas = gen.apply(
        wire.RequestOutput(
            "r0",
            sequences=[
                wire.SequenceOutput(
                    0, delivered[:-1], custom_rows=rows_at(0, first, None), custom_positions=first
                )
            ],
        )
    )
    closing = [n_prompt + cut - 1, flagged]
    deltas += gen.apply(
        wire.RequestOutput(
            "r0",
            sequences=[
                wire.SequenceOutput(
                    0,
                    delivered[-1:],
                    finish_reason="content_filter",
                    custom_rows=rows_at(0, closing, None),
                    custom_positions=closing,
                )
            ],
            finished=True,
        )
    )
    (choice,) = gen.choices()
    assert choice.finish_reason == "content_filter" and choice.stop_reason is None
    assert choice.token_ids == delivered
    assert "".join(d.text for d in deltas) == choice.text == "ok "  # no U+FFFD flushed
    assert deltas[-1].rows.positions == closing and deltas[-1].finish_reason == "content_filter"
    values, positions = decoded_json(gen.value_fields(0, "json"))
    assert positions == [*first, *closing] and positions[-1] == flagged
    np.testing.assert_array_equal(values, [reference_row(0, p, None) for p in positions])
    assert gen.usage()["completion_tokens"] == len(delivered) + 1
    assert gen.choice_usage(0)["completion_tokens"] == len(delivered) + 1


def test_rows_of_tokens_cut_by_an_api_stop_string_are_dropped(tok):
    """The API detects the stop string: the tokens after it, and their rows, never appear."""
    prompt = tok.encode("count:")
    n_prompt = len(prompt)
    ids = tok.encode(" one two STOP three four")
    positions = [n_prompt + i for i in range(len(ids))]
    gen = generation(tok, prompt, max_new_tokens=32, stop=["STOP"])
    (delta,) = gen.apply(
        wire.RequestOutput(
            "r0",
            sequences=[
                wire.SequenceOutput(
                    0, ids, custom_rows=rows_at(0, positions, 2), custom_positions=positions
                )
            ],
        )
    )
    (choice,) = gen.choices()
    assert choice.finish_reason == "stop" and choice.text == " one two "
    kept = len(choice.token_ids)
    assert 0 < kept < len(ids)
    assert delta.rows.positions == positions[:kept]
    assert gen.value_fields(0, "json")["custom_output_positions"] == positions[:kept]
    assert gen.group.client.aborted == ["r0"]  # its only choice is cut: the request goes
    later = positions[-1] + 1  # a row after the cut is ignored
    gen.apply(
        wire.RequestOutput(
            "r0",
            sequences=[
                wire.SequenceOutput(
                    0, [ids[0]], custom_rows=rows_at(0, [later], 2), custom_positions=[later]
                )
            ],
        )
    )
    assert gen.value_fields(0, "json")["custom_output_positions"] == positions[:kept]


def test_base64_rows_are_the_bytes_on_the_wire(tok):
    """bfloat16 and float32 rows, non-finite values included, come back bit for bit."""
    prompt = tok.encode("bits")
    n_prompt = len(prompt)
    for dtype in ("bfloat16", "float32"):
        gen = generation(tok, prompt, max_new_tokens=4)
        special = np.array([[np.nan, np.inf], [-np.inf, -0.0]], np.float32)
        prompt_rows = wire_rows(special, dtype)
        token_rows = rows_at(0, [n_prompt], 2, dtype)
        gen.apply(wire.RequestOutput("r0", custom_rows=prompt_rows, custom_positions=[0, 1]))
        gen.apply(
            wire.RequestOutput(
                "r0",
                sequences=[
                    wire.SequenceOutput(
                        0, [5], None, None, "length", None, None, token_rows, [n_prompt]
                    )
                ],
                finished=True,
            )
        )
        fields = gen.value_fields(0, "base64")
        value = fields["custom_output"]
        assert value["dtype"] == dtype and value["shape"] == [3, 2]
        assert base64.b64decode(value["data"]) == prompt_rows["data"] + token_rows["data"]
        assert fields["custom_output_positions"] == [0, 1, n_prompt]
        as_json = gen.value_fields(0, "json")["custom_output"]
        assert as_json[0] == ["NaN", "Infinity"] and as_json[1] == ["-Infinity", -0.0]


def test_a_last_generated_row_comes_with_the_final_output(tok):
    """A list with -2: the row of the last token arrives with the finish, after its token."""
    prompt = tok.encode("score the answer")
    n_prompt = len(prompt)
    ids = tok.encode(" fine")
    gen = generation(tok, prompt, max_new_tokens=len(ids))
    gen.apply(wire.RequestOutput("r0", custom_rows=rows_at(-1, [0], None), custom_positions=[0]))
    gen.apply(wire.RequestOutput("r0", sequences=[wire.SequenceOutput(0, ids)]))
    last = n_prompt + len(ids) - 1
    (delta,) = gen.apply(
        wire.RequestOutput(
            "r0",
            sequences=[
                wire.SequenceOutput(
                    0,
                    [],
                    finish_reason="length",
                    custom_rows=rows_at(0, [last], None),
                    custom_positions=[last],
                )
            ],
            finished=True,
        )
    )
    assert delta.rows.positions == [last] and delta.token_ids == []
    values, positions = decoded_json(gen.value_fields(0, "json"))
    assert positions == [0, last]
    np.testing.assert_array_equal(
        values, [reference_row(-1, 0, None), reference_row(0, last, None)]
    )


def test_prompt_only_scoring_delivers_the_prompt_rows(tok):
    prompt = tok.encode("a prompt to score at many positions")
    gen = generation(tok, prompt, max_new_tokens=0)
    positions = [0, 2, len(prompt) - 1]
    (delta,) = gen.apply(
        wire.RequestOutput(
            "r0",
            sequences=[wire.SequenceOutput(0, finish_reason="length")],
            finished=True,
            custom_rows=rows_at(-1, positions, 4, "float16"),
            custom_positions=positions,
        )
    )
    assert delta.rows.positions == positions
    fields = gen.value_fields(0, "json")
    assert fields["custom_output_positions"] == positions
    np.testing.assert_array_equal(
        np.array(fields["custom_output"], np.float32),
        np.stack([reference_row(-1, p, 4) for p in positions]),
    )


def test_a_one_row_value_keeps_its_shape_and_has_no_positions(tok):
    prompt = tok.encode("one row")
    gen = generation(tok, prompt, max_new_tokens=4)
    value = wire_rows(np.array([1.5, 2.5], np.float32)[None, :])
    gen.apply(wire.RequestOutput("r0", custom_output=value))
    (delta,) = gen.apply(wire.RequestOutput("r0", sequences=[wire.SequenceOutput(0, [7])]))
    assert gen.delta_fields(delta.index, delta.rows, "json") == {"custom_output": [[1.5, 2.5]]}
    assert gen.value_fields(0, "json") == {"custom_output": [[1.5, 2.5]]}


def test_metrics_export_the_rows_counters():
    stats = wire.EngineStats(
        custom_output_rows=12,
        custom_output_bytes=96,
        custom_output_content_filter=3,
        custom_output_should_stop_errors=1,
    )
    text = ApiMetrics(lambda: stats).render().decode()
    samples = dict(line.split() for line in text.splitlines() if not line.startswith("#"))
    assert samples["tapserve_custom_output_rows_total"] == "12.0"
    assert samples["tapserve_custom_output_bytes_total"] == "96.0"
    assert samples["tapserve_content_filter_finishes_total"] == "3.0"
    assert samples["tapserve_custom_output_should_stop_errors_total"] == "1.0"
