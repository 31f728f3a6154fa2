"""``kvgate serve``: load the config, apply flags, run uvicorn with graceful draining on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import Any

import uvicorn

from gateway.config import ConfigError, ConfigFile, GatewayConfig, load_config, read_config_file
from gateway.logs import configure_logging
from gateway.server.app import Gateway
from gateway.server.http_server import configured_protocol
from gateway.tokens.resolve import load_explicit
from gateway.tokens.tokenizers import TokenizerUnavailable

log = logging.getLogger("kvgate")


class DrainingServer(uvicorn.Server):
    """Graceful drain on SIGTERM/SIGINT.

    The gateway turns not-ready and answers new and queued requests with 503 + Retry-After (so clients and
    load balancers move on at once, rather than meeting refused connections), while in-flight streams run to
    completion. Once none is left, or at the deadline, uvicorn shuts down. A second signal exits at once.
    """

    def __init__(
        self, config: uvicorn.Config, gateway: Gateway, drain_timeout_s: float, control_port: int | None = None
    ) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.drain_timeout_s = drain_timeout_s
        self.control_port = control_port
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start-up, then the control port (``listen.control_port``): a second listener of the same
        server, bound as uvicorn binds the client port, closed with it on shutdown. The gateway tells the two
        apart by the local port a request came in on."""
        await super().startup(sockets)
        if self.control_port is None or not self.started:
            return
        config = self.config

        def protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop
            )

        loop = asyncio.get_running_loop()
        try:
            server = await loop.create_server(
                protocol, host=config.host, port=self.control_port, backlog=config.backlog
            )
        except OSError as exc:  # as uvicorn does when the client port cannot be bound
            log.error("cannot listen on the control port %d: %s", self.control_port, exc)
            for listening in self.servers:
                listening.close()
            await self.lifespan.shutdown()
            sys.exit(3)
        self.servers.append(server)
        log.info("control endpoints (/readyz, /metrics, /healthz) on port %d only", self.control_port)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.gateway.draining or self._drain_task is not None:
            super().handle_exit(sig, frame)
            return
        self.gateway.begin_drain()
        loop = asyncio.get_event_loop()
        self._drain_task = loop.create_task(self._drain_then_exit(sig, frame))

    async def _drain_then_exit(self, sig: int, frame: Any) -> None:
        finished = await self.gateway.drained(self.drain_timeout_s)
        if not finished:
            log.warning(
                "drain deadline of %.0fs reached with %d request(s) in flight",
                self.drain_timeout_s,
                self.gateway.active_requests,
            )
        super().handle_exit(sig, frame)


def upstreams_from_environment() -> list[str] | None:
    """``KVGATE_UPSTREAM``: one engine URL, or several separated by commas (a pool); None when unset."""
    urls = [u.strip() for u in os.environ.get("KVGATE_UPSTREAM", "").split(",") if u.strip()]
    return urls or None


def build_config(args: argparse.Namespace, file: ConfigFile | None = None) -> GatewayConfig:
    """The config file (``file``, as read already, or ``args.config``), then KVGATE_UPSTREAM, then the flags:
    each overrides what comes before it."""
    base = file.config if file is not None else load_config(args.config) if args.config else GatewayConfig()
    return base.with_overrides(
        # a flag overrides the environment: --upstream-dns names the engines instead of KVGATE_UPSTREAM
        upstream=args.upstream or (None if getattr(args, "upstream_dns", None) else upstreams_from_environment()),
        upstream_dns=getattr(args, "upstream_dns", None),
        host=args.host,
        port=args.port,
        control_port=getattr(args, "control_port", None),
        tokenizer=args.tokenizer,
        tokenizer_download=args.tokenizer_download,
        log_level=args.log_level,
    )


def run(args: argparse.Namespace) -> int:
    try:
        file = read_config_file(args.config) if args.config else None
        config = build_config(args, file)
    except ConfigError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{args.config}: cannot be read: {exc.strerror or exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    if config.tokenizer not in ("auto", "vllm"):
        try:  # fail before binding the port, with the loader's explanation of what is missing
            asyncio.run(load_explicit(config.tokenizer, download=config.tokenizer_download))
        except TokenizerUnavailable as exc:
            log.error("cannot load tokenizer %r: %s", config.tokenizer, exc)
            return 2
    gateway = Gateway(config, config_file=file)
    DrainingServer(uvicorn_config(gateway, config), gateway, args.drain_timeout, config.listen.control_port).run()
    return 0


def uvicorn_config(gateway: Gateway, config: GatewayConfig) -> uvicorn.Config:
    """How the client side is served (``listen``).

    * kvgate's own HTTP/1.1 protocol (``HttpProtocol``): leaner than uvicorn's, with read deadlines for a
      request's head and body (slowloris).
    * ``keepalive_timeout_s``: a keep-alive connection idle for that long is closed (uvicorn's
      ``timeout_keep_alive``, which the protocol reads).
    * ``max_connections``: uvicorn's ``limit_concurrency``, applied by the protocol as uvicorn's own does.
      It still accepts every connection, but answers a request with ``503`` + ``Connection: close`` (not from
      the app; OpenAI-shaped, with ``Retry-After: 1``) while the open connections, counting
      the asking one, or the requests in progress, reach its limit: hence ``+ 1``, so exactly
      ``max_connections`` connections are served. Those 503s are counted (``kvgate_connections_refused_total``)
      and logged once a minute, not once each. Idle connections count: the head deadline and the keep-alive
      timeout are what bound how long a connection that sends nothing holds a place.
    * ``ws="none"``: kvgate has no websocket routes; the protocol serves an ``Upgrade`` request as plain HTTP
      by the normal routing (404 for unknown paths).
    """
    listen = config.listen
    return uvicorn.Config(
        gateway,
        host=listen.host,
        port=listen.port,
        loop="uvloop" if _has("uvloop") else "asyncio",
        http=configured_protocol(listen, gateway.metrics.connections_refused.inc),
        ws="none",
        limit_concurrency=listen.max_connections + 1,
        timeout_keep_alive=listen.keepalive_timeout_s,  # type: ignore[arg-type]  # typed int, used as a float
        lifespan="on",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=5,  # after the drain: what uvicorn still allows open connections
        proxy_headers=False,  # kvgate is the edge of the pod; X-Forwarded-* rewriting costs CPU per request
    )


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
