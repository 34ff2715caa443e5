"""custom_output_params' nesting bound at the API's wire encoding: up to
MAX_PARAMS_NESTING levels of lists and maps travel as they are; one more is a 605 that names
the field, however deep the value goes (no recursion, no msgpack limit reached)."""

from __future__ import annotations

import msgpack
import pytest

from tapserve.api import wire
from tapserve.api.engine_client import MAX_PARAMS_NESTING, _encode
from tapserve.api.errors import ApiError


def nested(levels: int) -> dict:
    value: object = 7
    for _ in range(levels - 1):
        value = [value]
    return {"a": value}


def request(params: dict) -> wire.AddRequest:
    return wire.AddRequest("r", [1, 2], {"max_new_tokens": 1}, params)


def test_the_bound_is_exact() -> None:
    sent = wire.decode(_encode(request(nested(MAX_PARAMS_NESTING))))
    assert sent.custom_output_params == nested(MAX_PARAMS_NESTING)
    for levels in (MAX_PARAMS_NESTING + 1, 5000):
        with pytest.raises(ApiError) as e:
            _encode(request(nested(levels)))
        assert e.value.code == 605 and e.value.param == "custom_output_params"
        assert "nested too deeply" in e.value.message
    with pytest.raises(ValueError):  # what the bound keeps away: msgpack's own limit
        msgpack.packb(nested(5000))
