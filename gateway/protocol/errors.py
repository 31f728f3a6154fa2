"""OpenAI-shaped errors.

Every error a client sees is ``{"error": {"message", "type", "param", "code"}}`` with the right status. 429
and 503 carry ``Retry-After`` (whole seconds) and ``retry-after-ms``, which the OpenAI SDKs honour, so
clients back off by themselves instead of hammering the gateway.
"""

from __future__ import annotations

import math

import orjson


class GatewayError(Exception):
    """An error that ends a request with an OpenAI-shaped body; raised anywhere on the request path."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        extra: dict[str, object] | None = None,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.extra = extra or {}
        self.extra_headers = extra_headers or []

    def body(self) -> bytes:
        error: dict[str, object] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        error.update(self.extra)
        return orjson.dumps({"error": error})

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", b"application/json")]
        if self.retry_after_s is not None:
            headers.extend(retry_after_headers(self.retry_after_s))
        return headers + self.extra_headers


def retry_after_headers(seconds: float) -> list[tuple[bytes, bytes]]:
    """``Retry-After`` must be whole seconds (RFC 9110); ``retry-after-ms`` keeps the precision."""
    ms = max(1, math.ceil(seconds * 1000))
    return [
        (b"retry-after", str(max(1, math.ceil(seconds))).encode()),
        (b"retry-after-ms", str(ms).encode()),
    ]


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def context_length_exceeded(message: str) -> GatewayError:
    """OpenAI's code (what clients test for), vLLM's param (on every route, not only a chat's messages)."""
    return GatewayError(400, message, param="input_tokens", code="context_length_exceeded")


def request_too_large(tokens: int, tokens_per_minute: int) -> GatewayError:
    """A request whose tokens alone are more than its key may use in a minute: no retry can help (a 429 would be
    retried by the SDKs)."""
    return GatewayError(
        400,
        f"This request takes at least {tokens} tokens (its prompt and the output it must produce), more than the "
        f"{tokens_per_minute} tokens per minute this key may use: it can never be admitted. Send a shorter request.",
        code="request_too_large",
    )


def payload_too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"Request body exceeds the limit of {limit} bytes.", code="payload_too_large")


def queue_full(retry_after_s: float, extra: dict[str, object] | None = None) -> GatewayError:
    return GatewayError(
        429,
        "The gateway's admission queue is full; retry after the indicated time.",
        type="rate_limit_exceeded",
        code="queue_full",
        retry_after_s=retry_after_s,
        extra=extra,
    )


def queue_timeout(retry_after_s: float, waited_s: float, extra: dict[str, object] | None = None) -> GatewayError:
    return GatewayError(
        503,
        f"The request waited {waited_s:.1f}s for KV-cache capacity without being admitted; retry later.",
        type="service_unavailable",
        code="queue_timeout",
        retry_after_s=retry_after_s,
        extra=extra,
    )


def slot_timeout(tenant: str, limit: int, retry_after_s: float, waited_s: float, position: int) -> GatewayError:
    """The tenant's own ``max_concurrent`` requests were all running for the whole of this one's wait budget:
    its quota, as a rate limit is (429), not the engine's capacity."""
    return GatewayError(
        429,
        f"The request waited {waited_s:.1f}s for one of the {limit} concurrent request slot(s) of tenant "
        f"'{tenant}' without getting one; retry after the indicated time.",
        type="rate_limit_exceeded",
        code="tenant_concurrency_timeout",
        retry_after_s=retry_after_s,
        extra={"queue_position": position, "waiting_for": "concurrency_slot"},
    )


def answer_outlasts_timeout(tokens: int, answer_s: float, timeout_s: float) -> GatewayError:
    """An answer sent in one piece whose length is certain (``ignore_eos``, or ``min_tokens`` at its budget)
    and whose time, at the pace of the latest answers at least a quarter as long (their fastest quarter), is past
    the client's read timeout: it would time out
    however soon it were admitted, and the SDK would have it generated again on each retry. A 400, which no SDK
    retries."""
    return GatewayError(
        400,
        f"This answer's {tokens} tokens are expected to take {answer_s:.1f}s once the engine starts on it, longer "
        f"than the client's read timeout ({timeout_s:g}s): it would time out, and be generated again on every "
        "retry. Stream it (stream: true), raise the client's timeout, or lower max_tokens.",
        code="answer_outlasts_timeout",
        param="max_tokens",
        extra={"answer_eta_s": round(answer_s, 3)},
    )


def wait_predicted(retry_after_s: float, extra: dict[str, object] | None = None) -> GatewayError:
    """Refused early: at the rate requests are finishing, this one could not be admitted within its wait budget
    (the client's, its tenant's or the config's), so it is told now instead of at the end of that wait."""
    return GatewayError(
        503,
        "The admission queue ahead of this request will not drain within its wait budget; retry after the "
        "indicated time.",
        type="service_unavailable",
        code="queue_wait_predicted",
        retry_after_s=retry_after_s,
        extra=extra,
    )


def engine_busy(retry_after_s: float) -> GatewayError:
    return GatewayError(
        503,
        "The inference engine is busy and rejected the request; retry later.",
        type="service_unavailable",
        code="engine_busy",
        retry_after_s=retry_after_s,
    )


def upstream_unavailable(message: str, retry_after_s: float) -> GatewayError:
    return GatewayError(
        503, message, type="service_unavailable", code="upstream_unavailable", retry_after_s=retry_after_s
    )


def shutting_down(retry_after_s: float) -> GatewayError:
    return GatewayError(
        503,
        "The gateway is shutting down; retry on another replica.",
        type="service_unavailable",
        code="shutting_down",
        retry_after_s=retry_after_s,
    )
