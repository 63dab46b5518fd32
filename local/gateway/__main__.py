"""Command line: python -m local.gateway --help"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from .extproc import BUFFERED, FULL_DUPLEX, NONE, SKIP, STREAMED
from .server import Gateway, GatewayConfig

BODY_MODES = {"buffered": BUFFERED, "full-duplex": FULL_DUPLEX}
RESPONSE_MODES = {"skip": SKIP, "none": NONE, "streamed": STREAMED, "full-duplex": FULL_DUPLEX}


def parse_group(text: str) -> tuple[str, int, list[str]]:
    """`NAME:WEIGHT=ip:port,ip:port` -> (name, weight, endpoints)."""
    head, sep, endpoints = text.partition("=")
    name, _, weight = head.partition(":")
    eps = [e.strip() for e in endpoints.split(",") if e.strip()]
    if not sep or not name or not weight.isdigit() or not eps:
        raise argparse.ArgumentTypeError(f"--group {text!r}: expected NAME:WEIGHT=ip:port[,ip:port...]")
    return name, int(weight), eps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m local.gateway", description=__doc__.split("\n")[0])
    p.add_argument("--endpoints", help="one backend group: ip:port[,ip:port...]")
    p.add_argument("--group", type=parse_group, action="append", default=[],
                   help="8080 weighted backend group NAME:WEIGHT=ip:port,... (repeat; HTTPRoute backendRefs)")
    p.add_argument("--llm-group", type=parse_group, action="append", default=[],
                   help="8081 backend groups, same syntax (default: one group of every endpoint)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8080, help="listener `http` (least request)")
    p.add_argument("--llm-port", type=int, default=8081, help="listener `llm-gw` (ext_proc to the picker)")
    p.add_argument("--admin-port", type=int, default=9901, help="GET /gateway/stats, /health")
    p.add_argument("--picker", default="127.0.0.1:9002", help="picker ext_proc address")
    p.add_argument("--picker-tls", action="store_true", help="TLS to the picker, certificate not verified")
    p.add_argument("--body-mode", choices=BODY_MODES, default="buffered", help="request body processing mode")
    p.add_argument("--response-body-mode", choices=RESPONSE_MODES,
                   help="response processing: skip = none at all (EG without processingMode.response), "
                        "none = headers only; default skip with buffered, full-duplex with full-duplex")
    p.add_argument("--message-timeout", type=float, default=60.0, help="seconds per ext_proc answer")
    p.add_argument("--fail-mode", choices=["close", "open"], default="close",
                   help="picker failure: close = answer --status-on-error, open = least request")
    p.add_argument("--status-on-error", type=int, default=503)
    p.add_argument("--connect-timeout", type=float, default=10.0)
    p.add_argument("--request-timeout", type=float, default=3600.0, help="whole request, seconds")
    p.add_argument("--stream-idle-timeout", type=float, default=300.0, help="seconds without upstream bytes")
    p.add_argument("--buffer-limit", type=int, default=20 * 1024 * 1024,
                   help="largest request body in BUFFERED mode (bytes); larger gets 413")
    p.add_argument("--no-served-by-header", action="store_true", help="omit response header x-gateway-served-by")
    p.add_argument("--seed", type=int, default=None, help="balancer random seed")
    p.add_argument("--log-level", default="INFO", help="INFO writes one JSON access line per request")
    args = p.parse_args(argv)
    if args.endpoints:
        args.group.insert(0, parse_group(f"default:1={args.endpoints}"))
    if not args.group:
        p.error("give --endpoints or at least one --group")
    return args


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    response_mode = args.response_body_mode or ("full-duplex" if args.body_mode == "full-duplex" else "skip")
    return GatewayConfig(
        route=args.group, llm_route=args.llm_group or None, host=args.host, http_port=args.http_port, llm_port=args.llm_port,
        admin_port=args.admin_port, picker=args.picker, picker_tls=args.picker_tls,
        request_body_mode=BODY_MODES[args.body_mode], response_body_mode=RESPONSE_MODES[response_mode],
        message_timeout=args.message_timeout, fail_open=args.fail_mode == "open",
        status_on_error=args.status_on_error, connect_timeout=args.connect_timeout,
        request_timeout=args.request_timeout, stream_idle_timeout=args.stream_idle_timeout,
        buffer_limit=args.buffer_limit, served_by_header=not args.no_served_by_header, seed=args.seed)


async def serve(config: GatewayConfig) -> None:
    gateway = Gateway(config)
    await gateway.start()
    logging.getLogger("local.gateway").warning(
        "gateway up: http %s:%d, llm-gw %s:%d (%s, picker %s), admin %d", config.host, config.http_port,
        config.host, config.llm_port, config.request_body_mode, config.picker, config.admin_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await gateway.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = config_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stdout, format="%(message)s")
    if config.fail_open and config.request_body_mode == FULL_DUPLEX:
        logging.warning("Envoy Gateway rejects failOpen with FullDuplexStreamed; running it anyway")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
