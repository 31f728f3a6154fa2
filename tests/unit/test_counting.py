"""TokenCounter: what goes off the loop, token ids against the vocabulary, and a broken engine /tokenize."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import InferenceRequest, parse_request
from gateway.tokens.counting import TokenCounter
from gateway.tokens.tokenizers import HeuristicTokenizer, Message
from tests.support.procs import free_port


class SpyTokenizer(HeuristicTokenizer):
    """The heuristic, recording which thread counted and whether it was told it runs off the loop."""

    def __init__(self, vocab_size: int | None = None) -> None:
        super().__init__(4.0)
        self.vocab_size = vocab_size
        self.calls: list[tuple[str, bool]] = []

    def count_messages(
        self, messages: Sequence[Message], tools: Sequence[Any] | None = None, *, off_loop: bool = False
    ) -> int:
        self.calls.append((threading.current_thread().name, off_loop))
        return super().count_messages(messages, tools, off_loop=off_loop)


def chat(messages: list[dict[str, Any]], **extra: Any) -> InferenceRequest:
    return parse_request("chat", orjson.dumps({"messages": messages, **extra}))


def completion(prompt: object) -> InferenceRequest:
    return parse_request("completions", orjson.dumps({"prompt": prompt}))


BIG = "x" * 200  # past the counters' offload_chars=100 below


@pytest.mark.parametrize(
    "request_",
    [
        chat([{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"description": BIG}}]),
        chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": BIG}]}]),
        chat([{"role": "user", "content": ["a", BIG]}]),
        chat([{"role": "user", "content": "hi", "name": BIG}]),
        chat([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": BIG}}]}]),
        chat([{"role": "tool", "content": "ok", "tool_call_id": BIG}]),
        chat([{"role": "user", "content": "a" * 60}, {"role": "user", "content": "b" * 60}]),
    ],
    ids=["tools", "text-parts", "string-parts", "name", "tool-calls", "tool-call-id", "summed"],
)
async def test_every_tokenized_field_counts_toward_offloading(request_: InferenceRequest) -> None:
    tok = SpyTokenizer()
    await TokenCounter(tok, offload_chars=100).count(request_)
    assert tok.calls and tok.calls[0][0].startswith("kvgate-tokenize") and tok.calls[0][1] is True


async def test_small_chats_stay_on_the_loop() -> None:
    tok = SpyTokenizer()
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "bob"}]
    await TokenCounter(tok, offload_chars=100).count(chat(messages, tools=[{"type": "function"}]))
    assert tok.calls == [("MainThread", False)]


async def test_token_ids_past_a_known_vocabulary_are_400() -> None:
    counter = TokenCounter(SpyTokenizer(vocab_size=100))
    assert await counter.count(completion([0, 99])) == (2,)
    assert await counter.count(completion([[1], [2, 3]])) == (1, 2)
    for prompt, where in (([5, 100], "prompt"), ([[1], [2, 1000]], "prompt[1]")):
        with pytest.raises(GatewayError) as err:
            await counter.count(completion(prompt))
        assert (err.value.status, err.value.param) == (400, "prompt")
        assert "out of vocabulary" in err.value.message and where in err.value.message


async def test_token_ids_with_an_unknown_vocabulary_are_not_checked() -> None:
    assert await TokenCounter(HeuristicTokenizer()).count(completion([10**9])) == (1,)


# --- the engine's /tokenize -------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _hang(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(30)
    return web.json_response({"count": 1})


async def _garbage(request: web.Request) -> web.StreamResponse:
    return web.Response(text="<html>bad gateway</html>", content_type="text/html")


async def _no_count(request: web.Request) -> web.StreamResponse:
    return web.json_response({"tokens": [1, 2]})


async def _not_a_number(request: web.Request) -> web.StreamResponse:
    return web.json_response({"count": "many"})


async def _a_list(request: web.Request) -> web.StreamResponse:
    return web.json_response([1, 2, 3])


async def _error_500(request: web.Request) -> web.StreamResponse:
    return web.Response(status=500, text="Internal Server Error")


async def _close(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.close()
    return web.Response()


async def _client_error(request: web.Request) -> web.StreamResponse:
    return web.json_response({"error": {"message": "The model `nope` does not exist."}}, status=404)


async def _ok(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    return web.json_response({"count": len(body.get("prompt", "")) or 7})


@pytest.fixture
async def engine() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    """An in-process /tokenize that answers with the handler a test picks."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_post("/tokenize", handler)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def _remote_count(url: str, request: InferenceRequest, timeout_s: float = 0.5) -> tuple[int, ...]:
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(None, session=session, upstream=url, tokenize_timeout_s=timeout_s)
        return await counter.count(request)


@pytest.mark.parametrize(
    ("handler", "status", "type_"),
    [
        (_garbage, 502, "upstream_error"),
        (_no_count, 502, "upstream_error"),
        (_not_a_number, 502, "upstream_error"),
        (_a_list, 502, "upstream_error"),
        (_error_500, 502, "upstream_error"),
        (_close, 502, "upstream_error"),
        (_hang, 503, "service_unavailable"),
    ],
    ids=["not-json", "no-count", "count-not-a-number", "json-list", "http-500", "connection-closed", "hangs"],
)
async def test_a_broken_tokenize_is_a_502_or_503(
    engine: Callable[[Handler], Awaitable[str]], handler: Handler, status: int, type_: str
) -> None:
    url = await engine(handler)
    t0 = time.monotonic()
    with pytest.raises(GatewayError) as err:
        await _remote_count(url, completion("hello"))
    assert time.monotonic() - t0 < 3  # the short timeout, not aiohttp's 300 s default
    assert (err.value.status, err.value.type) == (status, type_)
    assert (err.value.retry_after_s is not None) == (status == 503)
    assert set(orjson.loads(err.value.body())["error"]) >= {"message", "type", "param", "code"}


async def test_an_unreachable_tokenize_is_a_503_with_retry_after() -> None:
    with pytest.raises(GatewayError) as err:
        await _remote_count(f"http://127.0.0.1:{free_port()}", chat([{"role": "user", "content": "hi"}]))
    assert (err.value.status, err.value.type, err.value.code) == (503, "service_unavailable", "upstream_unavailable")
    assert err.value.retry_after_s is not None and (b"retry-after", b"1") in err.value.headers()


async def test_engine_4xx_stays_the_clients_error(engine: Callable[[Handler], Awaitable[str]]) -> None:
    url = await engine(_client_error)
    with pytest.raises(GatewayError) as err:
        await _remote_count(url, completion("hello"))
    assert (err.value.status, err.value.type) == (404, "invalid_request_error")
    assert "does not exist" in err.value.message


async def test_a_working_tokenize_counts(engine: Callable[[Handler], Awaitable[str]]) -> None:
    url = await engine(_ok)
    assert await _remote_count(url, completion(["ab", "cde"])) == (2, 3)
    assert await _remote_count(url, chat([{"role": "user", "content": "hi"}])) == (7,)


def test_the_default_tokenize_timeout_is_short() -> None:
    counter = TokenCounter(None, session=object(), upstream="http://x")  # type: ignore[arg-type]
    assert counter._timeout.total == 5.0
