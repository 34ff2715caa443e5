"""bench/relay.py end to end: the real API process relays every stand-in token, in order and
unchanged, closed loop and at a fixed step rate."""

from __future__ import annotations

import json
import subprocess

from tapserve import checkout_entry


def relay(*flags: str) -> dict:
    done = subprocess.run(
        [*checkout_entry("bench/relay.py"), "--vocab", "5000", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_closed_loop_relays_every_token_exactly():
    result = relay("--concurrency", "8", "--max-tokens", "40")
    assert result["wrong_texts"] == 0
    assert result["tokens"] == 8 * 40
    assert 0 < result["events_per_token"] <= 1 and result["api_cpu_us_per_token"] > 0


def test_a_light_step_rate_is_kept_up_one_event_per_token():
    result = relay("--concurrency", "4", "--max-tokens", "30", "--step-rate", "40")
    assert result["wrong_texts"] == 0 and result["tokens"] == 4 * 30
    assert result["kept_up"]
    assert result["events_per_token"] >= 0.8  # a client this far ahead is never behind long
