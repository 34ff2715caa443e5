"""Plot decode step time vs batch size from bench/decode_sweep.py --json outputs. Rows faster
than their physical floor are invalid measurements and are left out.

    python bench/plot_decode.py out.png sweep_1k.json:"context 1K" sweep_4k.json:"context 4K" \
        [--title "..."]
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("series", nargs="+", help="FILE.json:label")
    p.add_argument("--title", default="tapserve decode step, qwen3-8b shapes, bf16, one H200")
    args = p.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for item in args.series:
        path, _, label = item.partition(":")
        rows = [r for r in json.load(open(path))["rows"] if r["step_ms"] >= r["floor_ms"]]
        b = [r["batch"] for r in rows]
        ax.plot(b, [r["step_ms"] for r in rows], marker="o", label=f"{label} measured")
        ax.plot(b, [r["floor_ms"] for r in rows], linestyle="--", label=f"{label} roofline floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("decode step time (ms)")
    ax.set_title(args.title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
