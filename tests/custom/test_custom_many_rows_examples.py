"""The many-rows example modules, loaded by file path as `--custom-module` loads them, through
the offline LLM, every row against the head applied to transformers' final hidden states at the
row's position: examples/prm_head.py (a score per step separator in the prompt; prefill chunks
split the positions), examples/value_head.py (the last prompt token plus every generated token,
greedy and seeded n = 3), examples/moderation_head.py (every generated token; `should_stop`
ends a sequence with "content_filter" at the first token over the request's threshold)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file

from tapserve.api.sampling_params import SamplingParams
from tapserve.api.wire import INVALID_PARAMS
from tapserve.coordinator.custom_outputs import RequestError
from tests.helpers.custom import (
    HIDDEN,
    Reference,
    assert_close,
    assert_no_leaks,
    greedy,
    make_llm,
    prompt,
)

torch.set_num_threads(1)
pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PRM, VALUE, MODERATION = (
    EXAMPLES / f"{name}.py" for name in ("prm_head", "value_head", "moderation_head")
)
SEP = 198  # the PRM's step separator in these prompts
pytest_plugins = ["tests.helpers.custom_fixtures"]  # ckpt, ref


def load_example(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checkpoint_heads() -> dict[str, torch.Tensor]:
    """The PRM's and the value head's tensors, as a deployment adds them to its checkpoint
    (scaled up so that P(good) spreads over (0, 1))."""
    gen = torch.Generator().manual_seed(77)
    return {
        "prm_head.weight": torch.randn(2, HIDDEN, generator=gen) * 4 / HIDDEN**0.5,
        "prm_head.bias": torch.randn(2, generator=gen),
        "v_head.summary.weight": torch.randn(1, HIDDEN, generator=gen) / HIDDEN**0.5,
        "v_head.summary.bias": torch.randn(1, generator=gen),
    }


@pytest.fixture(scope="module")
def heads_ckpt(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared checkpoint plus heads.safetensors (no index: every file is searched)."""
    path = tmp_path_factory.mktemp("heads") / "ckpt"
    shutil.copytree(ckpt, path)
    save_file(checkpoint_heads(), str(path / "heads.safetensors"), metadata={"format": "pt"})
    return path


def linear(
    ref: Reference, ids: list[int], positions: list[int], w: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """A linear head on transformers' final hidden states of `ids` at `positions`."""
    return torch.nn.functional.linear(ref.final_hidden(ids)[positions], w, b)


def without_sep(ids: list[int]) -> list[int]:
    return [SEP + 1 if t == SEP else t for t in ids]


def with_steps(length: int, seed: int, step_ends: list[int]) -> list[int]:
    ids = without_sep(prompt(length, seed))
    for p in step_ends:
        ids[p] = SEP
    return ids


# ---- process reward: a score per step ------------------------------------------------------
def test_prm_scores_each_step_at_its_separator(heads_ckpt, ref) -> None:
    w = checkpoint_heads()
    llm = make_llm(heads_ckpt, custom_module=str(PRM))
    steps = [6, 13, 22, 33, 44]  # prefill chunks of 32 tokens split them
    solution, short = with_steps(45, 5, steps), with_steps(19, 6, [18, 4])
    plain = without_sep(prompt(12, 7))
    results = llm.generate(
        [solution, short, plain, plain],
        [SamplingParams(max_new_tokens=0), greedy(max_new_tokens=3), greedy(2), greedy(0)],
        custom_output_params=[{"step_separator": SEP}] * 4,
        raise_errors=False,
    )
    for result, ids, positions in ((results[0], solution, steps), (results[1], short, [4, 18])):
        assert result.error_code is None and result.custom_output_positions == positions
        expected = torch.softmax(
            linear(ref, ids, positions, w["prm_head.weight"], w["prm_head.bias"]), -1
        )
        assert_close(result.custom_output, expected[:, 1])
    # the generating request's sequence: its prompt rows (no generated rows selected)
    seq = results[1].outputs[0]
    assert seq.custom_output_positions == [4, 18] and len(seq.token_ids) >= 1
    assert torch.equal(seq.custom_output, results[1].custom_output)
    # no separator: no custom output, generation as usual; scoring-only without rows: 605
    assert results[2].error_code is None and results[2].custom_output is None
    assert not results[2].custom_output_positions and len(results[2].outputs[0].token_ids) == 2
    assert results[3].error_code == INVALID_PARAMS
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "params, fragment",
    [
        (None, "step_separator"),
        ({}, "step_separator"),
        ({"step_separator": "198"}, "step_separator"),
        ({"step_separator": True}, "step_separator"),
        ({"step_separator": -1}, "step_separator"),
        ({"step_separator": SEP, "steps": 3}, "steps"),
    ],
)
def test_prm_selector_refuses_bad_params(params, fragment) -> None:
    head = load_example(PRM).PrmHead()
    with pytest.raises(ValueError, match=fragment):
        head.select_token_position([1, SEP, 2], params)
    assert head.select_token_position([SEP, 5, SEP], {"step_separator": SEP}) == [0, 2]
    assert head.select_token_position([5, 6], {"step_separator": SEP}) == []


def test_prm_bad_params_are_605_and_harm_nothing_else(heads_ckpt) -> None:
    llm = make_llm(heads_ckpt, custom_module=str(PRM))
    ids = with_steps(10, 8, [3, 9])
    bad = [None, {"step_separator": "198"}, {"step_separator": SEP, "steps": 3}]
    results = llm.generate(
        [ids] * 4,
        greedy(2),
        custom_output_params=[*bad, {"step_separator": SEP}],
        raise_errors=False,
    )
    for result in results[:3]:
        assert (
            result.error_code == INVALID_PARAMS
            and "custom output selection" in result.error_message
        )
    assert results[3].error_code is None and results[3].custom_output_positions == [3, 9]
    assert_no_leaks(llm)


# ---- value head: the state that produced each generated token -----------------------------
def test_value_head_rows_for_every_generated_token(heads_ckpt, ref) -> None:
    w = checkpoint_heads()
    llm = make_llm(heads_ckpt, custom_module=str(VALUE))
    a, b = prompt(9, 21), prompt(26, 22)
    sampled = SamplingParams(max_new_tokens=5, n=3, temperature=1.0, seed=5)
    results = llm.generate([a, b], [greedy(max_new_tokens=6), sampled])
    for result, ids in zip(results, (a, b)):
        n = len(ids)
        assert result.custom_output_positions == [n - 1]  # the prompt row
        for seq in result.outputs:
            full = ids + seq.token_ids
            positions = list(range(n - 1, len(full)))
            assert seq.custom_output_positions == positions
            expected = linear(
                ref, full, positions, w["v_head.summary.weight"], w["v_head.summary.bias"]
            )
            assert_close(seq.custom_output, expected[:, 0])
            assert torch.equal(seq.custom_output[:1], result.custom_output)
    assert len({tuple(s.token_ids) for s in results[1].outputs}) > 1  # sampled apart
    with pytest.raises(RequestError, match="takes no custom_output_params"):
        llm.generate([a], greedy(2), custom_output_params=[{"gamma": 0.99}])
    assert_no_leaks(llm)


# ---- moderation: stop a sequence when its head fires --------------------------------------
def moderation_probs(ref: Reference, ids: list[int], positions: list[int]) -> torch.Tensor:
    w = load_file(str(EXAMPLES / "moderation_head.safetensors"))
    logits = linear(ref, ids, positions, w["moderation_head.weight"], w["moderation_head.bias"])
    return torch.softmax(logits, dim=-1)


def test_moderation_stops_at_the_first_token_over_the_threshold(ckpt, ref) -> None:
    llm = make_llm(ckpt, custom_module=str(MODERATION))  # the committed weights fit hidden 64
    ids, n = prompt(15, 42), 15  # its greedy tokens' highest flagged probability: token 4
    never = {"threshold": 1.0}  # a probability is never above 1
    free = llm.generate([ids], greedy(max_new_tokens=8, ignore_eos=True), [never])[0]
    seq = free.outputs[0]
    assert seq.finish_reason == "length" and len(seq.token_ids) == 8
    assert free.custom_output is None  # no prompt rows
    positions = list(range(n, n + 8))
    assert seq.custom_output_positions == positions
    expected = moderation_probs(ref, ids + seq.token_ids, positions)
    assert_close(seq.custom_output, expected)

    # a threshold between the highest "flagged" probability and every one before it
    flagged = expected[:, 1]
    k = int(flagged.argmax())
    assert k >= 1, "choose a prompt whose first token is not the most flagged"
    before = float(flagged[:k].max())
    assert float(flagged[k]) - before > 1e-3
    threshold = (float(flagged[k]) + before) / 2
    stop, go = llm.generate(
        [ids, ids],
        greedy(max_new_tokens=8, ignore_eos=True),
        [{"threshold": threshold}, never],
    )
    stopped = stop.outputs[0]
    assert stopped.finish_reason == "content_filter"
    assert stopped.token_ids == seq.token_ids[:k]  # the flagged token is never returned
    assert stopped.custom_output_positions == positions[: k + 1]  # its row is the last one
    assert_close(stopped.custom_output, expected[: k + 1])
    assert go.outputs[0].finish_reason == "length" and go.outputs[0].token_ids == seq.token_ids
    assert_close(go.outputs[0].custom_output, expected)
    assert_no_leaks(llm)


def test_moderation_default_threshold_per_sequence(ckpt, ref) -> None:
    llm = make_llm(ckpt, custom_module=str(MODERATION))
    ids = prompt(12, 32)
    params = SamplingParams(max_new_tokens=10, n=3, temperature=1.0, seed=9, ignore_eos=True)
    (result,) = llm.generate([ids], params)  # no params: threshold 0.5
    for seq in result.outputs:
        rows = seq.custom_output
        kept = len(seq.token_ids)
        assert seq.custom_output_positions == list(range(12, 12 + rows.shape[0]))
        assert_close(
            rows[:kept], moderation_probs(ref, ids + seq.token_ids, list(range(12, 12 + kept)))
        )
        assert (rows[:kept, 1] <= 0.5).all()
        if seq.finish_reason == "content_filter":
            assert rows.shape[0] == kept + 1 and rows[-1, 1] > 0.5
        else:
            assert seq.finish_reason == "length" and rows.shape[0] == kept == 10
    # with this seed one sample is flagged at its first token, one later, one never
    reasons = sorted(s.finish_reason for s in result.outputs)
    assert reasons == ["content_filter", "content_filter", "length"]
    assert_no_leaks(llm)


def test_moderation_bad_thresholds_are_605(ckpt) -> None:
    llm = make_llm(ckpt, custom_module=str(MODERATION))
    ids = prompt(10, 33)
    bad = [{"threshold": "high"}, {"threshold": True}, {"threshold": 1.5}, {"threshold": -0.1}]
    bad.append({"treshold": 0.9})
    results = llm.generate(
        [ids] * 7,
        [greedy(3, ignore_eos=True)] * 5 + [greedy(0), greedy(3, ignore_eos=True)],
        custom_output_params=[*bad, None, {"threshold": 1}],
        raise_errors=False,
    )
    for result in results[:6]:  # the last refused: every generated token of no tokens
        assert result.error_code == INVALID_PARAMS, result
    assert results[6].error_code is None and results[6].outputs[0].finish_reason == "length"
    assert results[6].outputs[0].custom_output.shape == (3, 2)
    assert_no_leaks(llm)


def test_moderation_should_stop_reads_each_rows_threshold() -> None:
    head = load_example(MODERATION).ModerationHead()
    outputs = torch.tensor([[0.3, 0.7], [0.05, 0.95], [0.6, 0.4], [0.5, 0.5]])
    stop = head.should_stop(outputs, [None, {"threshold": 0.96}, {"threshold": 0}, None])
    assert stop.dtype == torch.bool and stop.tolist() == [True, False, True, False]


def test_committed_moderation_weights_are_reproducible(tmp_path) -> None:
    regenerated = load_example(MODERATION).write_weights(tmp_path / "w.safetensors", hidden_size=64)
    assert regenerated.read_bytes() == (EXAMPLES / "moderation_head.safetensors").read_bytes()
