"""A tiny HTTP/1.1 client for bursts: connect every socket first, then write every request back to back, so
hundreds of requests really do arrive within a few milliseconds (an HTTP client library can't promise that)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import orjson


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    sent_at: float


async def burst(url: str, path: str, bodies: list[dict[str, object]]) -> tuple[list[RawResponse], float]:
    """POST every body at once; returns the responses and the spread of the send times in seconds."""
    parts = urlsplit(url)
    conns = [await asyncio.open_connection(parts.hostname, parts.port) for _ in bodies]
    sent: list[float] = []
    for (_, writer), body in zip(conns, bodies, strict=True):
        payload = orjson.dumps(body)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        ).encode()
        writer.write(head + payload)
        sent.append(time.monotonic())
    await asyncio.gather(*(w.drain() for _, w in conns))
    responses = await asyncio.gather(*(_read(r, w, t) for (r, w), t in zip(conns, sent, strict=True)))
    return list(responses), max(sent) - min(sent)


async def _read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sent_at: float) -> RawResponse:
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return RawResponse(status, headers, body, sent_at)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)
