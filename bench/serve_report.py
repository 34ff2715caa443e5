"""bench/serve.py's request-rate sweep reported: which rates hold a latency target, a markdown
table and a PNG plot (TTFT and TPOT p50 / p99 and output tokens/s against the offered rate).

A row is bench/serve.py's summary of one rate's run plus "rate" (the offered requests/s)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Targets:
    """A rate is held when every request succeeded, TTFT p99 and TPOT p99 are within these
    and the achieved request rate is at least min_achieved x the offered one (both measured
    over the run's span: arrivals, and ends of the requests served)."""

    ttft_p99_ms: float = 1000.0
    tpot_p99_ms: float = 50.0
    min_achieved: float = 0.95

    def held(self, row: dict) -> bool:
        # NaN percentiles (no request streamed two tokens) compare False: not held
        return (
            row["failed"] == 0
            and row["ttft_ms"]["p99"] <= self.ttft_p99_ms
            and row["tpot_ms"]["p99"] <= self.tpot_p99_ms
            and row["achieved_requests_per_s"] >= self.min_achieved * row["offered_requests_per_s"]
        )

    def describe(self) -> str:
        return (
            f"TTFT p99 <= {self.ttft_p99_ms:g} ms, TPOT p99 <= {self.tpot_p99_ms:g} ms, "
            f"achieved >= {self.min_achieved:g} x offered"
        )


def best_rate(rows: list[dict], targets: Targets) -> float | None:
    """The highest offered rate held, or None."""
    held = [row["rate"] for row in rows if targets.held(row)]
    return max(held) if held else None


def sweep_table(rows: list[dict], targets: Targets) -> str:
    head = (
        "| rate req/s | offered / achieved req/s | requests | output tok/s "
        "| TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | SSE events / token "
        "| failed | within targets |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )

    def pair(v: dict) -> str:
        return f"{v['p50']:.1f} / {v['p99']:.1f}"

    return head + "".join(
        f"| {row['rate']:g} | {row['offered_requests_per_s']:.2f} / "
        f"{row['achieved_requests_per_s']:.2f} | {row['requests']} | {row['output_tok_per_s']:.1f} "
        f"| {pair(row['ttft_ms'])} | {pair(row['tpot_ms'])} | {pair(row['itl_ms'])} "
        f"| {row['sse_events_per_token']:.3f} | {row['failed']} "
        f"| {'yes' if targets.held(row) else 'no'} |\n"
        for row in rows
    )


def sweep_plot(rows: list[dict], path: Path, title: str, targets: Targets) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [row["rate"] for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, label, target in (
        (axes[0], "ttft_ms", "TTFT (ms)", targets.ttft_p99_ms),
        (axes[1], "tpot_ms", "TPOT (ms)", targets.tpot_p99_ms),
    ):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(rates, [row[key][q] for row in rows], style, label=q)
        ax.axhline(target, color="red", linewidth=0.8, linestyle=":", label="p99 target")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
    axes[2].plot(rates, [row["output_tok_per_s"] for row in rows], "o-")
    axes[2].set_title("output tokens/s", fontsize=10)
    for ax in axes:
        if min(rates) > 0 and max(rates) >= 4 * min(rates):  # doubling rates: evenly spaced
            ax.set_xscale("log", base=2)
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
