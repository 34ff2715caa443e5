"""Per-app state and the request pipeline shared by the OpenAI and native endpoints:
admission (503), checks (605), submit and wait for the accept answer, then collect or stream,
aborting the engine requests when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tapserve.api import wire
from tapserve.api.config import ApiConfig
from tapserve.api.engine_client import EngineClient, EngineError
from tapserve.api.errors import ApiError, invalid, is_openai_path, sse_error_event
from tapserve.api.generation import Generation
from tapserve.api.metrics import ApiMetrics
from tapserve.api.sampling_params import SamplingParams
from tapserve.api.tokenizer import TextTokenizer, UnencodableTextError

log = logging.getLogger("tapserve.api")
# request bodies above this many bytes are prepared in a worker thread (the tokenizer
# releases the GIL; a huge prompt would otherwise stall every stream)
OFF_LOOP_BODY_BYTES = 64 * 1024
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The HTTP client disconnected while we waited."""


# what json.dumps(obj, ensure_ascii=False, allow_nan=False) builds on every call, built once
_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False)
json_string = json.encoder.encode_basestring  # a str as JSON, as _JSON writes it


def sse(obj: Any) -> str:
    return f"data: {_JSON.encode(obj)}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(request: Request, awaitable: Awaitable) -> Any:
    """Await `awaitable` unless the client disconnects first (then ClientGone)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    # retrieve a late exception, so asyncio does not log it as never retrieved
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    raise ClientGone()


def _api_error(e: EngineError, request: Request) -> ApiError:
    """The answer for an engine error, its field named as the request named it."""
    param, path = e.param, request.url.path
    if param is not None and is_openai_path(path):
        chat = path.endswith("/chat/completions")
        names = {
            "max_new_tokens": getattr(request.state, "max_tokens_param", "max_tokens"),
            "prompt": "messages" if chat else "prompt",
        }
        param = names.get(param, param)
    return ApiError(e.code, e.message, param)


@dataclass
class AppState:
    config: ApiConfig
    tokenizer: TextTokenizer
    client: EngineClient
    metrics: ApiMetrics
    created: int = field(default_factory=lambda: int(time.time()))  # the model card's "created"

    # ---- checks ----------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """404 for a request that names a model this server does not serve (None: any)."""
        if model is not None and model != self.config.served_model_name:
            raise ApiError(
                404,
                f"the model '{model}' does not exist; this server serves "
                f"'{self.config.served_model_name}'",
                "model",
            )

    def admit(self, num_requests: int, param: str = "prompt") -> None:
        """605 for a request larger than the whole queue; 503 while the engine is down or
        stopping, or when the queue is full."""
        if num_requests > self.config.max_in_flight:
            raise invalid(
                f"the request has {num_requests} prompts; the server admits "
                f"at most {self.config.max_in_flight} at once",
                param,
            )
        if self.client.shutting_down:
            raise ApiError(503, "the server is shutting down")
        if not self.client.healthy(self.config.health_timeout_s):  # as /health says
            raise ApiError(503, "the engine is not available")
        if self.client.num_in_flight + num_requests > self.config.max_in_flight:
            raise ApiError(
                503, f"too many requests in flight (limit {self.config.max_in_flight}); retry later"
            )

    @staticmethod
    async def prepare(request: Request, work: Callable[[], Any]) -> Any:
        """work(), on the event loop for a small request, in a worker thread for a large one."""
        if len(await request.body()) <= OFF_LOOP_BODY_BYTES:
            return work()
        return await asyncio.to_thread(work)

    @property
    def vocab_size(self) -> int:
        """The ids a client may send and the model may sample (the larger vocabulary)."""
        return max(self.tokenizer.vocab_size, self.config.model_vocab_size)

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """text's token ids; a 605 naming param for text that is not valid Unicode."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except UnencodableTextError as e:
            raise invalid(str(e), param) from None

    def prompt_ids(
        self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        """Tokenize (or check) one prompt: nonempty, known token ids, shorter than the context."""
        if isinstance(prompt, str):
            ids = self.encode(prompt, param, add_special_tokens)
        else:
            ids = list(prompt)
            vocab = self.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise invalid(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param)
        if not ids:
            raise invalid("the prompt is empty", param)
        if len(ids) >= self.config.max_model_len:
            raise invalid(
                f"the prompt is {len(ids)} tokens; the model's context is "
                f"{self.config.max_model_len} tokens (prompt too long)",
                param,
            )
        return ids

    def max_new_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        """Requested output length, checked against the limits; None -> what fits."""
        room = self.config.max_model_len - prompt_len
        if requested is None:
            return min(room, self.config.max_tokens_limit)
        if requested < 0 or requested > self.config.max_tokens_limit:
            raise invalid(
                f"{param} must be in [0, {self.config.max_tokens_limit}], got {requested}", param
            )
        if requested > room:
            raise invalid(
                f"the model's context is {self.config.max_model_len} tokens, but "
                f"{prompt_len + requested} were requested ({prompt_len} in the prompt, "
                f"{requested} in {param})",
                param,
            )
        return requested

    def check_n(self, n: int, param: str) -> None:
        if n > self.config.max_n:
            raise invalid(f"{param} must be <= {self.config.max_n}, got {n}", param)

    def sampling_params(self, **kwargs: Any) -> SamplingParams:
        """A request's SamplingParams over the model's defaults; a 605 for bad values."""
        try:
            return SamplingParams(**{**self.config.default_sampling, **kwargs})
        except (ValueError, TypeError) as e:
            raise invalid(str(e), str(e).split(" ", 1)[0]) from None

    # ---- running ---------------------------------------------------------------------
    def submit(
        self,
        request: Request,
        kind: str,
        prompts: list[tuple[list[int], SamplingParams]],
        custom_output_params: list[dict | None],
    ) -> Generation:
        """Send one engine request per prompt (after the admission check)."""
        self.admit(len(prompts))
        adds = [
            wire.AddRequest(self.client.new_request_id(kind), ids, params.to_dict(), cop)
            for (ids, params), cop in zip(prompts, custom_output_params)
        ]
        group = self.client.submit(adds)
        if self.config.log_requests:
            for add in adds:
                log.info(
                    "request %s %s prompt_tokens=%d params=%s custom_output_params=%s",
                    add.request_id,
                    request.url.path,
                    len(add.prompt_token_ids),
                    add.sampling_params,
                    add.custom_output_params,
                )
        return Generation(self.tokenizer, group, prompts, self.metrics, self.config.eos_token_ids)

    async def accepted(self, request: Request, generation: Generation, watch: bool = True) -> None:
        """Wait for every accept answer; a rejection becomes an ApiError (605/606). `watch`:
        raise ClientGone when the client disconnects."""
        waiting = generation.group.accepted()
        try:
            await (race_disconnect(request, waiting) if watch else waiting)
        except EngineError as e:
            generation.group.abort()
            raise _api_error(e, request) from None
        except BaseException:
            generation.group.abort()
            raise
        self.metrics.prompt_tokens.inc(sum(len(p.prompt_ids) for p in generation.prompts.values()))

    async def start(
        self,
        request: Request,
        kind: str,
        prompts: list[tuple[list[int], SamplingParams]],
        custom_output_params: list[dict | None],
    ) -> Generation:
        """submit + accepted."""
        generation = self.submit(request, kind, prompts, custom_output_params)
        await self.accepted(request, generation)
        return generation

    async def collect(self, request: Request, generation: Generation, watch: bool = True) -> None:
        """Run a generation to its end (non-streaming); aborts it if the client leaves."""

        async def drain() -> None:
            async for _ in generation.run():
                pass

        try:
            await (race_disconnect(request, drain()) if watch else drain())
        except EngineError as e:
            raise _api_error(e, request) from None
        finally:
            generation.group.abort()
            self.log_done(generation)

    def stream(
        self, request: Request, generation: Generation, events: Callable[[], AsyncIterator[str]]
    ) -> StreamingResponse:
        """SSE response from `events()`; an error becomes the last event, and the engine
        requests are aborted when the stream ends."""
        path = request.url.path

        async def body() -> AsyncIterator[str]:
            try:
                async for event in events():
                    yield event
            except EngineError as e:
                yield sse_error_event(_api_error(e, request), path, request.scope)
            except Exception as e:  # a bug of ours: the client still gets a last event
                log.exception("stream of %s failed", path)
                yield sse_error_event(
                    ApiError(500, f"internal error: {type(e).__name__}: {e}"), path, request.scope
                )
            finally:
                generation.group.abort()
                self.log_done(generation)

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)

    def log_done(self, generation: Generation) -> None:
        if self.config.log_requests:
            for state in generation.prompts.values():
                log.info(
                    "request %s done: %s",
                    state.request_id,
                    [(c.index, len(c.token_ids), c.finish_reason) for c in state.choices.values()],
                )
