"""Reading a multi-row request's rows back from the engine's outputs, and checking them
against transformers (tests/custom)."""

from __future__ import annotations

import torch

from tapserve.coordinator.custom_outputs import decode_value
from tests.helpers.custom import HEAD_B, HEAD_W, Reference, linear_head


def expected_rows(ref: Reference, ids: list[int], positions: list[int]) -> torch.Tensor:
    hidden = ref.final_hidden(ids)[positions]
    return linear_head(hidden, ref.tensors[HEAD_W], ref.tensors[HEAD_B])


def rows_by_sequence(r, rid: str) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
    """Sequence index -> (positions, rows): the request's prompt rows, then each sequence's
    own, concatenated over every output. Checks the wire rule on the way: a sequence's rows
    in an output are those of exactly the tokens in it (content_filter adds the flagged one),
    and no position comes twice."""
    prompt_pos: list[int] = []
    prompt_rows: list[torch.Tensor] = []
    positions: dict[int, list[int]] = {}
    rows: dict[int, list[torch.Tensor]] = {}
    sent: dict[int, int] = {}
    num_prompt = max(o.num_prompt_tokens for o in r.outputs[rid])  # (row columns carry none)
    for out in r.outputs[rid]:
        if out.custom_rows is not None:
            prompt_pos += out.custom_positions
            prompt_rows.append(decode_value(out.custom_rows))
        for s in out.sequences:
            start = num_prompt + sent.get(s.index, 0)
            token_positions = list(range(start, start + len(s.new_token_ids)))
            sent[s.index] = sent.get(s.index, 0) + len(s.new_token_ids)
            got = s.custom_positions or []
            if s.finish_reason == "content_filter":
                assert got[:-1] == token_positions and got[-1] == start + len(s.new_token_ids)
            elif got and got != token_positions:  # -2 rows travel alone, with the finish
                assert s.finish_reason is not None and len(got) == 1, (got, token_positions)
            positions.setdefault(s.index, []).extend(got)
            if s.custom_rows is not None:
                rows.setdefault(s.index, []).append(decode_value(s.custom_rows))
    result_pos, result_rows = {}, {}
    for i in sorted(set(positions) | set(sent)):
        result_pos[i] = prompt_pos + positions.get(i, [])
        parts = prompt_rows + rows.get(i, [])
        result_rows[i] = torch.cat(parts) if parts else None
        assert len(set(result_pos[i])) == len(result_pos[i]), result_pos[i]
    return result_pos, result_rows


def check_against_reference(r, rid: str, ids: list[int], ref: Reference) -> dict:
    """Every sequence's rows against transformers on its returned ids; its positions."""
    tokens = r.tokens(rid)
    positions, rows = rows_by_sequence(r, rid)
    for i, out in tokens.items():
        full = ids + out
        torch.testing.assert_close(
            rows[i], expected_rows(ref, full, positions[i]), rtol=1e-4, atol=1e-4
        )
    return positions
