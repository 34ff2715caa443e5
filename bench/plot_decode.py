"""Plot decode step time vs batch size from bench/decode_sweep.py --json outputs.

    python bench/plot_decode.py out.png sweep_1k.json:"context 1K" sweep_4k.json:"context 4K"
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    out, series = sys.argv[1], sys.argv[2:]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for item in series:
        path, _, label = item.partition(":")
        rows = json.load(open(path))["rows"]
        b = [r["batch"] for r in rows]
        ax.plot(b, [r["step_ms"] for r in rows], marker="o", label=f"{label} measured")
        ax.plot(b, [r["floor_ms"] for r in rows], linestyle="--", label=f"{label} roofline floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("decode step time (ms)")
    ax.set_title("tapserve decode step, qwen3-8b shapes, bf16, one H200")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
