"""Test deployment head for tests/reliability/test_reliability_faults.py: a head whose `forward` raises on
a random 10 % of its calls (seeded by $TAPSERVE_FLAKY_SEED, default 0).

Each row's value is a fingerprint of its hidden state ([rows, 1] float32: the row's sum), so
a test can tell which request a row belonged to. Every call is appended to the JSON-lines
file named by $TAPSERVE_FLAKY_LOG: {"call": k, "failed": bool, "rows": [fingerprints]}.
"""

from __future__ import annotations

import json
import os
import random

import torch

FAIL_RATE = 0.1


class FlakyHead:
    def __init__(self) -> None:
        self.rng = random.Random(int(os.environ.get("TAPSERVE_FLAKY_SEED", "0")))
        self.log_path = os.environ.get("TAPSERVE_FLAKY_LOG")
        self.calls = 0

    def select_token_position(self, input_ids: list[int], params: dict | None) -> int:
        if params and "position" in params:
            return int(params["position"])
        return len(input_ids) - 1

    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        values = selected_hidden_states.float().sum(-1, keepdim=True)
        failed = self.rng.random() < FAIL_RATE
        self.calls += 1
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "call": self.calls,
                            "failed": failed,
                            "rows": [float(v) for v in values[:, 0]],
                        }
                    )
                    + "\n"
                )
        if failed:
            raise RuntimeError(f"flaky head failed on call {self.calls}")
        return values
