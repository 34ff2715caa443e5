"""/v1/models lists the custom head's labels; /custom_output scores chat conversations, each
chat-templated as chat completions templates its messages (shared live server of
tests/helpers/api.py, whose head is the demo head's subclass; values against the offline
engine on the ids transformers' own chat template gives)."""

from __future__ import annotations

import numpy as np
import pytest

from tapserve.api.config import ApiConfig
from tapserve.model.demo import ensure_demo_checkpoint

pytest_plugins = ["tests.helpers.api"]
CONVERSATIONS = [
    [{"role": "user", "content": "Is the sea blue?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Is the sea blue?"},
        {"role": "assistant", "content": "Mostly."},
    ],
]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_demo_checkpoint()))


def _templated(reference, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    text = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return reference(text, add_special_tokens=False)["input_ids"]


def _offline_value(offline, ids: list[int], params: dict | None = None) -> np.ndarray:
    from tapserve.api.sampling_params import SamplingParams

    result = offline.generate([ids], SamplingParams(max_new_tokens=0), [params])[0]
    return result.custom_output.numpy()


def test_models_list_the_head_labels(http):
    card = http.get("/v1/models").json()["data"][0]
    assert card["custom_output_labels"] == ["LABEL_0", "LABEL_1"]
    assert http.get(f"/v1/models/{card['id']}").json()["custom_output_labels"] == [
        "LABEL_0",
        "LABEL_1",
    ]


def test_labels_travel_to_the_api_process():
    for labels in (["a,b", "c d"], "reward", None):
        config = ApiConfig(ipc_dir="/x", tokenizer="/t", custom_output_labels=labels)
        assert ApiConfig.from_argv(config.to_argv()).custom_output_labels == labels


def test_custom_output_scores_conversations(http, offline, reference):
    r = http.post(
        "/custom_output",
        json={
            "conversations": CONVERSATIONS,
            "custom_output_params": [None, {"position": 3}],
        },
    )
    assert r.status_code == 200, r.text
    outputs = r.json()["outputs"]
    for out, messages, params in zip(outputs, CONVERSATIONS, [None, {"position": 3}]):
        ids = _templated(reference, messages)
        assert out["input_len"] == len(ids)
        np.testing.assert_allclose(
            out["custom_output"], _offline_value(offline, ids, params), rtol=1e-5, atol=1e-6
        )
    # the chat template fields apply to every conversation
    r = http.post(
        "/custom_output",
        json={"conversations": CONVERSATIONS[1:], "add_generation_prompt": False},
    )
    ids = _templated(reference, CONVERSATIONS[1], add_generation_prompt=False)
    assert r.json()["outputs"][0]["input_len"] == len(ids)
    np.testing.assert_allclose(
        r.json()["outputs"][0]["custom_output"], _offline_value(offline, ids), rtol=1e-5, atol=1e-6
    )


def test_custom_output_conversation_errors(http):
    both = http.post("/custom_output", json={"prompts": ["x"], "conversations": CONVERSATIONS})
    neither = http.post("/custom_output", json={})
    for r in (both, neither):
        assert r.status_code == 400
        assert r.json()["message"] == "give exactly one of prompts, conversations"
    empty = http.post("/custom_output", json={"conversations": [[]]})
    assert empty.status_code == 400 and "conversations.0" in empty.json()["message"]
    wrong_count = http.post(
        "/custom_output",
        json={"conversations": CONVERSATIONS, "custom_output_params": [None]},
    )
    assert wrong_count.status_code == 400
    # a conversation the template cannot render fails alone
    r = http.post(
        "/custom_output",
        json={
            "conversations": [CONVERSATIONS[0], [{"role": "user", "content": [{"type": "image"}]}]],
        },
    )
    assert r.status_code == 200
    first, second = r.json()["outputs"]
    assert "custom_output" in first and second["error_code"] == 605
