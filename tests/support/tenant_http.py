"""POST with an API key, head and body in one write (so the request is whole when it reaches the server),
timing each response; for the tenant, priority and replica tests."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from tests.support.rawhttp import _dechunk


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    sent_at: float
    done_at: float
    tag: str = ""

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def queue_wait_s(self) -> float:
        return int(self.headers.get("x-kvgate-queue-wait-ms", "0")) / 1000


async def post(
    url: str, body: dict[str, object], key: str | None = None, tag: str = "", path: str = "/v1/completions"
) -> Reply:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    payload = orjson.dumps(body)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    sent = time.monotonic()
    writer.write(head + payload)
    await writer.drain()
    raw = await reader.read()
    done = time.monotonic()
    writer.close()
    head_raw, _, data = raw.partition(b"\r\n\r\n")
    lines = head_raw.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        data = _dechunk(data)
    return Reply(int(lines[0].split()[1]), headers, data, sent, done, tag)


def completion(prompt_chars: int, max_tokens: int, model: str = "mini") -> dict[str, object]:
    return {"model": model, "prompt": "w" * prompt_chars, "max_tokens": max_tokens}
