"""LAST_GENERATED (-2): the handler on each sequence's last generated token, against
transformers (the head on `output_hidden_states`' last element of prompt + generated ids, at the
last position): greedy, n = 3 sampled, beams; finishing by EOS, stop token and length; one
handler call per step (the scoring row rides in an ordinary decode/mixed step, no logits);
606 for exactly the failing step's requests; aborted requests never reach the handler;
preemption while scoring; the wire field; and the HTTP API (per choice values, top level =
last choice, streaming's final chunk, stop strings drop the value)."""

from __future__ import annotations

import pytest
import torch

from tapserve.api import wire
from tapserve.api.sampling_params import SamplingParams
from tapserve.api.wire import EXECUTION_EXCEPTION, INVALID_PARAMS
from tapserve.coordinator.custom_outputs import decode_value
from tapserve.model.custom_output import CustomOutputHandler
from tapserve.ranks.plan import StepKind
from tests.helpers.custom import (
    Reference,
    assert_close,
    assert_no_leaks,
    greedy,
    make_llm,
    prompt,
    run,
)

torch.set_num_threads(1)
pytest_plugins = [
    "tests.helpers.custom_fixtures",
    "tests.helpers.api",
]  # ckpt, ref, llm, plain_llm; server
pytest.importorskip("transformers")

LAST = {"position": CustomOutputHandler.LAST_GENERATED}


def seq_values(r, rid: str) -> dict[int, torch.Tensor]:
    """Sequence index -> its own value; each arrives once its sequence has finished, together
    with its finish_reason."""
    values: dict[int, torch.Tensor] = {}
    for out in r.outputs[rid]:
        assert out.custom_output is None  # no request-level (prompt) value
        for s in out.sequences:
            if s.custom_output is not None:
                assert s.finish_reason in ("stop", "length"), s
                values[s.index] = decode_value(s.custom_output)
            elif s.index not in values:
                assert s.finish_reason is None or s.finish_reason == "error", s
    return values


def check_values(r, rid: str, ids: list[int], ref: Reference) -> dict[int, list[int]]:
    tokens, values = r.tokens(rid), seq_values(r, rid)
    assert sorted(values) == sorted(tokens)
    for i, out in tokens.items():
        full = ids + out
        assert_close(values[i], ref.head(full, len(full) - 1))
    return tokens


def one_call_per_step(r) -> None:
    for plan, calls in r.steps:
        assert calls == (1 if plan.custom_rows.size else 0)
        assert not set(plan.custom_rows.tolist()) & set(plan.logit_rows.tolist())


def test_greedy_matches_transformers_and_tokens_unchanged(llm, plain_llm, ref) -> None:
    reqs = [
        (f"g{i}", prompt(n, 10 + i), greedy(max_new_tokens=m, logprobs=True), LAST)
        for i, (n, m) in enumerate([(5, 1), (13, 4), (21, 7), (8, 16)])
    ]
    r = run(llm, reqs)
    assert not r.errors
    one_call_per_step(r)
    # the scoring rows ride in decode steps (vectorized decode plan) without logits
    assert any(p.kind is StepKind.DECODE and p.custom_rows.size for p, _ in r.steps)
    for rid, ids, params, _ in reqs:
        tokens = check_values(r, rid, ids, ref)
        assert len(tokens[0]) == params.max_new_tokens
        assert r.finish_reasons(rid) == {0: "length"}
    r0 = run(plain_llm, [(rid, ids, params, None) for rid, ids, params, _ in reqs])
    for rid, *_ in reqs:
        assert r0.tokens(rid) == r.tokens(rid)
        lp = [s.new_logprobs for o in r.outputs[rid] for s in o.sequences if s.new_logprobs]
        lp0 = [s.new_logprobs for o in r0.outputs[rid] for s in o.sequences if s.new_logprobs]
        # the scoring rows change the batches' shapes, so logprobs agree to float rounding
        torch.testing.assert_close(
            torch.tensor(sum(lp, [])), torch.tensor(sum(lp0, [])), rtol=1e-5, atol=1e-5
        )


def test_finish_by_stop_token_and_eos(llm, plain_llm, ref, monkeypatch) -> None:
    ids = prompt(11, 40)
    r0 = run(plain_llm, [("free", ids, greedy(max_new_tokens=6), None)])
    out = r0.tokens("free")[0]
    stop_tok = out[2]
    first = out.index(stop_tok)
    r = run(llm, [("stop", ids, greedy(max_new_tokens=6, stop_token_ids=[stop_tok]), LAST)])
    tokens = check_values(r, "stop", ids, ref)
    assert tokens[0] == out[: first + 1] and r.finish_reasons("stop") == {0: "stop"}
    # EOS: the stop token counts as kept, the value is computed on it
    monkeypatch.setattr(llm.engine.options, "eos_token_ids", [stop_tok])
    r = run(llm, [("eos", ids, greedy(max_new_tokens=6), LAST)])
    tokens = check_values(r, "eos", ids, ref)
    assert tokens[0] == out[: first + 1] and r.finish_reasons("eos") == {0: "stop"}


def test_n3_sampled_each_its_own_value(llm, ref) -> None:
    ids = prompt(17, 50)
    params = SamplingParams(max_new_tokens=5, n=3, temperature=1.0, seed=11)
    r = run(
        llm,
        [
            ("n3", ids, params, LAST),
            ("short", prompt(9, 51), SamplingParams(max_new_tokens=1, n=3, seed=2), LAST),
        ],
    )
    one_call_per_step(r)
    for rid, p in (("n3", ids), ("short", prompt(9, 51))):
        tokens = check_values(r, rid, p, ref)
        assert len(tokens) == 3
    values = seq_values(r, "n3")
    assert len({tuple(v.flatten().tolist()) for v in values.values()}) == 3


def test_beams_each_its_own_value(llm, ref) -> None:
    ids = prompt(14, 60)
    r = run(
        llm,
        [
            (
                "beams",
                ids,
                SamplingParams(max_new_tokens=4, num_beams=2, n=2, temperature=0.0),
                LAST,
            ),
            ("beams3", prompt(10, 61), SamplingParams(max_new_tokens=3, num_beams=3), LAST),
        ],
    )
    one_call_per_step(r)
    tokens = check_values(r, "beams", ids, ref)
    assert len(tokens) == 2
    assert len(check_values(r, "beams3", prompt(10, 61), ref)) == 1


def test_mixed_with_prompt_positions_and_chunked_prefill(llm, ref) -> None:
    """Scoring rows share the step's one handler call with prompt rows (mixed steps)."""
    a, b = prompt(6, 70), prompt(60, 71)  # b's prefill spans two chunks of 32 tokens
    r = run(
        llm,
        [
            ("last", a, greedy(max_new_tokens=2), LAST),
            ("prompt", b, greedy(max_new_tokens=2), {"position": 57}),
        ],
    )
    one_call_per_step(r)
    assert any(p.kind is StepKind.MIXED and p.custom_rows.size >= 2 for p, _ in r.steps)
    check_values(r, "last", a, ref)
    assert_close(r.value("prompt"), ref.head(b, 57))


def test_preemption_while_scoring(ckpt, ref, monkeypatch) -> None:
    """A tight KV cache: "b" finishes while "a" fills the cache, its last token needs a new
    block, so "b" (the latest arrival) is preempted while scoring and recomputed: the value
    then comes from the recompute's last prefill row. Values match, no block leaks."""
    from tapserve.coordinator.scheduler import Scheduler

    preempted: list[bool] = []
    original = Scheduler._preempt

    def spy(self, seqs, batch):
        preempted.extend(s.scoring_reason is not None for s in seqs)
        return original(self, seqs, batch)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    tight = make_llm(ckpt, num_kv_blocks=9, max_model_len=None)  # what the cache holds
    reqs = [
        ("a", prompt(21, 80), greedy(max_new_tokens=40), LAST),
        ("b", prompt(16, 81), greedy(max_new_tokens=17), LAST),
    ]
    r = run(tight, reqs)
    assert not r.errors and any(preempted), preempted
    for rid, ids, _, _ in reqs:
        check_values(r, rid, ids, ref)


def test_scoring_only_with_last_generated_is_605(llm) -> None:
    r = run(llm, [("zero", prompt(8, 90), SamplingParams(max_new_tokens=0), LAST)])
    assert r.errors["zero"].code == INVALID_PARAMS and "LAST_GENERATED" in r.errors["zero"].message
    assert_no_leaks(llm)


def test_handler_failure_fails_exactly_that_steps_requests(llm, ref) -> None:
    head = llm.engine.handler
    head.fail_calls = {len(head.calls)}  # the next call: the scoring step of "a" and "b"
    try:
        r = run(
            llm,
            [
                ("a", prompt(9, 100), greedy(max_new_tokens=2), LAST),
                ("b", prompt(12, 101), greedy(max_new_tokens=2), LAST),
                ("later", prompt(7, 102), greedy(max_new_tokens=5), LAST),
                ("none", prompt(7, 103), greedy(max_new_tokens=2), {"none": True}),
            ],
        )
    finally:
        head.fail_calls = set()
    for rid in ("a", "b"):
        final = r.final(rid)
        assert final.error_code == EXECUTION_EXCEPTION and final.finished
        assert "custom output processor failed" in final.error_message
    check_values(r, "later", prompt(7, 102), ref)
    assert r.final("none").error_code is None and r.tokens("none")[0]


def test_aborted_request_never_reaches_the_handler(llm) -> None:
    engine, head = llm.engine, llm.engine.handler
    engine.add_request("gone", prompt(10, 110), greedy(max_new_tokens=3), LAST)
    calls = len(head.calls)
    got: list[int] = []
    while len(got) < 3:  # until the last token is sampled: its scoring step comes next
        for out in engine.step():
            got += [t for s in out.sequences for t in s.new_token_ids]
    engine.abort_request("gone")
    while engine.has_work():
        outs = list(engine.step())
    assert len(head.calls) == calls
    assert outs[-1].sequences[0].finish_reason == "abort" and outs[-1].finished
    assert outs[-1].sequences[0].custom_output is None
    assert_no_leaks(llm)


def test_wire_field_is_optional() -> None:
    value = {"dtype": "float32", "shape": [1, 3], "data": b"\x00" * 12}
    with_value = wire.Outputs(
        [
            wire.RequestOutput(
                "r",
                sequences=[
                    wire.SequenceOutput(0, [5], finish_reason="length", custom_output=value)
                ],
            )
        ]
    )
    assert wire.decode(wire.encode(with_value)) == with_value
    plain = wire.Outputs([wire.RequestOutput("r", sequences=[wire.SequenceOutput(0, [5])])])
    raw = wire.encode(plain)
    assert b"custom_output\xc0" in raw  # the request-level field only: no per-sequence key
    assert raw.count(b"custom_output") == 1
    assert wire.decode(raw) == plain


def test_engine_stop_strings_flag_on_the_wire() -> None:
    """Sent (true) on the accept answer of a request whose stop strings rank 0 watches,
    absent otherwise (the per-step outputs stay as small as before)."""
    flagged = wire.Outputs([wire.RequestOutput("r", engine_stop_strings=True)])
    assert wire.decode(wire.encode(flagged)) == flagged
    plain = wire.Outputs([wire.RequestOutput("r")])
    assert b"engine_stop_strings" not in wire.encode(plain)
    assert wire.decode(wire.encode(plain)) == plain


# ---- HTTP (live server: demo model, demo head; `{"position": -2}` selects LAST_GENERATED) ---


def _expected(offline, ids: list[int]):
    import numpy as np

    result = offline.generate(
        [ids], SamplingParams(max_new_tokens=0), [{"position": len(ids) - 1}]
    )[0]
    return np.asarray(result.custom_output.numpy().tolist())


def test_http_per_choice_values(http, offline) -> None:
    import numpy as np

    ids = http.post("/tokenize", json={"prompt": "The lighthouse keeper said"}).json()["tokens"]
    # native: one value per sequence, each on its own output ids
    body = http.post(
        "/generate",
        json={
            "prompt": "The lighthouse keeper said",
            "custom_output_params": LAST,
            "generate_config": {
                "max_new_tokens": 5,
                "num_return_sequences": 2,
                "temperature": 1.0,
                "seed": 5,
                "return_output_ids": True,
            },
        },
    ).json()
    assert len(body["custom_output"]) == 2
    for value, out_ids in zip(body["custom_output"], body["output_ids"]):
        np.testing.assert_allclose(value, _expected(offline, ids + out_ids), rtol=1e-4, atol=1e-5)
    greedy_ids = http.post(
        "/generate",
        json={
            "prompt": "The lighthouse keeper said",
            "custom_output_params": LAST,
            "generate_config": {"max_new_tokens": 5, "temperature": 0.0, "return_output_ids": True},
        },
    ).json()["output_ids"]
    expected = _expected(offline, ids + greedy_ids)
    # OpenAI: each choice its own value, top level = the last choice's
    req = {
        "model": "tapserve-demo",
        "prompt": "The lighthouse keeper said",
        "max_tokens": 5,
        "custom_output_params": LAST,
    }
    res = http.post("/v1/completions", json={**req, "n": 3, "temperature": 1.0, "seed": 9}).json()
    values = [c["extra_outputs"]["custom_output"] for c in res["choices"]]
    assert len(values) == 3 and res["extra_outputs"]["custom_output"] == values[-1]
    res = http.post("/v1/completions", json={**req, "temperature": 0.0}).json()
    np.testing.assert_allclose(
        res["choices"][0]["extra_outputs"]["custom_output"], expected, rtol=1e-4, atol=1e-5
    )
    # streaming: the value arrives in the choice's final chunk only
    with http.stream(
        "POST", "/v1/completions", json={**req, "temperature": 0.0, "stream": True}
    ) as resp:
        from tests.helpers.api import sse_events, sse_json

        chunks = sse_json(sse_events(resp))
    with_value = [c for c in chunks if c["choices"] and "extra_outputs" in c["choices"][0]]
    assert len(with_value) == 1 and with_value[0]["choices"][0]["finish_reason"] == "length"
    np.testing.assert_allclose(
        with_value[0]["choices"][0]["extra_outputs"]["custom_output"],
        expected,
        rtol=1e-4,
        atol=1e-5,
    )
    check_stop_string_cut(http, offline, ids, req)
    # max_tokens = 0 with LAST_GENERATED: 605
    bad = http.post("/v1/completions", json={**req, "max_tokens": 0})
    assert bad.status_code == 400 and "605" in bad.text


def _token_aligned_stop(decode, out_ids: list[int]) -> int | None:
    """An index k whose token's text starts right where out_ids[:k]'s text ends and does not
    occur before it: a stop string equal to that text cuts exactly before token k."""
    for k in range(1, len(out_ids)):
        before, piece = decode(out_ids[:k]), decode(out_ids[k : k + 1])
        if piece.strip() and before + piece == decode(out_ids[: k + 1]) and piece not in before:
            return k
    return None


def check_stop_string_cut(http, offline, ids: list[int], req: dict) -> None:
    """A stop string cuts the text; rank 0 cuts at the same token (it detects stop strings of
    LAST_GENERATED requests itself) and scores the last kept token: the value is the head on
    prompt + the kept tokens, also in the final streamed chunk; with the stop string included
    in the output, the token that completed it is kept and scored."""
    import numpy as np

    from tests.helpers.api import sse_events, sse_json

    def decode(tokens: list[int]) -> str:
        return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]

    sampled = {"temperature": 1.0, "seed": 3}  # seeded: the same tokens in every request
    out_ids = http.post(
        "/generate",
        json={
            "prompt": "The lighthouse keeper said",
            "custom_output_params": LAST,
            "generate_config": {"max_new_tokens": 16, **sampled, "return_output_ids": True},
        },
    ).json()["output_ids"]
    k = _token_aligned_stop(decode, out_ids)
    assert k is not None, f"no token-aligned stop string in {out_ids}"
    stop = decode(out_ids[k : k + 1])
    body = {**req, "max_tokens": 16, **sampled, "stop": [stop]}
    cut = http.post("/v1/completions", json=body).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == decode(out_ids[:k])
    kept_value = _expected(offline, ids + out_ids[:k])
    np.testing.assert_allclose(
        cut["extra_outputs"]["custom_output"], kept_value, rtol=1e-4, atol=1e-5
    )
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        chunks = sse_json(sse_events(resp))
    final = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "stop"
    np.testing.assert_allclose(
        final[0]["choices"][0]["extra_outputs"]["custom_output"], kept_value, rtol=1e-4, atol=1e-5
    )
    included = http.post(
        "/v1/completions", json={**body, "include_stop_str_in_output": True}
    ).json()["choices"][0]
    assert included["text"] == decode(out_ids[: k + 1])
    np.testing.assert_allclose(
        included["extra_outputs"]["custom_output"],
        _expected(offline, ids + out_ids[: k + 1]),
        rtol=1e-4,
        atol=1e-5,
    )


def test_stop_string_scores_the_last_kept_token(ckpt, ref, tmp_path_factory) -> None:
    """Rank 0 detects a LAST_GENERATED request's stop strings (given the serving tokenizer;
    here the demo model's, which decodes this checkpoint's ids): the value is the head on
    transformers' hidden state of prompt + the tokens of the kept text; the tokens after it
    are dropped (the output carried them first, so the API process cuts in the same place)."""
    from tapserve.api.tokenizer import TextTokenizer
    from tapserve.model.demo import ensure_demo_checkpoint

    decoder = TextTokenizer.from_dir(ensure_demo_checkpoint(tmp_path_factory.mktemp("d") / "demo"))
    llm = make_llm(ckpt)
    llm.engine.text_decoder = decoder
    ids, sampled = prompt(15, 80), dict(max_new_tokens=16, temperature=1.0, seed=4)
    out = run(llm, [("free", ids, SamplingParams(**sampled), LAST)]).tokens("free")[0]
    k = _token_aligned_stop(decoder.decode, out)
    assert k is not None, out
    r = run(
        llm,
        [
            ("cut", ids, SamplingParams(**sampled, stop=[decoder.decode(out[k : k + 1])]), LAST),
            ("other", prompt(9, 81), greedy(max_new_tokens=6), LAST),
        ],
    )
    one_call_per_step(r)
    assert r.finish_reasons("cut") == {0: "stop"} and r.tokens("cut")[0] == out[: k + 1]
    assert_close(seq_values(r, "cut")[0], ref.head(ids + out[:k], len(ids) + k - 1))
    check_values(r, "other", prompt(9, 81), ref)
    assert_no_leaks(llm)
