"""docs/api.md's streaming edge of beam search on a live server (`python launch.py`, CPU,
demo model; fixtures in tests/helpers/api.py): `/generate` with `stream: true` and
`num_beams` > 1 sends one event, at the end, holding every beam."""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tests.helpers.api import sse_events, sse_json  # noqa: E402

pytest_plugins = ["tests.helpers.api"]


@pytest.mark.parametrize("returned", [None, 1])
def test_beam_stream_is_one_final_event_with_every_beam(http, returned):
    config = {"max_new_tokens": 6, "num_beams": 3, "ignore_eos": True, "return_output_ids": True}
    if returned is not None:
        config["num_return_sequences"] = returned
    body = {"prompt": "Beams are ranked only at the end:", "generate_config": config}
    whole = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert "[DONE]" not in events
    (event,) = sse_json(events)
    assert event["finished"] is True
    assert len(event["response"]) == (returned or 3)
    for key in ("response", "finish_reason", "output_ids", "custom_output"):
        assert event[key] == whole[key], key
    assert all(len(ids) == 6 for ids in event["output_ids"])
