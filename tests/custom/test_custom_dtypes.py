"""dtype end to end: each allowed handler dtype reaches the wire value bit-exactly (and through
the msgpack codec and the API side's numpy decoding); output-rule violations fail exactly the
requests with rows in that call (606) and the engine keeps serving."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tapserve.api import wire
from tapserve.api.values import to_array
from tapserve.api.wire import EXECUTION_EXCEPTION
from tapserve.coordinator.custom_outputs import decode_value
from tapserve.model.custom_output import ALLOWED_DTYPES
from tests.helpers.custom import (
    HEAD_WIDTH,
    assert_close,
    greedy,
    make_head_checkpoint,
    make_llm,
    prompt,
    run,
)

torch.set_num_threads(1)
pytest.importorskip("transformers")

BITS = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.int32: torch.int32,
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_head_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def llm(ckpt: Path):
    return make_llm(ckpt, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def float32_values(llm) -> dict[str, torch.Tensor]:
    """The plain float32 head values of the prompts used below (no prefix cache: every run
    computes the same hidden states)."""
    r = run(llm, requests())
    return {rid: r.value(rid) for rid, *_ in requests()}


def requests():
    return [
        ("p", prompt(9, 1), greedy(max_new_tokens=2), {"position": 2}),
        ("q", prompt(12, 2), greedy(max_new_tokens=2), None),
    ]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.dtype])


@pytest.mark.parametrize("dtype", list(ALLOWED_DTYPES))
def test_dtype_round_trips_bit_exactly(llm, float32_values, dtype) -> None:
    handler = llm.engine.handler
    handler.mode, handler.out_dtype = "dtype", dtype
    try:
        first_call = len(handler.outputs)
        r = run(llm, requests())
    finally:
        handler.mode = "ok"
    produced = handler.outputs[first_call:]
    assert len(produced) == 1 and produced[0].shape[0] == 2  # both rows in one call
    out = produced[0]
    for k, (rid, *_) in enumerate(requests()):
        raw = r.final(rid).custom_output
        assert raw["dtype"] == ALLOWED_DTYPES[dtype]
        assert raw["shape"] == [1, out.shape[1]]
        row = out[k : k + 1]
        assert raw["data"] == bits(row).numpy().tobytes()
        value = decode_value(raw)
        assert value.dtype == dtype and torch.equal(bits(value), bits(row))
        # the row is this request's own (not just some row of the call)
        if dtype == torch.int32:
            expected = (float32_values[rid] * 1000).round().to(torch.int32)
            assert (value[:, :HEAD_WIDTH] - expected).abs().max() <= 1
        else:
            torch.testing.assert_close(
                value[:, :HEAD_WIDTH].float(),
                float32_values[rid].to(dtype).float(),
                rtol=1e-2,
                atol=1e-2,
            )
        # through the coordinator -> API codec, and the API side's numpy view (no torch)
        sent = wire.decode(wire.encode(wire.Outputs([r.final(rid)]))).outputs[0].custom_output
        assert sent == raw
        array = to_array(sent)
        widened = value.float() if dtype != torch.int32 else value
        assert array.shape == tuple(raw["shape"])
        np.testing.assert_array_equal(array, widened.numpy())  # NaN == NaN here; exact widening


def test_one_dimensional_output_keeps_shape_one(ckpt) -> None:
    llm = make_llm(ckpt, custom_module="tests.helpers.custom:CountingReward")
    r = run(llm, [("r", prompt(11, 3), greedy(max_new_tokens=1), {"position": 4})])
    raw = r.final("r").custom_output
    assert raw["dtype"] == "float32" and raw["shape"] == [1] and len(raw["data"]) == 4


@pytest.mark.parametrize(
    "mode, message",
    [
        ("float64", "dtype torch.float64 not allowed"),
        ("extra_row", "returned 3 rows for 2 selected tokens"),
        ("3d", "must be nonempty [rows] or [rows, width]"),
        ("int64", "dtype torch.int64 not allowed"),
        ("list", "expected a torch.Tensor"),
    ],
)
def test_output_rule_violation_is_606_for_those_requests(
    llm, float32_values, mode, message
) -> None:
    handler = llm.engine.handler
    handler.mode = mode
    try:
        r = run(
            llm,
            requests() + [("bystander", prompt(10, 4), greedy(max_new_tokens=2), {"none": True})],
        )
    finally:
        handler.mode = "ok"
    for rid, *_ in requests():
        final = r.final(rid)
        assert final.error_code == EXECUTION_EXCEPTION
        assert final.error_message.startswith("custom output processor failed:")
        assert message in final.error_message
        assert final.custom_output is None
    assert r.final("bystander").error_code is None
    assert len(r.tokens("bystander")[0]) >= 1
    r = run(llm, requests())  # the engine keeps serving
    for rid, *_ in requests():
        assert_close(r.value(rid), float32_values[rid])
