"""python -m local.sim --port 8101 --served-model-name qwq [--served-model-name qwq-canary] ..."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from local.sim.engines import DEFAULT_ENGINE_MODEL, ENGINE_MODELS, get_engine_model
from local.sim.kv_events import KVEventsConfig
from local.sim.server import Faults, SimServer
from local.sim.tokenizer import load_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m local.sim",
                                description="Simulated vLLM OpenAI server (one engine per port).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", action="append", dest="names", metavar="NAME",
                   help="model name clients send (repeatable; the first labels /metrics); "
                        "default qwq")
    p.add_argument("--engine-model", default=DEFAULT_ENGINE_MODEL, choices=sorted(ENGINE_MODELS))
    p.add_argument("--speedup", type=float, default=1.0,
                   help="divide all model time by this factor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-gpu-blocks", type=int, help="override the engine model's KV capacity")
    p.add_argument("--max-num-seqs", type=int, help="override the engine model's batch limit")
    p.add_argument("--max-model-len", type=int, help="override the engine model's context length")
    p.add_argument("--max-loras", type=int, metavar="N",
                   help="as vLLM with --enable-lora --max-loras N: /metrics carries "
                        "vllm:lora_requests_info (no adapters are served)")
    p.add_argument("--error-rate", type=float, default=0.0,
                   help="fraction of completion requests answered with HTTP 500")
    p.add_argument("--metrics-delay", type=float, default=0.0,
                   help="seconds /metrics waits before answering")
    p.add_argument("--metrics-fail", action="store_true", help="/metrics answers HTTP 500")
    p.add_argument("--stall-after", type=int, metavar="N",
                   help="serve N requests, then the engine stops making progress (a stall)")
    p.add_argument("--kv-events-config", metavar="JSON",
                   help="publish KV-cache events like vLLM, e.g. '{\"enable_kv_cache_events\": "
                        "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:5557\", "
                        "\"replay_endpoint\": \"tcp://127.0.0.1:5558\", \"topic\": \"kv@pod\"}'")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the model's tokenizer directory (tokenizer.json, tokenizer_config.json); "
                        "default: one word is one token")
    args = p.parse_args(argv)
    if args.kv_events_config is not None:
        try:
            args.kv_events_config = KVEventsConfig.from_json(args.kv_events_config)
        except ValueError as err:
            p.error(str(err))
    if args.tokenizer is not None:
        try:
            args.tokenizer = load_tokenizer(args.tokenizer)
        except Exception as err:     # noqa: BLE001 - tokenizers raises its own exception types
            p.error(f"--tokenizer {args.tokenizer}: {err}")
    if not 0.0 <= args.error_rate <= 1.0:
        p.error("--error-rate must be in [0, 1]")
    if args.speedup <= 0:
        p.error("--speedup must be positive")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    engine_model = get_engine_model(args.engine_model)
    overrides = {k: v for k, v in (("num_gpu_blocks", args.num_gpu_blocks),
                                   ("max_num_seqs", args.max_num_seqs),
                                   ("max_model_len", args.max_model_len)) if v is not None}
    if overrides:
        engine_model = engine_model.with_overrides(**overrides)
    faults = Faults(args.error_rate, args.metrics_delay, args.metrics_fail, args.stall_after)
    server = SimServer(engine_model, args.names or ["qwq"], args.speedup, args.seed, faults,
                       kv_events=args.kv_events_config, tokenizer=args.tokenizer,
                       max_loras=args.max_loras)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    print(f"local.sim: {', '.join(server.names)} on http://{args.host}:{args.port} "
          f"(engine model {engine_model.name}, speedup {args.speedup:g}, seed {args.seed}, "
          f"tokenizer {server.tokenizer.name}"
          + (f", KV events on {args.kv_events_config.endpoint}" if server.publisher else "")
          + ")", flush=True)
    web.run_app(server.make_app(), host=args.host, port=args.port, print=None,
                access_log=None)


if __name__ == "__main__":
    main()
