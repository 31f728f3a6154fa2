"""The floor of a Python proxy: kvgate's own HTTP server protocol and upstream client, with no gateway in between.

A reference arm for ``bench_routers`` (``python-floor``), not a product: it relays each request to one upstream
and the answer back (json read whole, streams chunk by chunk), with none of kvgate's routing, auth, token
counting, admission, rate limits or metrics. What it costs per request is what any gateway built from these
parts on CPython, uvicorn's server loop and uvloop pays before it decides anything; kvgate's figure minus this
one is the price of its decisions.

    python3 -m loadtests.bare_relay --upstream http://127.0.0.1:8000 --port 9000
"""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn

from gateway.config import ListenConfig
from gateway.server.http_server import configured_protocol
from gateway.server.request_path import read_body
from gateway.upstream.forwarder import relayed_headers
from gateway.upstream.http_client import Pool

_FORWARDED = frozenset({b"content-type", b"authorization", b"accept"})


def relay_app(upstream: str) -> Any:
    pool = Pool(upstream, connect_timeout_s=5.0)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive, 1 << 30)
        headers = [(name, value) for name, value in scope["headers"] if name in _FORWARDED]
        target = scope["raw_path"].decode("latin-1")
        if scope["query_string"]:
            target += "?" + scope["query_string"].decode("latin-1")
        async with await pool.request(scope["method"], target, headers, body, 60.0) as resp:
            relayed = relayed_headers(resp.headers)
            if resp.media_type == "text/event-stream":
                await send({"type": "http.response.start", "status": resp.status, "headers": relayed})
                while (chunk := await resp.next_chunk()) is not None:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                return
            payload = await resp.read()
            relayed.append((b"content-length", b"%d" % len(payload)))
            await send({"type": "http.response.start", "status": resp.status, "headers": relayed})
            await send({"type": "http.response.body", "body": payload})

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    uvicorn.run(
        relay_app(args.upstream),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http=configured_protocol(ListenConfig()),
        lifespan="off",
        access_log=False,
        log_level="warning",
        proxy_headers=False,
    )


if __name__ == "__main__":
    main()
