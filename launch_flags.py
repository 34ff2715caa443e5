"""The launcher's flags: parsed and checked (a misuse is one line), relative paths made
absolute, and the EngineConfig they describe."""

from __future__ import annotations

import argparse
import os
from typing import NoReturn

from tapserve.api.tokenizer import UnencodableTextError, check_unicode, names_a_file
from tapserve.coordinator.config import DEFAULT_MAX_CUSTOM_OUTPUT_BYTES, EngineConfig
from tapserve.model.custom_output import names_a_module_file

DEMO_HEAD = "tapserve.model.demo:DemoHead"


class _OneLineParser(argparse.ArgumentParser):
    """A misused flag ends the start-up with one line (SystemExit(message), as every other
    start-up error), not the usage block and status 2."""

    def error(self, message: str) -> NoReturn:
        raise SystemExit(f"{self.prog}: error: {message} (--help lists the flags)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _OneLineParser(description="tapserve: LLM serving with custom output heads")
    a = p.add_argument
    a("--model", help="checkpoint folder (default: the embedded demo model)")
    a("--tokenizer", help="tokenizer folder (default: the model folder)")
    a("--served-model-name", help="model name in the API (default: folder name)")
    a(
        "--dtype",
        default="auto",
        help="auto (float32 on CPU, bfloat16 on CUDA), float32, float16, bfloat16",
    )
    a("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    a("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    a(
        "--tp",
        type=int,
        help="tensor-parallel size (default and only allowed value: the world size)",
    )
    a(
        "--nproc-per-node",
        type=int,
        help="start this many tensor-parallel ranks on this node "
        "(instead of torchrun; ranks/local_group.py)",
    )
    a(
        "--custom-module",
        help="deployment head: path/to/file.py[:Class] or package.module:Class "
        "('none' disables the demo head)",
    )
    a("--custom-output-reuse", default="omit", choices=["omit", "recompute"])
    a("--output-workers", type=int, default=0, help="custom-output dispatch threads (0 = serial)")
    a(
        "--max-custom-output-bytes",
        type=int,
        default=DEFAULT_MAX_CUSTOM_OUTPUT_BYTES,
        help="a multi-row selection's most custom-output bytes per request (rows x row bytes "
        "x max(n, beams)); more is a 605",
    )
    a("--block-size", type=int, default=16)
    a("--kv-cache-memory", type=float, help="GiB of KV cache per rank (CPU default: 2)")
    a("--gpu-memory-utilization", type=float, default=0.9)
    a("--num-kv-blocks", type=int, help="exact number of KV blocks (overrides the memory budget)")
    a("--max-num-seqs", type=int, default=256)
    a("--max-num-batched-tokens", type=int, default=8192)
    a("--max-model-len", type=int)
    a("--enforce-eager", action="store_true", help="no CUDA graphs")
    a(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch the next decode step before this one's sampled tokens reach the host "
        "(default: on CUDA; docs/async_scheduling.md)",
    )
    a("--no-prefix-caching", action="store_true")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a(
        "--api-key",
        default=os.environ.get("TAPSERVE_API_KEY"),
        help="Bearer key for every endpoint but /health (default: $TAPSERVE_API_KEY, which keeps "
        "it off the command lines that ps shows)",
    )
    a("--max-queued-requests", type=int, default=1024)
    a("--shutdown-timeout", type=float, default=10.0)
    a("--seed", type=int, default=0)
    a(
        "--chat-template",
        help="Jinja chat template file, or the template itself (default: the tokenizer's)",
    )
    a(
        "--split-special-tokens-in-messages",
        action="store_true",
        help="tokenize special-token text typed inside chat message content (a user's "
        "'<|im_end|>') as plain text, so that it cannot forge a role boundary; the chat "
        "template's own special tokens stay special (default: as vLLM, such text is the "
        "special token)",
    )
    a(
        "--generation-config",
        default="auto",
        help="sampling defaults for fields a request leaves out: auto (the model folder's "
        "generation_config.json: temperature, top_k, top_p, min_p, repetition_penalty, as "
        "vLLM, but not max_new_tokens), vllm (none: temperature 1, no top-k/top-p), or a "
        "folder holding a generation_config.json",
    )
    a(
        "--log-requests",
        action="store_true",
        help="log each request's id, path, token counts, params and finish (never its text)",
    )
    a(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log level of every process (debug adds each 605 a custom selector raises)",
    )
    a("--prompt", help="generate once for this prompt, print it and exit (no server)")
    a("--max-new-tokens", type=int, default=32, help="with --prompt")
    args = p.parse_args(argv)
    absolute_paths(args)
    if not 0 <= args.port < 65536:
        p.error(f"--port must be in [0, 65535], got {args.port}")
    try:
        check_unicode(args.api_key or "")
    except UnencodableTextError:
        p.error("--api-key (or $TAPSERVE_API_KEY) is not valid UTF-8")
    if args.tp is not None and args.tp < 1:
        p.error(f"--tp must be at least 1, got {args.tp}")
    if args.api_key is not None and not args.api_key.strip():
        p.error(
            "--api-key (or $TAPSERVE_API_KEY) is empty (an unset variable?); leave it out "
            "to serve without a key"
        )
    if args.max_queued_requests < 0:
        p.error(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if not args.shutdown_timeout >= 0:  # (NaN too)
        p.error(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    return args


def absolute_paths(args: argparse.Namespace) -> None:
    """Paths given relative to where the launch ran, made absolute: the API process runs in
    the repository's folder (a relative --tokenizer or --chat-template failed there). A
    leading ~ is expanded too: `--model=~/x` reaches us unexpanded."""

    def absolute(path: str) -> str:
        return os.path.abspath(os.path.expanduser(path))

    for name in ("model", "tokenizer"):
        if getattr(args, name):
            setattr(args, name, absolute(getattr(args, name)))
    if args.chat_template and names_a_file(os.path.expanduser(args.chat_template)):
        args.chat_template = absolute(args.chat_template)  # (else the template's own text)
    if args.generation_config not in ("auto", "vllm"):
        args.generation_config = absolute(args.generation_config)
    target, colon, name = (args.custom_module or "").partition(":")
    if names_a_module_file(os.path.expanduser(target)):
        args.custom_module = absolute(target) + colon + name


def engine_config(args: argparse.Namespace) -> EngineConfig:
    custom = args.custom_module
    if custom is None and args.model is None:
        custom = DEMO_HEAD  # the embedded demo model ships with its demo head
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        custom_module=custom,
        custom_output_reuse=args.custom_output_reuse,
        output_workers=args.output_workers,
        max_custom_output_bytes=args.max_custom_output_bytes,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        async_scheduling=args.async_scheduling,
    )
