"""TokenCounter: what goes off the loop, token ids against the vocabulary, and a broken engine /tokenize."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import InferenceRequest, parse_request
from gateway.tokens.count_cache import CountCache
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
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        *,
        off_loop: bool = False,
        extra: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> int:
        self.calls.append((threading.current_thread().name, off_loop))
        return super().count_messages(messages, tools, off_loop=off_loop, extra=extra)


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
        chat([{"role": "user", "content": "hi"}], documents=[{"title": "t", "text": BIG}]),
        chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"context": BIG}),
    ],
    ids=["tools", "text-parts", "string-parts", "name", "tool-calls", "tool-call-id", "summed", "documents", "kwargs"],
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


# --- the whole-request cache of /tokenize counts ---------------------------------------------------------


class CountingEngine:
    """A /tokenize that answers len(body) and records every body it was asked to count."""

    def __init__(self, fail_first: int = 0) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail_first = fail_first

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        if len(self.bodies) <= self.fail_first:
            return web.Response(status=500, text="Internal Server Error")
        return web.json_response({"count": len(await request.read())})


async def test_a_repeated_request_is_counted_once(engine: Callable[[Handler], Awaitable[str]]) -> None:
    fake = CountingEngine()
    url = await engine(fake.handle)
    turn1 = [{"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": 1, "b": 2}}}]
    reordered = [{"type": "function", "function": {"name": "f", "parameters": {"b": 2, "a": 1}}}]
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(None, session=session, upstream=url)
        first = await counter.count(chat(turn1, model="m"))
        assert await counter.count(chat(turn1, model="m")) == first and len(fake.bodies) == 1  # hit: no round trip
        assert (counter.cache.hits, counter.cache.misses) == (1, 1)
        # anything the engine's count depends on is a different request: a miss, and a round trip
        distinct = [
            chat(turn1, model="other"),
            chat(turn2, model="m"),  # the conversation grew: its prefix's count is not reused
            chat(turn1, model="m", tools=tools),
            chat(turn1, model="m", tools=reordered),  # key order reaches a tojson-rendered template
            completion("hi"),
        ]
        for request in distinct:
            await counter.count(request)
        assert len(fake.bodies) == 1 + len(distinct) and counter.cache.misses == 1 + len(distinct)
        assert await counter.count(chat(turn2, model="m")) == (len(orjson.dumps(fake.bodies[2])),)
        assert await counter.count(completion(["hi", "there"])) == (len(b'{"prompt":"hi"}'), len(b'{"prompt":"there"}'))
        assert len(fake.bodies) == 1 + len(distinct) + 1  # only "there" was new
        assert counter.cache.hits == 3


async def test_failed_counts_are_not_cached(engine: Callable[[Handler], Awaitable[str]]) -> None:
    fake = CountingEngine(fail_first=1)
    url = await engine(fake.handle)
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(None, session=session, upstream=url)
        with pytest.raises(GatewayError):
            await counter.count(completion("hello"))
        assert await counter.count(completion("hello")) == (len(b'{"prompt":"hello"}'),)
        assert len(fake.bodies) == 2 and len(counter.cache) == 1


def test_the_cache_is_a_bounded_lru_of_digests() -> None:
    cache = CountCache(max_entries=2, max_bytes=1 << 20)
    a, b, c = (CountCache.key(orjson.dumps({"prompt": p})) for p in ("secret a", "b", "c"))
    assert len(a) == 32 and b"secret" not in a  # a digest, never the text
    cache.put(a, 1)
    cache.put(b, 2)
    assert cache.get(a) == 1  # a is now the most recently used
    cache.put(c, 3)
    assert (cache.get(b), cache.get(a), cache.get(c)) == (None, 1, 3) and len(cache) == 2
    by_bytes = CountCache(max_entries=100, max_bytes=2 * 32)
    for i, key in enumerate((a, b, c)):
        by_bytes.put(key, i)
    assert len(by_bytes) == 2 and by_bytes.key_bytes == 64 and by_bytes.get(a) is None
    by_bytes.clear()
    assert (len(by_bytes), by_bytes.key_bytes, by_bytes.misses) == (0, 0, 1)  # totals survive a clear


async def test_tokenize_carries_the_engines_api_key(engine: Callable[[Handler], Awaitable[str]]) -> None:
    """kvgate's own /tokenize calls send the engine's key (``upstream.api_key``), as its forwarded requests do."""
    seen: list[str | None] = []

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("authorization"))
        return web.json_response({"count": 3})

    url = await engine(record)
    async with aiohttp.ClientSession() as session:
        keyed = TokenCounter(None, session=session, upstream=url, api_key="engine-secret")
        assert await keyed.count(completion("hello")) == (3,)
        assert await TokenCounter(None, session=session, upstream=url).count(completion("other")) == (3,)
    assert seen == ["Bearer engine-secret", None]


async def test_documents_and_template_kwargs_go_to_tokenize_as_the_template_sees_them(
    engine: Callable[[Handler], Awaitable[str]],
) -> None:
    """vLLM's /tokenize has no ``documents`` field, but hands its ``chat_template_kwargs`` to the template, as the
    chat route does with both: the documents go there, so the count is the prompt the chat will have."""
    fake = CountingEngine()
    url = await engine(fake.handle)
    docs = [{"title": "manual", "text": "a long document " * 50}]
    request = chat([{"role": "user", "content": "hi"}], documents=docs, chat_template_kwargs={"enable_thinking": False})
    await _remote_count(url, request)
    assert fake.bodies[-1]["chat_template_kwargs"] == {"enable_thinking": False, "documents": docs}
    await _remote_count(url, chat([{"role": "user", "content": "hi"}]))
    assert "chat_template_kwargs" not in fake.bodies[-1]
