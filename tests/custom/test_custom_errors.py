"""Custom-output errors: selection (605 / 606 at admission, never scheduled), handler failures
(606 for exactly the requests with rows in the failing call; the rest of the batch and later
requests are served), scoring-only rules, and start-up checks (HandlerLoadError)."""

from __future__ import annotations

import pytest
import torch

from tapserve.api.sampling_params import SamplingParams
from tapserve.api.wire import EXECUTION_EXCEPTION, INVALID_PARAMS
from tapserve.model.custom_output import HandlerLoadError
from tests.helpers.custom import HEAD_WIDTH, assert_close, greedy, make_llm, prompt, run

torch.set_num_threads(1)
pytest_plugins = ["tests.helpers.custom_fixtures"]  # ckpt, ref, llm, plain_llm
pytest.importorskip("transformers")


def assert_refused(r, rid: str, code: int, llm) -> None:
    assert rid in r.errors, f"{rid} was accepted"
    assert r.errors[rid].code == code, r.errors[rid].message
    assert rid not in r.outputs and rid not in llm.engine.requests  # never scheduled
    assert all(req.request_id != rid for req in llm.engine.scheduler.waiting)


def test_selector_value_error_is_605_then_next_request_succeeds(llm, ref) -> None:
    bad, good = prompt(12, 10), prompt(12, 11)
    r = run(llm, [("bad", bad, greedy(), {"raise": "value"})])
    assert_refused(r, "bad", INVALID_PARAMS, llm)
    assert "position spec is not valid" in r.errors["bad"].message
    assert not r.steps  # nothing was scheduled
    r = run(llm, [("good", good, greedy(), {"position": 6})])
    assert r.final("good").error_code is None
    assert_close(r.value("good"), ref.head(good, 6))


def test_params_must_be_an_object(llm) -> None:
    r = run(llm, [("list", prompt(10, 15), greedy(), [1, 2])])
    assert_refused(r, "list", INVALID_PARAMS, llm)


@pytest.mark.parametrize("position", ["len", -3, -7, 3.5, True, "3"])
def test_out_of_range_or_non_integer_position_is_605(llm, position) -> None:
    ids = prompt(10, 20)
    pos = len(ids) if position == "len" else position
    r = run(llm, [("oor", ids, greedy(), {"position": pos})])
    assert_refused(r, "oor", INVALID_PARAMS, llm)


def test_other_selector_exception_is_606(llm) -> None:
    r = run(
        llm,
        [
            ("crash", prompt(10, 30), greedy(), {"raise": "runtime"}),
            ("fine", prompt(10, 31), greedy(), None),
        ],
    )
    assert_refused(r, "crash", EXECUTION_EXCEPTION, llm)
    assert (
        "RuntimeError" in r.errors["crash"].message
        and "selector crashed" in r.errors["crash"].message
    )
    assert r.final("fine").error_code is None and r.value("fine") is not None


def test_handler_objects_that_cannot_be_printed_fail_only_their_requests(llm) -> None:
    """An exception whose str() raises, or a returned object whose repr() raises, once
    ended the server while its error message was written (2026-11-30's tester): now the
    request fails alone, the others are served."""
    handler = llm.engine.handler
    r = run(
        llm,
        [
            ("raises", prompt(10, 40), greedy(), {"raise": "unprintable"}),
            ("returns", prompt(10, 41), greedy(), {"unprintable": True}),
            ("fine", prompt(10, 42), greedy(), None),
        ],
    )
    assert_refused(r, "raises", EXECUTION_EXCEPTION, llm)
    assert "Unprintable (its message could not be formatted)" in r.errors["raises"].message
    assert_refused(r, "returns", INVALID_PARAMS, llm)
    assert "returned Unprintable" in r.errors["returns"].message
    assert r.final("fine").error_code is None and r.value("fine") is not None
    handler.fail_calls, handler.fail_unprintable = {len(handler.calls)}, True
    try:
        r = run(llm, [("head", prompt(10, 43), greedy(), None)])
    finally:
        handler.fail_calls, handler.fail_unprintable = set(), False
    assert r.final("head").error_code == EXECUTION_EXCEPTION
    assert "Unprintable" in r.final("head").error_message
    r = run(llm, [("after", prompt(10, 44), greedy(), None)])
    assert r.final("after").error_code is None and r.value("after") is not None


def test_a_selector_returning_a_non_integer_says_so(llm) -> None:
    r = run(llm, [("str", prompt(10, 45), greedy(), {"position": "3"})])
    assert_refused(r, "str", INVALID_PARAMS, llm)
    assert "returned str '3', not an int position" in r.errors["str"].message
    assert r.errors["str"].param == "custom_output_params"  # (it named none: an outside tester)


def test_params_without_module_and_scoring_rules_are_605(llm, plain_llm) -> None:
    ids = prompt(10, 40)
    r = run(
        plain_llm,
        [
            ("params", ids, greedy(), {"position": 1}),
            ("score", ids, SamplingParams(max_new_tokens=0), None),
            ("plain", ids, greedy(max_new_tokens=2), None),
        ],
    )
    assert_refused(r, "params", INVALID_PARAMS, plain_llm)
    assert_refused(r, "score", INVALID_PARAMS, plain_llm)
    assert r.final("plain").error_code is None and r.final("plain").custom_output is None
    r = run(llm, [("score_none", ids, SamplingParams(max_new_tokens=0), {"none": True})])
    assert_refused(r, "score_none", INVALID_PARAMS, llm)


def test_handler_exception_fails_exactly_the_rows_of_that_call(llm, ref) -> None:
    handler, engine = llm.engine.handler, llm.engine
    a, b, c, d, e = prompt(8, 50), prompt(9, 51), prompt(8, 52), prompt(40, 53), prompt(7, 54)
    errors_before = engine.custom_stats.errors
    handler.fail_calls = {len(handler.calls)}  # the next forward call raises
    try:
        r = run(
            llm,
            [
                ("a", a, greedy(max_new_tokens=3, ignore_eos=True), {"position": 3}),
                ("b", b, SamplingParams(max_new_tokens=3, n=2, seed=1), {"position": 8}),
                ("c", c, greedy(max_new_tokens=3, ignore_eos=True), {"none": True}),
                ("d", d, greedy(max_new_tokens=3, ignore_eos=True), {"position": 35}),
            ],
        )
    finally:
        handler.fail_calls = set()
    failing = [plan for plan, calls in r.steps if plan.custom_rows.size][0]
    assert failing.custom_rows.size == 2  # a and b share the failing call; d comes later
    for rid in ("a", "b"):
        final = r.final(rid)
        assert final.finished and final.error_code == EXECUTION_EXCEPTION
        assert final.error_message.startswith("custom output processor failed:")
        assert "injected head failure" in final.error_message
        assert set(r.finish_reasons(rid).values()) == {"error"}
        assert all(o.custom_output is None for o in r.outputs[rid])
    assert engine.custom_stats.errors == errors_before + 1
    # the rest of the batch finishes normally
    for rid in ("c", "d"):
        assert r.final(rid).error_code is None
        assert r.finish_reasons(rid) == {0: "length"} and len(r.tokens(rid)[0]) == 3
    assert r.final("c").custom_output is None
    assert_close(r.value("d"), ref.head(d, 35))
    # and the engine keeps serving
    r = run(llm, [("after", e, greedy(), None)])
    assert_close(r.value("after"), ref.head(e, len(e) - 1))


@pytest.mark.parametrize(
    "spec, match",
    [
        ("tests.helpers.custom:NoForward", "no method forward"),
        ("tests.helpers.custom:MissingWeights", "no_such_head.weight"),
        ("tests.helpers.custom:BadDryRun", "dry run failed.*float64"),
        ("tests.helpers.custom:CrashingDryRun", "dry run failed.*head not initialised"),
        ("tests.helpers.custom:NoSuchClass", "no class 'NoSuchClass'"),
        ("tests/no_such_module.py", "not found"),
        ("no_such_package.heads:Head", "cannot import"),
    ],
)
def test_startup_checks(ckpt, spec, match) -> None:
    with pytest.raises(HandlerLoadError, match=match):
        make_llm(ckpt, custom_module=spec)


def test_startup_checks_on_module_files(ckpt, tmp_path) -> None:
    broken = tmp_path / "broken_head.py"
    broken.write_text("class Head:\n    def forward(self, h)\n        return h\n")
    with pytest.raises(HandlerLoadError, match="cannot load custom module.*SyntaxError"):
        make_llm(ckpt, custom_module=str(broken))
    no_loader = tmp_path / "no_loader.py"
    no_loader.write_text(
        "class Head:\n"
        "    def select_token_position(self, ids, params):\n        return 0\n"
        "    def weight_names(self):\n        return ['test_head.weight']\n"
        "    def forward(self, h):\n        return h[:, 0].float()\n"
    )
    with pytest.raises(HandlerLoadError, match="no method load_weights"):
        make_llm(ckpt, custom_module=str(no_loader))
    two = tmp_path / "two_heads.py"
    two.write_text(no_loader.read_text() + "\n\nclass Other(Head):\n    pass\n")
    with pytest.raises(HandlerLoadError, match="name the handler class"):
        make_llm(ckpt, custom_module=str(two))


HEAD = (
    "class Head:\n"
    "    def select_token_position(self, ids, params):\n        return 0\n"
    "    def forward(self, h):\n        return h[:, 0].float()\n"
)


@pytest.mark.parametrize(
    "source, match",
    [
        ("import sys\nsys.exit(0)\n" + HEAD, "cannot load custom module.*SystemExit"),
        (
            HEAD.replace("return h[:, 0].float()", "raise SystemExit(0)"),
            "dry run failed.*SystemExit",
        ),
        (
            HEAD + "    def weight_names(self):\n        return 'head.weight'\n",
            "weight_names\\(\\) must return a list of tensor names, got 'head.weight'",
        ),
        (
            HEAD + "    def weight_names(self):\n        return ['scale']\n"
            "    def load_weights(self, t):\n        raise SystemExit(7)\n",
            "load_weights\\(\\) failed: SystemExit: 7",
        ),
    ],
    ids=["exit-at-import", "exit-in-dry-run", "weight-names-a-string", "exit-in-load-weights"],
)
def test_a_handler_exiting_at_start_up_is_a_load_error(ckpt, tmp_path, source, match) -> None:
    """SystemExit at import, in the dry run or in load_weights: a HandlerLoadError with a
    message (the server then exits non-zero), not a silent exit with status 0."""
    from safetensors.torch import save_file

    module = tmp_path / "exiting_head.py"
    module.write_text(source)
    save_file({"scale": torch.ones(64)}, str(tmp_path / "exiting_head.safetensors"))
    with pytest.raises(HandlerLoadError, match=match):
        make_llm(ckpt, custom_module=str(module))


def test_package_module_reads_weights_beside_its_file(ckpt, ref, tmp_path, monkeypatch) -> None:
    """`package.module:Class` finds <module_stem>.safetensors next to the module's file."""
    from safetensors.torch import save_file

    pkg = tmp_path / "deploy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scaled.py").write_text(
        "import torch\n"
        "class Scaled:\n"
        "    def select_token_position(self, ids, params):\n        return len(ids) - 1\n"
        "    def weight_names(self):\n        return ['scale']\n"
        "    def load_weights(self, t):\n        self.scale = t['scale']\n"
        "    def forward(self, h):\n        return (h.float() * self.scale).sum(-1)\n"
    )
    scale = torch.linspace(-1, 1, 64)
    save_file({"scale": scale}, str(pkg / "scaled.safetensors"))
    monkeypatch.syspath_prepend(str(tmp_path))
    llm = make_llm(ckpt, custom_module="deploy_pkg.scaled:Scaled")
    assert torch.equal(llm.engine.handler.scale, scale)
    ids = prompt(9, 70)
    r = run(llm, [("s", ids, greedy(max_new_tokens=1), None)])
    h = ref.final_hidden(ids)[-1:]
    assert_close(r.value("s"), (h * scale).sum(-1))


def test_module_handler_with_grad_parameters(ckpt, ref) -> None:
    """nn.Module heads (parameters requiring grad) run on the engine's inference tensors."""
    llm = make_llm(ckpt, custom_module="tests.helpers.custom:ModuleHead")
    ids = prompt(13, 60)
    r = run(llm, [("m", ids, greedy(), None)])
    assert r.final("m").error_code is None, r.final("m").error_message
    assert r.value("m").shape == (1, HEAD_WIDTH)
    assert_close(r.value("m"), ref.head(ids, len(ids) - 1))


class _ExitingHandler:
    """Raises what a handler must not bring the server down with (2026-11-30's tester)."""

    def __init__(self, error: BaseException):
        self.error = error

    def select_token_position(self, input_ids, params):
        raise self.error

    def forward(self, rows):
        raise self.error


@pytest.mark.parametrize("error", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()])
def test_a_handler_exiting_is_606_not_a_stopped_server(error) -> None:
    from tapserve.coordinator.custom_outputs import (
        CustomOutputStats,
        RequestError,
        select_position,
    )
    from tapserve.coordinator.handler_rows import run_handler
    from tapserve.model.custom_output import CustomOutputError

    handler = _ExitingHandler(error)
    with pytest.raises(RequestError) as refused:
        select_position(handler, [1, 2, 3], None, 4)
    assert refused.value.code == EXECUTION_EXCEPTION
    assert type(error).__name__ in refused.value.message
    stats = CustomOutputStats()
    with pytest.raises(CustomOutputError, match=type(error).__name__):
        run_handler(handler, torch.zeros(2, 8), stats)
    assert stats.errors == 1


def test_an_output_row_over_the_limit_is_refused() -> None:
    from tapserve.model.custom_output import MAX_ROW_BYTES, CustomOutputError, check_output

    width = MAX_ROW_BYTES // 4
    assert check_output(torch.zeros(2, width), 2).shape == (2, width)  # at the limit
    with pytest.raises(CustomOutputError, match="limit"):
        check_output(torch.zeros(2, width + 1), 2)
    with pytest.raises(CustomOutputError, match="limit"):
        check_output(torch.zeros(1, 60_000_000, dtype=torch.float16), 1)
