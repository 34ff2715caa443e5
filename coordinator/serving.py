"""Rank 0 serving: the coordinator loop, the API process it starts, and the start-up log
(launch.py runs it once rank 0's engine is built)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import tempfile

from tapserve import checkout_entry
from tapserve.api.config import ApiConfig, http_url
from tapserve.api.gc_policy import settle_after_startup
from tapserve.coordinator.config import EngineConfig
from tapserve.coordinator.engine import Engine
from tapserve.coordinator.loop import CoordinatorLoop, LoopSettings
from tapserve.ranks.local_group import STORE_ENV


def log_what_is_served(config: EngineConfig, engine: Engine) -> None:
    runner = engine.runner
    weights = "random weights (--load-format dummy)" if config.load_format == "dummy" else "weights"
    logging.getLogger("tapserve").info(
        "model %s (%s, %s %s), %s, TP %d, %d KV blocks of %d tokens, max_model_len %d, "
        "custom head %s",
        runner.cfg.model_dir,
        runner.model_cfg.architecture,
        str(runner.cfg.dtype).removeprefix("torch."),
        weights,
        runner.device,
        runner.tp.size,
        runner.num_blocks,
        runner.cfg.block_size,
        engine.options.max_model_len,
        config.custom_module or "none",
    )


def _labels(handler: object | None) -> str | list[str] | None:
    """The custom head's labels for the API process (checked at start-up: check_labels)."""
    labels = getattr(handler, "labels", None)
    return list(labels) if isinstance(labels, (list, tuple)) else labels


def run_coordinator(args: argparse.Namespace, config: EngineConfig, engine: Engine, channel) -> int:
    """Serve until the loop ends (its exit status): the API process started with what the
    flags and the engine say, rank 0's temp dir removed at the end."""
    group_dir = os.path.dirname(os.environ.get(STORE_ENV, "")) or None  # local launcher's
    ipc_dir = tempfile.mkdtemp(prefix="tapserve-", dir=group_dir)  # 0700; the launcher removes
    # its group directory even when rank 0 is killed
    try:
        launcher = os.getppid() if "RANK" in os.environ else None  # torchrun or --nproc-per-node
        loop = CoordinatorLoop(
            engine,
            LoopSettings(ipc_dir, args.shutdown_timeout, args.log_requests, launcher),
            channel,
            None,
        )
        loop.install_signal_handlers()
        model_dir = config.model_dir()
        api = ApiConfig(
            ipc_dir=ipc_dir,
            tokenizer=str(config.tokenizer or model_dir),
            served_model_name=args.served_model_name
            or (os.path.basename(str(model_dir)) if args.model else "tapserve-demo"),
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            max_num_seqs=args.max_num_seqs,
            max_queued_requests=args.max_queued_requests,
            max_model_len=engine.options.max_model_len,
            chat_template=args.chat_template,
            split_special_tokens_in_messages=args.split_special_tokens_in_messages,
            custom_output_labels=_labels(engine.handler),
            sampling_defaults=args.sampling_defaults,
            eos_token_ids=tuple(engine.options.eos_token_ids),
            model_vocab_size=engine.runner.model_cfg.vocab_size,
            log_requests=args.log_requests,
            log_level=args.log_level,
            parent_pid=os.getpid(),
        )  # not the API's own getppid(): rank 0 may be gone by then
        # a session of its own: torchrun stops a worker with killpg, and that SIGTERM is
        # rank 0's (one drain); a signal sent to the API process itself is handed to rank 0
        # (api/lifecycle.py). Rank 0 stops it at the end, with its final wire message
        loop.api_process = subprocess.Popen(
            [*checkout_entry("api/server.py"), *api.to_argv()], start_new_session=True
        )
        if args.sampling_defaults:
            logging.getLogger("tapserve").info(
                "sampling defaults from the generation config: %s (--generation-config vllm "
                "leaves them out)",
                ", ".join(args.sampling_defaults),
            )
        log_what_is_served(config, engine)
        where = (
            http_url(args.host, args.port)
            if args.port
            else f"{args.host}, on the port that the API process logs (--port 0)"
        )
        logging.getLogger("tapserve").info("serving on %s", where)
        settle_after_startup()
        return loop.run()
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
        if group_dir and launcher is not None and os.getppid() != launcher:
            # the --nproc-per-node launcher died (SIGKILL) and cannot remove its group dir
            shutil.rmtree(group_dir, ignore_errors=True)
