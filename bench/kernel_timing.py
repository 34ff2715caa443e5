"""Pieces the kernel microbenchmarks share (bench/gemv.py, bench/decode_attention.py,
bench/extend_attention.py): one rank's attention heads from a config.json, and GPU time from
CUDA-graph replays timed with CUDA events, so launch overhead and host work stay out."""

from __future__ import annotations

from collections.abc import Callable

import torch


def rank_heads(config: dict, tp: int) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of one of tp ranks (KV heads replicated below one)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (
        config["num_attention_heads"] // tp,
        max(1, config["num_key_value_heads"] // tp),
        head_dim,
    )


def seconds_per_replay(fn: Callable[[], object], replays: int, warm_replays: int = 1) -> float:
    """fn once eagerly (compiles, warms), then captured in a CUDA graph: seconds per replay
    over `replays` replays, after `warm_replays` untimed ones."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warm_replays):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays
