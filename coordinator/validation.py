"""Request checks at admission (the engine's 605s for prompts and beams)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tapserve.api.sampling_params import SamplingParams
from tapserve.api.wire import INVALID_PARAMS
from tapserve.coordinator.blocks import BlockManager
from tapserve.coordinator.custom_outputs import RequestError
from tapserve.coordinator.row_selection import RowSelection

if TYPE_CHECKING:
    from tapserve.coordinator.config import EngineOptions


def validate_prompt(
    ids: list[int], params: SamplingParams, options: EngineOptions, blocks: BlockManager
) -> None:
    """Raise RequestError (605) for a prompt the engine cannot run; queue nothing."""
    if not ids:
        raise RequestError(INVALID_PARAMS, "prompt is empty", "prompt")
    if len(ids) >= options.max_model_len:
        raise RequestError(
            INVALID_PARAMS,
            f"prompt is {len(ids)} tokens; the model's context "
            f"is {options.max_model_len} (prompt too long)",
            "prompt",
        )
    for what, tokens in (
        ("prompt", ids),
        ("logit_bias", params.logit_bias),
        ("stop_token_ids", params.stop_token_ids),
    ):
        bad = [t for t in tokens if not 0 <= t < options.vocab_size]
        if bad:
            raise RequestError(
                INVALID_PARAMS,
                f"{what} token ids outside the vocabulary [0, {options.vocab_size}): {bad[:5]}",
                what,
            )
    # the beams advance together, so all of them must fit at once, each with its whole
    # sequence: after a preemption they are admitted again together, with free blocks for
    # every beam's tokens (Scheduler._can_allocate counts no shared prefix). Scoring only
    # (max_new_tokens 0) runs one sequence.
    if params.num_beams > 1 and params.max_new_tokens > 0:
        if params.num_beams > options.scheduler.max_num_batched_tokens:
            raise RequestError(
                INVALID_PARAMS,
                f"num_beams {params.num_beams} exceeds max_num_batched_tokens",
                "num_beams",
            )
        longest = min(len(ids) + params.max_new_tokens, options.max_model_len)
        need = params.num_beams * blocks.blocks_needed(longest)
        if need > blocks.num_blocks:
            raise RequestError(
                INVALID_PARAMS,
                f"request needs {need} KV blocks for its "
                f"{params.num_beams} beams; the KV cache holds "
                f"{blocks.num_blocks}",
                "num_beams",
            )


def validate_rows(request_rows: int, params: SamplingParams, options: EngineOptions) -> None:
    """605 for a request whose widest step (Request.max_rows: its n samples or beams) would
    not fit in max_num_seqs: it could never be admitted."""
    limit = options.scheduler.max_num_seqs
    if request_rows > limit:
        field = "num_beams" if params.num_beams > 1 else "n"
        raise RequestError(
            INVALID_PARAMS,
            f"{field} {getattr(params, field)} needs {request_rows} "
            f"sequences at once; the server runs at most {limit} "
            f"(--max-num-seqs)",
            field,
        )


def validate_row_bytes(
    selection: RowSelection, params: SamplingParams, options: EngineOptions
) -> None:
    """605 for a multi-row selection whose rows could exceed --max-custom-output-bytes: rows
    x the dry run's row bytes x max(n, beams)."""
    rows = selection.max_rows(params.max_new_tokens)
    worst = rows * options.custom_row_bytes * max(params.n, params.num_beams)
    if worst > options.max_custom_output_bytes:
        raise RequestError(
            INVALID_PARAMS,
            f"custom output rows could take {worst} bytes ({rows} rows of "
            f"{options.custom_row_bytes} bytes x {max(params.n, params.num_beams)} sequences), "
            f"over --max-custom-output-bytes {options.max_custom_output_bytes}",
            "custom_output_params",
        )
