"""tapserve launcher.

    python launch.py [--model DIR] ...                       one process (TP = 1)
    torchrun --nproc-per-node=N launch.py --model DIR ...    N tensor-parallel ranks
    python launch.py --nproc-per-node N --model DIR ...      the same on one node, no torchrun:
                                                             nothing listens beyond 127.0.0.1

Rank 0 runs the coordinator and spawns the API process; other ranks run the worker loop.
`--prompt TEXT` generates once offline and prints the result instead of serving.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[0] / "_checkout.py"))

from tapserve import checkout_entry
from tapserve.api.gc_policy import settle_after_startup
from tapserve.coordinator.config import EngineConfig, check_model
from tapserve.coordinator.custom_outputs import RequestError
from tapserve.launch_flags import engine_config, parse_args
from tapserve.model.custom_output import HandlerLoadError
from tapserve.ranks.local_group import is_local_rank, run_local_group

# what a bad flag, checkpoint, tokenizer or custom module raises at start-up: one line, no
# traceback (FileNotFoundError and the like are OSErrors; a corrupt JSON file a ValueError)
STARTUP_ERRORS = (ValueError, OSError, HandlerLoadError)
SILENT_EXIT_DELAY_S = 3.0  # once_per_node: how long a silent rank leaves local rank 0 to print


def run_prompt(args: argparse.Namespace, config: EngineConfig) -> int:
    from tapserve.api.sampling_params import SamplingParams
    from tapserve.coordinator.offline import LLM

    llm = LLM(config)
    result = llm.generate(
        [args.prompt], SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    )[0]
    print(result.outputs[0].text)
    if result.custom_output is not None:
        print("custom_output:", result.custom_output.tolist())
    return 0


def once_per_node(message: str) -> str | int:
    """For SystemExit, a start-up error that every rank of a node finds alike (from the flags,
    the checkpoint or values the ranks agreed on): its message on local rank 0, a silent
    status 1 on the others, so it is printed once (each node's launcher shows its own
    ranks' output). The others exit SILENT_EXIT_DELAY_S later: a launcher stops every rank
    at the first one's exit, which must not come before local rank 0 has printed."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        return message
    time.sleep(SILENT_EXIT_DELAY_S)
    return 1


def exit_started_rank(message: str | int) -> NoReturn:
    """End a rank whose start-up failed once its process group may have started: leave the
    group first (the interpreter's teardown of a live gloo group aborts now and then,
    "terminate called without an active exception", status 134), then SystemExit(message)."""
    from tapserve.ranks.group import shutdown_distributed

    shutdown_distributed()
    raise SystemExit(message)


def serve(args: argparse.Namespace, config: EngineConfig, tokenizer=None) -> int:
    """Run this rank; tokenizer: rank 0's, from check_before_loading."""
    from tapserve.coordinator.serving import run_coordinator
    from tapserve.coordinator.startup import start_rank
    from tapserve.model.layers import ParallelLayoutError
    from tapserve.ranks.group import shutdown_distributed
    from tapserve.ranks.runner import RankAgreedError
    from tapserve.ranks.worker import run_worker

    try:
        ctx, runner, channel = start_rank(config, args.tp)
    except (ParallelLayoutError, RankAgreedError) as e:  # every rank finds it alike
        exit_started_rank(once_per_node(str(e)))
    except STARTUP_ERRORS as e:
        exit_started_rank(str(e))
    try:
        if not ctx.is_driver:
            settle_after_startup()
            run_worker(runner, channel)
            code = 0
        else:
            engine = driver_engine(config, runner, channel, tokenizer)
            code = run_coordinator(args, config, engine, channel)
    except Exception:  # a collective may have failed: a hung peer would hold the exit again
        traceback.print_exc()  # in leaving the groups, or the interpreter's teardown of them,
        sys.stderr.flush()  # for another whole peer timeout
        os._exit(1)
    shutdown_distributed()
    return code


def driver_engine(config: EngineConfig, runner, channel, tokenizer):
    """Rank 0's engine; a start-up error (the custom handler's, say) stops the other ranks
    with the stop plan and ends this one with its message. With a custom head, the API's
    tokenizer (checked before loading) serves rank 0 too: it detects the stop strings of
    LAST_GENERATED requests (coordinator/stop_strings.py)."""
    from tapserve.coordinator.loop import FAILED_STOP_SECONDS
    from tapserve.coordinator.startup import build_engine, stop_group

    try:
        return build_engine(config, runner, channel, tokenizer if config.custom_module else None)
    except STARTUP_ERRORS as e:
        try:
            stop_group(channel, FAILED_STOP_SECONDS)
        except RuntimeError:
            pass  # a peer already gone
        exit_started_rank(str(e))


def sampling_defaults(choice: str, model_dir) -> tuple[str, ...]:
    """--generation-config as ApiConfig.sampling_defaults ("name=value" entries); a bad
    generation_config.json ends the start-up with its message."""
    from tapserve.coordinator.generation_defaults import model_sampling_defaults

    if choice == "vllm":
        return ()
    try:
        defaults = model_sampling_defaults(model_dir if choice == "auto" else choice)
    except (ValueError, OSError) as e:  # json.JSONDecodeError included
        raise SystemExit(str(e)) from None
    return tuple(f"{name}={value}" for name, value in defaults.items())


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # `kill -USR1 <pid>`: every thread's Python stack to stderr, to diagnose a hung rank
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    with errors_once_per_node():  # what fails before the ranks start fails alike on each
        args = parse_args(argv)
        logging.getLogger().setLevel(args.log_level.upper())
        started = prepare(args, argv)
    if isinstance(started, int):  # the local group's or --prompt's exit status
        return started
    return serve(args, *started)


@contextmanager
def errors_once_per_node() -> Iterator[None]:
    """A start-up error raised as SystemExit(message) before the ranks start, from the flags
    or the node's files, is found alike by every rank of a node: once_per_node."""
    try:
        yield
    except SystemExit as e:
        if isinstance(e.code, str):
            raise SystemExit(once_per_node(e.code)) from None
        raise


def prepare(args: argparse.Namespace, argv: list[str] | None):
    """Everything before the ranks start: the checks that need no model, then the local
    group (--nproc-per-node) or --prompt (their exit status), else (config, tokenizer)."""
    if args.chat_template is not None:  # before any rank starts: a mistyped path fails here
        from tapserve.api.tokenizer import chat_template_text, check_chat_template

        try:
            check_chat_template(chat_template_text(args.chat_template))
        except (ValueError, OSError) as e:
            raise SystemExit(str(e)) from None
    if args.generation_config not in ("auto", "vllm") and not os.path.isfile(
        os.path.join(args.generation_config, "generation_config.json")
    ):
        raise SystemExit(
            f"--generation-config {args.generation_config!r}: auto, vllm, or a "
            "folder holding a generation_config.json"
        )
    if args.nproc_per_node is not None and not is_local_rank():
        return start_local_group(args, sys.argv[1:] if argv is None else argv)
    config = checked_config(args)
    if args.prompt is not None:
        if int(os.environ.get("WORLD_SIZE", "1")) != 1 or args.tp not in (None, 1):
            raise SystemExit(
                "--prompt runs one process without tensor parallelism: leave out "
                "--tp and run it without torchrun (serve for TP > 1)"
            )
        try:
            return run_prompt(args, config)
        except STARTUP_ERRORS as e:  # a config the model or the KV cache cannot honour
            raise SystemExit(str(e)) from None
        except RequestError as e:  # the prompt itself (empty, too long)
            raise SystemExit(f"--prompt: {e}") from None
    # before the model loads: a bad generation_config.json, tokenizer, custom module or port
    # fails at once, not after minutes of loading
    tokenizer = None
    args.sampling_defaults = sampling_defaults(args.generation_config, config.model_dir())
    try:
        if os.environ.get("RANK", "0") == "0":
            tokenizer = check_before_loading(args, config)
    except STARTUP_ERRORS as e:
        raise SystemExit(str(e)) from None
    return config, tokenizer


def start_local_group(args: argparse.Namespace, argv: list[str]) -> int:
    """`--nproc-per-node N`: run this command as N local ranks, once the flags and the
    checkpoint pass the checks every rank would make alike (so their errors print once)."""
    if args.nproc_per_node < 1 or args.prompt is not None:
        raise SystemExit("--nproc-per-node needs a value >= 1 and serves (no --prompt)")
    if "RANK" in os.environ:
        raise SystemExit(
            "--nproc-per-node starts its own ranks: not under torchrun "
            "(use torchrun's --nproc-per-node alone)"
        )
    config = checked_config(args)
    sampling_defaults(args.generation_config, config.model_dir())
    return run_local_group(args.nproc_per_node, [*checkout_entry("launch.py")[1:], *argv])


def checked_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config from the flags, with the checkpoint's config checked against them
    (a SystemExit with the error's message)."""
    try:
        config = engine_config(args)
        check_model(config)
    except STARTUP_ERRORS as e:
        raise SystemExit(str(e)) from None
    return config


def check_before_loading(args: argparse.Namespace, config: EngineConfig):
    """Rank 0's start-up checks that need no model: the serving tokenizer loads (returned),
    the custom module is there, and the HTTP port is free."""
    from tapserve.api.tokenizer import TextTokenizer, check_chat_template
    from tapserve.model.custom_output import check_handler_spec

    folder = config.tokenizer or config.model_dir()
    try:
        tokenizer = TextTokenizer.from_dir(folder, args.chat_template)
    except FileNotFoundError as e:
        raise ValueError(f"the API needs a tokenizer: {e} (--tokenizer DIR)") from None
    except Exception as e:  # the tokenizers library's parse errors name no file
        raise ValueError(
            f"the tokenizer in {folder} cannot be loaded (tokenizer.json, "
            f"tokenizer_config.json): {e}"
        ) from None
    if args.chat_template is None and isinstance(tokenizer.chat_template, str):  # its own
        check_chat_template(
            tokenizer.chat_template,
            f"the chat template in {folder} "
            f"(chat_template.jinja or tokenizer_config.json; --chat-template "
            f"overrides it)",
        )
    if config.custom_module:
        check_handler_spec(config.custom_module)  # found, not imported: it is loaded once
    ipv6 = ":" in args.host
    with socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if ipv6:  # as uvicorn's (asyncio's) listener: IPv6 only, beside any IPv4 socket
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            probe.bind((args.host, args.port))
        except OSError as e:
            where = f"[{args.host}]:{args.port}" if ipv6 else f"{args.host}:{args.port}"
            raise ValueError(f"cannot serve on {where}: {e.strerror or e}") from None
    return tokenizer


if __name__ == "__main__":
    sys.exit(main())
