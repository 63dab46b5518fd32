"""An OpenAI-compatible HTTP front for one simulated vLLM engine (aiohttp).

One process = one port = one engine (a vLLM leader of one LWS group). Paths, bodies, SSE framing,
errors and /metrics follow vLLM's OpenAI server. The engine runs in model time: the clock reads
`(monotonic - start) * speedup`, and the loop sleeps `step duration / speedup` per iteration, so
`--speedup 20` runs the same schedule 20 times faster while metrics and histograms still read in
model seconds.

Fault options for tests: `error_rate` (fraction of completion requests answered 500),
`metrics_delay` (seconds before /metrics answers), `metrics_fail` (/metrics answers 500),
`stall_after` (when one more request than that arrives, the engine stops stepping: requests hang while
/health and /metrics keep answering, like a wedged GPU worker).

KV-cache events (`kv_events`, vLLM's `--kv-events-config`): after each engine step the events
its block allocator recorded are published as one batch (local/sim/kv_events.py), when the step's
tokens are delivered; `GET /kv_event_sources` returns the publisher's config per data-parallel
rank and `POST /reset_prefix_cache` clears the prefix cache (published with the next step, as
vLLM does). `tokenizer` (local/sim/tokenizer.py) turns prompts into token ids; without one a
word is a token.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import zlib
from dataclasses import dataclass
from typing import Optional

from aiohttp import web

from local.sim.clock import to_model_seconds, to_wall_seconds
from local.sim.engine import Engine, StepOutput
from local.sim.engines import EngineModel
from local.sim.kv_events import EventPublisher, KVEventsConfig
from local.sim.metrics import CONTENT_TYPE, render_metrics
from local.sim import validation
from local.sim.tokenizer import WordTokenizer
from local.sim.tokens import filler_word
from local.sim.validation import RequestError

VLLM_VERSION = "0.32.0"      # the vLLM whose surfaces the simulator follows (tests/conformance)
EOS_MIN, EOS_SPAN = 16, 1009   # without ignore_eos, EOS falls at 16..1024 tokens (from the seed)


@dataclass
class Faults:
    error_rate: float = 0.0
    metrics_delay: float = 0.0
    metrics_fail: bool = False
    stall_after: Optional[int] = None


def _error(err: RequestError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def _json_http_errors(request: web.Request, handler):
    """Unknown paths and wrong methods answer like vLLM's FastAPI: JSON {"detail": reason}."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status not in (404, 405):
            raise
        return web.json_response({"detail": exc.reason}, status=exc.status)


class SimServer:
    def __init__(self, engine_model: EngineModel, served_model_names: list[str], speedup: float = 1.0,
                 seed: int = 0, faults: Optional[Faults] = None,
                 kv_events: Optional[KVEventsConfig] = None, tokenizer=None,
                 max_loras: Optional[int] = None):
        if speedup <= 0:
            raise ValueError("speedup must be positive")
        if not served_model_names:
            raise ValueError("need at least one served model name")
        self.engine_model = engine_model
        self.max_loras = max_loras     # vLLM's --enable-lora --max-loras: /metrics gets lora info
        self.names = list(dict.fromkeys(served_model_names))
        self.speedup = speedup
        self.seed = seed
        self.faults = faults or Faults()
        self.rng = random.Random(seed)
        self.start = time.monotonic()
        self.tokenizer = tokenizer or WordTokenizer()
        self.kv_events = kv_events
        self.publisher = EventPublisher(kv_events) if kv_events and kv_events.publishes else None
        self.engine = Engine(engine_model, self.model_time, kv_events=self.publisher is not None,
                             output_token=self.tokenizer.output_token)
        self.streams: dict[str, asyncio.Queue] = {}
        self.accepted = 0
        self.counter = 0
        self.wakeup: Optional[asyncio.Event] = None
        self.loop_task: Optional[asyncio.Task] = None

    def model_time(self) -> float:
        return to_model_seconds(time.monotonic() - self.start, self.speedup)

    @property
    def stalled(self) -> bool:
        s = self.faults.stall_after
        return s is not None and self.accepted > s

    # ----- the engine loop ---------------------------------------------------------------

    async def run_engine(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_work() or self.stalled:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            result = engine.step()
            if result is None:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            delay = to_wall_seconds(result.end_time - self.model_time(), self.speedup)
            await asyncio.sleep(max(0.0, delay))
            if self.publisher is not None:
                self.publisher.publish(engine.take_kv_events())
            for out in result.outputs:
                queue = self.streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    async def on_startup(self, app: web.Application) -> None:
        self.wakeup = asyncio.Event()
        if self.publisher is not None:
            self.publisher.start()
        self.loop_task = asyncio.create_task(self.run_engine())

    async def on_shutdown(self, app: web.Application) -> None:
        """End every open request at once, so a stopping server does not wait for them."""
        for queue in self.streams.values():
            queue.put_nowait(None)

    async def on_cleanup(self, app: web.Application) -> None:
        if self.loop_task:
            self.loop_task.cancel()
            try:
                await self.loop_task
            except asyncio.CancelledError:
                pass
        if self.publisher is not None:
            await self.publisher.close()

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_json_http_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/version", self.version)
        app.router.add_get("/kv_event_sources", self.kv_event_sources)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.on_startup.append(self.on_startup)
        app.on_shutdown.append(self.on_shutdown)
        app.on_cleanup.append(self.on_cleanup)
        return app

    # ----- simple endpoints ----------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [{"id": n, "object": "model", "created": created, "owned_by": "vllm",
                 "root": self.names[0], "parent": None,
                 "max_model_len": self.engine_model.max_model_len} for n in self.names]
        return web.json_response({"object": "list", "data": data})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a `prompt` or chat `messages` (with the reply primer, as vLLM's
        default add_generation_prompt) -> count, max_model_len, tokens (the simulator's ids)."""
        try:
            body = validation.parse_body(await request.read(), request.content_type)
            validation.check_model(body, self.names)
            ids = self._prompt_ids(body, chat="messages" in body)
        except RequestError as err:
            return _error(err)
        return web.json_response({"count": len(ids), "max_model_len": self.engine_model.max_model_len,
                                  "tokens": ids, "token_strs": None})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """The KV-event publisher's config per data-parallel rank ({} when events are off)."""
        if self.kv_events is None or not self.kv_events.enable_kv_cache_events:
            return web.json_response({})
        return web.json_response({"0": self.kv_events.as_dict()})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.engine.reset_prefix_cache():
            return _error(RequestError(400, "cannot reset the prefix cache while requests hold "
                                            "KV blocks", "BadRequestError"))
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        if self.faults.metrics_delay > 0:
            await asyncio.sleep(self.faults.metrics_delay)
        if self.faults.metrics_fail:
            return web.Response(status=500, text="simulated /metrics failure\n")
        lora = (self.max_loras, time.time()) if self.max_loras else None
        text = render_metrics(self.engine, self.names[0], lora=lora)
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

    # ----- completions ----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if isinstance(messages, list) and not messages:
                raise validation.empty_conversation()
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise RequestError(400, "'messages' must be a list of message objects",
                                   "BadRequestError", "messages")
            try:
                return self.tokenizer.chat_ids(messages)
            except ValueError as err:
                raise RequestError(400, str(err), "BadRequestError", "messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if prompt is None or prompt == "" or prompt == []:
            raise validation.empty_prompt()
        if isinstance(prompt, str):
            return self.tokenizer.prompt_ids(prompt) or [0]   # whitespace only: still one token
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in prompt):
            return list(prompt)
        raise RequestError(400, "'prompt' must be a string, a one-string list or a list of token "
                                "ids (the simulator serves one prompt per request)",
                           "BadRequestError", "prompt")

    def _parse(self, body: dict, chat: bool) -> tuple[str, list[int], int]:
        """(model, prompt token ids, output limit) of a request, or the RequestError vLLM answers.
        Over-long requests are served like vLLM 0.32's: a prompt that fits is generated up to
        the context limit (finish reason `length`) even when prompt + max_tokens exceeds it."""
        max_len = self.engine_model.max_model_len
        max_tokens = validation.check_max_tokens(body, chat, max_len)
        model = validation.check_model(body, self.names)
        ids = self._prompt_ids(body, chat)
        validation.check_prompt_length(len(ids), max_len)
        room = max_len - len(ids)
        return model, ids, room if max_tokens is None else min(max_tokens, room)

    def _stop_at(self, ids: list[int], body: dict, max_tokens: int) -> Optional[int]:
        """Where the model's own end of sequence falls: never with ignore_eos; right at
        `min_tokens` when given (vLLM holds EOS back until then; the simulated model then ends
        its answer, which is how load tests give a capped request a length of their choosing);
        else from a hash of the prompt."""
        if body.get("ignore_eos"):
            return None
        minimum = body.get("min_tokens")
        if isinstance(minimum, int) and not isinstance(minimum, bool) and minimum > 0:
            return minimum if minimum < max_tokens else None
        h = zlib.crc32(repr((self.seed, len(ids), ids[:8], ids[-8:])).encode())
        return EOS_MIN + h % EOS_SPAN if EOS_MIN + h % EOS_SPAN < max_tokens else None

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = validation.parse_body(await request.read(), request.content_type)
            model, ids, max_tokens = self._parse(body, chat)
        except RequestError as err:
            return _error(err)
        if self.faults.error_rate > 0 and self.rng.random() < self.faults.error_rate:
            return _error(RequestError(500, "simulated engine error", "InternalServerError"))
        self.counter += 1
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{self.seed}-{self.counter}"
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        try:
            self.engine.add_request(request_id, ids, max_tokens,
                                    stop_at=self._stop_at(ids, body, max_tokens))
        except ValueError as err:
            del self.streams[request_id]
            return _error(RequestError(400, str(err), "BadRequestError"))
        self.accepted += 1
        self.wakeup.set()
        stream_seed = zlib.crc32(request_id.encode())
        ctx = _Response(request_id, model, chat, len(ids), stream_seed)
        try:
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._stream(request, queue, ctx, include_usage)
            return await self._collect(queue, ctx)
        finally:
            self.streams.pop(request_id, None)
            if request_id in self.engine.requests:     # client went away: free its blocks
                self.engine.abort(request_id)

    async def _stream(self, request: web.Request, queue: asyncio.Queue, ctx: "_Response",
                      include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        while True:
            out: Optional[StepOutput] = await queue.get()
            if out is None:                 # shutting down: cut the stream like a dying server
                return resp
            if ctx.chat and out.first_token:    # vLLM opens a chat stream with the role alone
                await resp.write(ctx.sse(ctx.role_chunk()))
            await resp.write(ctx.sse(ctx.chunk(out)))
            if out.finished:
                break
        if include_usage:
            await resp.write(ctx.sse(ctx.usage_chunk(out.num_output_tokens)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _collect(self, queue: asyncio.Queue, ctx: "_Response") -> web.Response:
        words = []
        while True:
            out: Optional[StepOutput] = await queue.get()
            if out is None:
                return _error(RequestError(503, "the server is shutting down",
                                           "ServiceUnavailableError"))
            words.append(ctx.word(out.num_output_tokens - 1))
            if out.finished:
                break
        return web.json_response(ctx.full(" ".join(words), out.finish_reason,
                                          out.num_output_tokens))


class _Response:
    """Builds vLLM-shaped response objects for one request."""

    def __init__(self, request_id: str, model: str, chat: bool, prompt_tokens: int, seed: int):
        self.id, self.model, self.chat = request_id, model, chat
        self.prompt_tokens, self.seed = prompt_tokens, seed
        self.created = int(time.time())

    def word(self, index: int) -> str:
        return filler_word(self.seed, index)

    @staticmethod
    def sse(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "total_tokens":
                self.prompt_tokens + completion_tokens, "completion_tokens": completion_tokens}

    def chunk(self, out: StepOutput) -> dict:
        text = " " + self.word(out.num_output_tokens - 1)
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                      "finish_reason": out.finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": out.finish_reason, "stop_reason": None}
        return {**self._head("text_completion"), "choices": [choice]}

    def role_chunk(self) -> dict:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(completion_tokens)}

    def full(self, text: str, finish_reason: str, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text,
                                              "tool_calls": []},
                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            return {**self._head("chat.completion"), "choices": [choice],
                    "usage": self.usage(completion_tokens)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": None}
        return {**self._head("text_completion"), "choices": [choice],
                "usage": self.usage(completion_tokens)}
