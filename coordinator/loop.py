"""Rank 0's serving loop: ZeroMQ requests in, engine steps, outputs out, plans to every rank.

Never blocks on the API; while idle a heartbeat plan goes out every second. SIGTERM/SIGINT
(or a wire.DrainRequest from the API process) start a drain: new requests get 503, in-flight
ones have `shutdown_timeout` seconds, the rest are aborted (docs/reliability.md).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass

import zmq

from tapserve.api import wire
from tapserve.api.sampling_params import SamplingParams
from tapserve.coordinator.custom_outputs import RequestError
from tapserve.coordinator.engine import Engine
from tapserve.coordinator.keepalive import HEARTBEAT_SECONDS
from tapserve.ranks.group import PlanChannel
from tapserve.ranks.plan import StepKind, StepPlan

log = logging.getLogger("tapserve.coordinator")
STOP_WAIT_SECONDS = 5.0  # for a step in flight to end before the stop plan goes out
FAILED_STOP_SECONDS = 5.0  # the stop plan's bound after a failure (a peer may hang in it)
STATS_SECONDS = 1.0
SHUTTING_DOWN = 503
REPEAT_SIGNAL_SECONDS = 1.0  # see CoordinatorLoop._repeat_gap
# for the API process to stop on the engine's final Shutdown (uvicorn's graceful 5 s and more)
API_EXIT_SECONDS = 10.0


@dataclass
class LoopSettings:
    ipc_dir: str
    shutdown_timeout: float = 10.0
    log_requests: bool = False
    # the launcher's pid (torchrun's agent, or launch.py --nproc-per-node): if it goes away
    # (SIGKILL, OOM), the group stops instead of serving on as orphans holding the port
    launcher_pid: int | None = None


class CoordinatorLoop:
    def __init__(
        self,
        engine: Engine,
        settings: LoopSettings,
        channel: PlanChannel | None,
        api_process: subprocess.Popen | None,
    ):
        self.engine, self.settings, self.channel = engine, settings, channel
        self.api_process = api_process
        self.zmq = zmq.Context()
        self.incoming = self.zmq.socket(zmq.PULL)
        self.incoming.bind(f"ipc://{settings.ipc_dir}/{wire.TO_ENGINE}")
        self.outgoing = self.zmq.socket(zmq.PUSH)
        self.outgoing.bind(f"ipc://{settings.ipc_dir}/{wire.FROM_ENGINE}")
        self.stop_requested_at: float | None = None
        self._stop_now = False  # a second signal: the drain ends at the next check
        self._first_signal_from_api = False
        self._drain_announced = False
        self._unsent: deque[bytes] = deque()  # kept in order while the API cannot take them
        self._last_stats = time.monotonic()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(
        self, signum, frame, from_api: bool = False, signal_time: float | None = None
    ) -> None:
        """signal_time: when the signal came (time.monotonic), if not now (the API process's,
        read after a step): one that came with the first counts as the first."""
        now = time.monotonic() if signal_time is None else signal_time
        if self.stop_requested_at is None:
            log.info(
                "signal %s: draining for up to %.0f s (signal again to stop now)",
                signum,
                self.settings.shutdown_timeout,
            )
            self.stop_requested_at = now  # the loop announces it (not re-entrant here)
            self._first_signal_from_api = from_api
        elif now - self.stop_requested_at >= self._repeat_gap(from_api) and not self._stop_now:
            log.info("signal %s again: stopping now", signum)
            self._stop_now = True

    def _repeat_gap(self, from_api: bool) -> float:
        """How long after the first signal a second one ends the drain at once (one signal may
        arrive twice, through a launcher or to every process of a systemd unit)."""
        twice = self.settings.launcher_pid is not None or from_api or self._first_signal_from_api
        return REPEAT_SIGNAL_SECONDS if twice else 0.0

    def run(self) -> int:
        """Serve until a signal's drain completes (returns 0) or the API process dies (1); an
        exception stops every rank and propagates."""
        try:
            code = self._serve()
        except BaseException:
            self._stop(plan_timeout_s=FAILED_STOP_SECONDS)
            raise
        self._stop()
        return code

    def _serve(self) -> int:
        while True:
            if self.api_process is not None and self.api_process.poll() is not None:
                if self.incoming.poll(200):  # a drain request it sent before it went (after
                    self._receive(block=False)  # a freeze, ZeroMQ's I/O thread may lag)
                return self._api_exited(self.api_process.returncode)
            if (
                self.settings.launcher_pid is not None
                and os.getppid() != self.settings.launcher_pid
            ):
                log.error("the launcher (pid %d) is gone; stopping", self.settings.launcher_pid)
                return 1
            self._receive(block=not self.engine.has_work())
            if self.stop_requested_at is not None:
                self._announce_drain()
                if self._drained():
                    return 0
            if self.engine.has_work():
                self._send_outputs(self.engine.step())
            self._tick()

    def _api_exited(self, code: int) -> int:
        """0 if the API process's exit was a stop asked for (a signal or a drain), else 1."""
        if code in (-signal.SIGTERM, -signal.SIGINT):
            log.info("the API process was stopped by signal %d; stopping", -code)
            return 0
        if code == 0 and self.stop_requested_at is not None:
            log.info("the API process stopped during the drain; stopping")
            return 0
        log.error("API process exited with %s; stopping", code)
        return 1

    # ---- messages --------------------------------------------------------------------------
    def _receive(self, block: bool) -> None:
        if block and not self.incoming.poll(50):
            return
        while True:
            try:
                data = self.incoming.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(wire.decode(data))

    def _handle(self, msg) -> None:
        if isinstance(msg, wire.AbortRequest):
            self.engine.abort_request(msg.request_id)
            return
        if isinstance(msg, wire.DrainRequest):  # the API process got the signal itself
            log.info("the API process got signal %s", msg.signal)
            # it may come with rank 0's own signal: only a later one counts as a second
            now = time.monotonic()  # (the message may be read a long step after the signal)
            self._on_signal(
                msg.signal, None, from_api=True, signal_time=min(msg.signal_time or now, now)
            )
            return
        if not isinstance(msg, wire.AddRequest):
            return
        if self.settings.log_requests:
            log.info(
                "request %s: %d prompt tokens, params %s",
                msg.request_id,
                len(msg.prompt_token_ids),
                msg.sampling_params,
            )
        self._send_outputs(wire.Outputs([self._admit(msg)]))

    def _admit(self, msg: wire.AddRequest) -> wire.RequestOutput:
        if self.stop_requested_at is not None:
            return self._rejection(msg.request_id, SHUTTING_DOWN, "server is shutting down")
        try:
            params = SamplingParams.from_dict(msg.sampling_params)
            self.engine.add_request(
                msg.request_id, msg.prompt_token_ids, params, msg.custom_output_params
            )
        except RequestError as e:
            if e.selector_error is not None:  # logged and counted for the operator
                self.engine.custom_stats.selector_failed(msg.request_id, e)
            return self._rejection(msg.request_id, e.code, e.message, e.param)
        except (ValueError, TypeError) as e:
            return self._rejection(msg.request_id, wire.INVALID_PARAMS, str(e))
        return wire.RequestOutput(
            msg.request_id,
            accepted=True,
            num_prompt_tokens=len(msg.prompt_token_ids),
            engine_stop_strings=self.engine.requests[msg.request_id].watch_stop_strings,
        )

    @staticmethod
    def _rejection(
        request_id: str, code: int, message: str, param: str | None = None
    ) -> wire.RequestOutput:
        return wire.RequestOutput(
            request_id,
            accepted=False,
            finished=True,
            error_code=code,
            error_message=message,
            error_param=param,
        )

    def _send_outputs(self, outputs: wire.Outputs) -> None:
        if len(outputs):
            self._send(wire.encode(outputs))

    def _send(self, data: bytes) -> None:
        """Never blocks the engine: what the API cannot take now waits, in order."""
        self._unsent.append(data)
        while self._unsent:
            try:
                self.outgoing.send(self._unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._unsent.popleft()

    # ---- housekeeping ------------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        if self.channel is not None and now - self.channel.last_sent >= HEARTBEAT_SECONDS:
            self.channel.send(StepPlan(kind=StepKind.HEARTBEAT))
        if now - self._last_stats >= STATS_SECONDS:
            self._send(wire.encode(self.stats()))
            self._last_stats = now

    def stats(self) -> wire.EngineStats:
        e = self.engine
        return wire.EngineStats(
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting),
            kv_blocks_total=e.blocks.num_blocks,
            kv_blocks_used=e.blocks.num_blocks - e.blocks.num_free_blocks,
            prefix_cache_queries=e.blocks.stats.queried_tokens,
            prefix_cache_hits=e.blocks.stats.hit_tokens,
            custom_output_calls=e.custom_stats.calls,
            custom_output_errors=e.custom_stats.errors,
            custom_output_selector_invalid=e.custom_stats.selector_invalid,
            custom_output_selector_errors=e.custom_stats.selector_errors,
            custom_output_rows=e.custom_stats.rows_sent,
            custom_output_bytes=e.custom_stats.bytes_sent,
            custom_output_content_filter=e.custom_stats.content_filter,
            custom_output_should_stop_errors=e.custom_stats.should_stop_errors,
            engine_steps=e.num_steps,
            engine_steps_ahead=e.num_ahead_steps,
        )

    def _announce_drain(self) -> None:
        if not self._drain_announced:
            self._send(wire.encode(wire.Shutdown("draining")))
            self._drain_announced = True

    def _drained(self) -> bool:
        if not self.engine.requests and not self.engine.has_work():  # no step in flight
            return True
        if (
            not self._stop_now
            and time.monotonic() - self.stop_requested_at < self.settings.shutdown_timeout
        ):
            return False
        for request_id in list(self.engine.requests):
            self.engine.abort_request(
                request_id, error=(SHUTTING_DOWN, "server shut down before the request finished")
            )
        self._send_outputs(self.engine.step())
        return True

    def _stop(self, plan_timeout_s: float | None = None) -> None:
        if (
            not self._flush_to_api(wire.encode(wire.Shutdown("engine stopped", stopped=True)))
            and self.api_process is not None
            and self.api_process.poll() is None
        ):
            log.info("the API process has not connected; stopping it")
            self.api_process.kill()  # still starting: it serves nothing yet
        if self.channel is not None:
            # a step may be in flight (a failure exit): its collectives should end on every
            # GPU before the stop plan lets the other ranks leave
            if not self.engine.runner.wait_idle(STOP_WAIT_SECONDS):
                log.warning(
                    "a step still runs on the GPU %.0f s on; stopping anyway", STOP_WAIT_SECONDS
                )
            try:
                self.channel.send(StepPlan(kind=StepKind.STOP), plan_timeout_s)
            except RuntimeError:
                pass  # a peer is already gone, or hangs
        if self.api_process is not None and self.api_process.poll() is None:
            try:  # the Shutdown above stops it: it finishes the responses it has data for
                self.api_process.wait(API_EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                log.warning(
                    "the API process did not stop within %.0f s; killing it", API_EXIT_SECONDS
                )
                self.api_process.kill()
        self.incoming.close(0)
        self.zmq.term()

    def _flush_to_api(self, last: bytes, timeout_ms: int = 2000) -> bool:
        """Hand every pending message to the API process, waiting at most timeout_ms if it is
        alive; False when it took none of them."""
        self._unsent.append(last)
        alive = self.api_process is None or self.api_process.poll() is None
        self.outgoing.setsockopt(zmq.SNDTIMEO, timeout_ms if alive else 0)
        try:
            while self._unsent:
                self.outgoing.send(self._unsent[0])
                self._unsent.popleft()
        except zmq.Again:
            pass
        self.outgoing.close(linger=timeout_ms if alive else 0)  # delivered, not dropped
        return not self._unsent
