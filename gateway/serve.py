"""``kvgate serve``: load the config, apply flags, run uvicorn with graceful draining on SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import uvicorn

from gateway.app import Gateway
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.logs import configure_logging
from gateway.tokenizer import TokenizerUnavailable

log = logging.getLogger("kvgate")

DRAIN_DEADLINE_S = 30.0


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT, first tell the gateway to drain (not-ready, 503 to new and queued requests), then
    let uvicorn stop accepting and wait up to the deadline for in-flight streams."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.gateway.begin_drain()
        super().handle_exit(sig, frame)


def build_config(args: argparse.Namespace) -> GatewayConfig:
    base = load_config(args.config) if args.config else GatewayConfig()
    return base.with_overrides(
        upstream=args.upstream,
        host=args.host,
        port=args.port,
        tokenizer=args.tokenizer,
        log_level=args.log_level,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except ConfigError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    gateway = Gateway(config)
    uv_config = uvicorn.Config(
        gateway,
        host=config.listen.host,
        port=config.listen.port,
        loop="uvloop" if _has("uvloop") else "asyncio",
        http="httptools" if _has("httptools") else "h11",
        lifespan="on",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=int(DRAIN_DEADLINE_S),
        timeout_keep_alive=30,
    )
    try:
        DrainingServer(uv_config, gateway).run()
    except TokenizerUnavailable as exc:
        log.error("%s", exc)
        return 2
    return 0


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
