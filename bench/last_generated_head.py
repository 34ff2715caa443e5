"""A reward head for bench/best_of_n.py: the linear head of bench/last_token_head.py on each
sequence's last generated token (LAST_GENERATED), or on the last prompt token for the separate
scoring requests ({"mode": "last_prompt_token"}), or nothing ({"mode": "none"})."""

from __future__ import annotations

from tapserve.bench.last_token_head import LastTokenLinearHead
from tapserve.model.custom_output import CustomOutputHandler


class LastGeneratedRewardHead(LastTokenLinearHead):
    def select_token_position(self, input_ids: list[int], params: dict | None) -> int:
        mode = (params or {}).get("mode", "last_generated")
        if mode == "none":
            return CustomOutputHandler.NO_OUTPUT
        if mode == "last_prompt_token":
            return len(input_ids) - 1
        return CustomOutputHandler.LAST_GENERATED
