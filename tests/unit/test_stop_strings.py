"""Rank 0's stop-string cut for LAST_GENERATED (coordinator/stop_strings.py): the number of
output tokens kept is the fewest whose decoded text covers the kept text, also when the text
around the cut holds replacement characters of incomplete UTF-8 (a case found by driving a
live demo server: seed 3, stop "Light")."""

from __future__ import annotations

import pytest

from tapserve.api.sampling_params import SamplingParams
from tapserve.api.tokenizer import TextTokenizer
from tapserve.coordinator.sequence import Request, SequenceFactory
from tapserve.coordinator.stop_strings import kept_output_tokens, truncate_output
from tapserve.model.demo import ensure_demo_checkpoint

PROMPT = [349, 735, 864, 452]  # "The lighthouse keeper said" in the demo tokenizer
# a sample of the demo model: bytes 144 240 240 decode to "Ԓ" and a broken "�"
OUTPUT = [340, 476, 476, 144, 240, 240, 948, 265, 577, 140, 566, 825, 577, 609, 922, 108]


@pytest.fixture(scope="module")
def decoder() -> TextTokenizer:
    return TextTokenizer.from_dir(ensure_demo_checkpoint())


def _sequence(stop: list[str], include: bool = False):
    request = Request(
        "r",
        PROMPT,
        SamplingParams(stop=stop, include_stop_str_in_output=include, max_new_tokens=32),
        0,
    )
    return SequenceFactory().prompt_sequence(request)


def _feed(seq, decoder, tokens: list[int]) -> int | None:
    for t in tokens:  # one token per step, as the engine appends them
        seq.num_computed_tokens = len(seq.token_ids)  # the previous newest token was computed
        seq.token_ids.append(t)
        kept = kept_output_tokens(seq, decoder)
        if kept is not None:
            return kept
    return kept_output_tokens(seq, decoder, final=True)


@pytest.mark.parametrize(
    "stop,include",
    [
        ("Light", False),
        ("Light", True),
        ("attern", False),
        ("oon", False),
        ("ant", False),
        (" appear", False),
        ("ppea", False),
        ("absent", False),
    ],
)
def test_kept_tokens_are_the_fewest_covering_the_kept_text(decoder, stop, include) -> None:
    seq = _sequence([stop], include)
    kept = _feed(seq, decoder, OUTPUT)
    full = decoder.decode(PROMPT + OUTPUT)[len(decoder.decode(PROMPT)) :]
    if stop not in full:
        assert kept is None
        return
    cut = full.index(stop) + (len(stop) if include else 0)
    text = full[:cut]

    def covers(k: int) -> bool:
        return decoder.decode(PROMPT + OUTPUT[:k])[len(decoder.decode(PROMPT)) :].startswith(text)

    assert covers(kept) and (kept == 0 or not covers(kept - 1)), (stop, kept)
    if stop == "Light" and not include:
        assert kept == 6  # not 7: the "�" before "Light" belongs to the broken byte 240
    if kept:
        truncate_output(seq, kept)
        assert (
            seq.token_ids == PROMPT + OUTPUT[:kept]
            and seq.num_computed_tokens == len(seq.token_ids) - 1
        )
