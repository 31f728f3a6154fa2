"""What a client's headers say about waiting: how long it will wait, and whether it is retrying.

The OpenAI SDKs send their read timeout (``x-stainless-read-timeout``) and their attempt number
(``x-stainless-retry-count``) with every request; kvgate's own ``x-kvgate-max-wait-s`` says the budget for
clients that are not SDKs. A budget lets kvgate refuse at once what it could not admit in time; a retry queues
ahead of its tenant's first attempts (see :mod:`gateway.admission.queue`).
"""

from __future__ import annotations

from dataclasses import dataclass

# A client's own wait budget: kvgate's header, or the read timeout the OpenAI SDKs send with every request.
WAIT_HEADERS = (b"x-kvgate-max-wait-s", b"x-stainless-read-timeout")
RETRY_HEADER = b"x-stainless-retry-count"  # the OpenAI SDKs' attempt number: 1 and up on a retry
CLIENT_MARGIN_S = 1.0  # answered this long before the client's own timeout would fire


@dataclass(frozen=True, slots=True)
class ClientHints:
    """What the client's headers say about waiting: its budget in seconds (None: it did not say), whether
    this is a retry of a request that was refused, and whether the budget is a read timeout (the SDKs'), which
    an answer sent in one piece must arrive within, not only be admitted within."""

    wait_s: float | None = None
    retry: bool = False
    read_timeout: bool = False


NO_HINTS = ClientHints()  # what most requests say: one shared instance, not one each


def client_hints(headers: list[tuple[bytes, bytes]]) -> ClientHints:
    """One pass over the headers (ASGI servers hand their names over lower-cased); kvgate's own wait header
    wins over the SDK's read timeout."""
    found: dict[bytes, bytes] = {}
    for key, value in headers:
        if key in WAIT_HEADERS or key == RETRY_HEADER:
            found[key] = value
    retry = found.get(RETRY_HEADER, b"0").strip() not in (b"0", b"")
    for name in WAIT_HEADERS:
        raw = found.get(name)
        if raw is None:
            continue
        try:
            seconds = float(raw)
        except ValueError:
            continue
        if seconds > 0 and seconds != float("inf"):
            if name == b"x-stainless-read-timeout":
                return ClientHints(max(0.1, seconds - CLIENT_MARGIN_S), retry, read_timeout=True)
            return ClientHints(seconds, retry)
    return ClientHints(None, retry) if retry else NO_HINTS
