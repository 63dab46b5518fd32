"""Tiny fake OpenAI SSE server with known timings, for the load-test tests.

    python loadtest/tests/fake_openai.py --ttft 0.05 --itl 0.01 [--fail-every N] [--broken-every M]

Binds 127.0.0.1 on a free port and prints "PORT <n>" on stdout. Each streamed answer: the
first chunk after `ttft` s, then one chunk every `itl` s (scheduled from the request's arrival,
so no drift), max_tokens chunks in all, then a usage chunk and [DONE]. Request number k
(1-based) answers HTTP 500 if k % fail_every == 0, or sends a non-JSON event after two chunks if
k % broken_every == 0. /metrics shows vLLM gauges (running = streams in flight).
"""
from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web


def make_app(ttft: float, itl: float, fail_every: int, broken_every: int,
             api_keys: list[str] | None = None, refuse_objective: str = "") -> web.Application:
    state = {"count": 0, "running": 0}

    async def stream(request: web.Request) -> web.StreamResponse:
        if api_keys and request.headers.get("Authorization") not in [f"Bearer {k}" for k in api_keys]:
            return web.json_response({"error": {"message": "invalid API key"}}, status=401)
        if refuse_objective and request.headers.get("x-gateway-inference-objective") == refuse_objective:
            return web.json_response({"error": {"message": "refused for 1.5s", "code": "queue_timeout"}},
                                     status=503)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        body = await request.json()
        state["count"] += 1
        k = state["count"]
        if fail_every and k % fail_every == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        chat = request.path.endswith("/chat/completions")
        n = int(body.get("max_completion_tokens" if chat else "max_tokens") or 16)
        text = body.get("prompt") if not chat else " ".join(m["content"]
                                                            for m in body["messages"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        state["running"] += 1
        try:
            for i in range(n):
                await asyncio.sleep(max(0.0, t0 + ttft + i * itl - loop.time()))
                if broken_every and k % broken_every == 0 and i == 2:
                    await resp.write(b"data: {not json\n\n")
                    return resp
                choice = ({"index": 0, "delta": {"content": "tok "}} if chat
                          else {"index": 0, "text": "tok "})
                await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            usage = {"prompt_tokens": len(text.split()), "completion_tokens": n,
                     "total_tokens": len(text.split()) + n}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        finally:
            state["running"] -= 1
        return resp

    async def metrics(_request: web.Request) -> web.Response:
        text = ("# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="qwq"}} {state["running"]}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                'vllm:num_requests_waiting{model_name="qwq"} 0\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{model_name="qwq"}} {state["running"] / 100}\n')
        return web.Response(text=text)

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    app.router.add_post("/v1/chat/completions", stream)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(args) -> None:
    runner = web.AppRunner(make_app(args.ttft, args.itl, args.fail_every, args.broken_every, args.api_key,
                                          args.refuse_objective))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"PORT {port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--itl", type=float, default=0.01)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--broken-every", type=int, default=0)
    p.add_argument("--api-key", action="append", default=[],
                   help="answer 401 unless `Authorization: Bearer <key>` with one of these keys (repeat)")
    p.add_argument("--refuse-objective", default="",
                   help="answer 503 (code queue_timeout) to requests with this objective header")
    asyncio.run(serve(p.parse_args()))
