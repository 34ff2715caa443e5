"""Before/after on one machine: run a bench script of two source trees in interleaved rounds
and compare one figure by median.

    python bench/interleave.py --before ../old --after . --rounds 3 --key seconds -- \\
        bench/offline.py --model-config bench/configs/qwen3-0.6b.json

Each round runs both trees (their order alternates), each in a fresh process; the figure is
`--key` of the last JSON line of the script's stdout that holds it. Prints one JSON line:
the per-round figures, both medians and after / before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def figure(tree: Path, script: list[str], key: str) -> float:
    proc = subprocess.run(
        [sys.executable, str(tree / script[0]), *script[1:]],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{") and f'"{key}"' in line:
            return float(json.loads(line)[key])
    raise SystemExit(
        f"{tree}: no {key!r} in the output (exit {proc.returncode}):\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--key", required=True)
    p.add_argument("script", nargs=argparse.REMAINDER)
    args = p.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    runs: dict[str, list[float]] = {"before": [], "after": []}
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for name in order:
            tree = (args.before if name == "before" else args.after).resolve()
            runs[name].append(figure(tree, script, args.key))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(
        json.dumps(
            {
                "script": " ".join(script),
                "key": args.key,
                "runs": runs,
                "median": medians,
                "after_over_before": round(medians["after"] / medians["before"], 4),
            }
        )
    )


if __name__ == "__main__":
    main()
