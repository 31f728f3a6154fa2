"""A small vLLM-like HTTP server for the gateway's integration tests and the overhead benchmark.

Not the simulator (``kvgate sim``): no scheduler and no timing model. It does what the gateway's tests need
to observe exactly: every active request holds ``ceil((prompt + generated) / block_size)`` KV blocks, the
server records the peak it ever held (so a test can check *actual* usage, not a sampled one), and it records
when each client went away. Token counts use the gateway's heuristic tokenizer so both sides agree.

Run: python -m tests.support.mini_vllm --port 8000 [--num-blocks 256 --block-size 16 --token-delay-ms 5]
[--api-key KEY: as vLLM's flag, 401 on /v1/* without ``Authorization: Bearer KEY``]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from gateway.tokens.tokenizers import HeuristicTokenizer

_tok = HeuristicTokenizer(4.0)


@dataclass
class Active:
    prompt: int
    max_tokens: int
    generated: int = 0


@dataclass
class State:
    num_blocks: int
    block_size: int
    max_model_len: int
    token_delay_s: float
    busy_after: int | None
    model: str
    active: dict[int, Active] = field(default_factory=dict)
    next_id: int = 0
    peak_blocks: int = 0
    preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    completed: int = 0
    cancelled: list[float] = field(default_factory=list)
    started: list[float] = field(default_factory=list)
    busy_rejections: int = 0
    stream_interval: int = 1  # vLLM's --stream-interval
    eof_delay_s: float = 0.0  # between a stream's [DONE] and the end of its response
    seen: list[tuple[str, str, str]] = field(default_factory=list)  # (method, raw target, x-request-id), no /debug/
    priorities: dict[str, int] = field(default_factory=dict)  # x-request-id -> the priority vLLM would schedule by
    cache_salts: dict[str, str | None] = field(default_factory=dict)  # x-request-id -> the body's cache_salt
    process_started: float = field(default_factory=time.time)  # vLLM's process_start_time_seconds
    api_key: str | None = None  # vLLM's --api-key
    keyed: list[tuple[str, bool]] = field(default_factory=list)  # (path, carried the key), with an api key only

    def used_blocks(self) -> int:
        return sum(math.ceil((a.prompt + a.generated) / self.block_size) for a in self.active.values())

    def track(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self.used_blocks())


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:  # as vLLM renders a chat: with its tools, chat_template_kwargs and documents
        extra = dict(body.get("chat_template_kwargs") or {})
        if body.get("documents") is not None:
            extra["documents"] = body["documents"]
        return _tok.count_messages(body["messages"], body.get("tools"), extra=extra or None)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    return _tok.count(prompt if isinstance(prompt, str) else "".join(prompt))


def _priority(request: web.Request, body: dict[str, Any]) -> int:
    """As vLLM 0.32's ``_get_priority`` on chat and completions: the X-Vllm-Priority header when it is an
    integer, else the body's ``priority`` (0 by default)."""
    header = request.headers.get("x-vllm-priority")
    if header is not None:
        try:
            return int(header)
        except ValueError:
            pass
    return int(body.get("priority") or 0)


def _error(status: int, message: str, type_: str) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}}),
        content_type="application/json",
    )


async def generate(request: web.Request) -> web.StreamResponse:
    st: State = request.app["state"]
    body = orjson.loads(await request.read())
    chat = request.path.endswith("chat/completions")
    if body.get("model") not in (None, st.model):
        return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
    st.priorities[request.headers.get("x-request-id", "")] = _priority(request, body)
    st.cache_salts[request.headers.get("x-request-id", "")] = body.get("cache_salt")
    prompt = _prompt_tokens(body)
    truncate = body.get("truncate_prompt_tokens")
    if isinstance(truncate, int) and truncate >= -1:  # vLLM keeps that many (-1: the context less one)
        prompt = min(prompt, st.max_model_len - 1 if truncate == -1 else truncate)
    if prompt >= st.max_model_len:
        return _error(400, f"This model's maximum context length is {st.max_model_len} tokens.", "BadRequestError")
    # vLLM refuses a max_tokens larger than the context; one that only runs past it with the prompt is clamped
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    if asked is not None and asked > st.max_model_len:
        return _error(
            400, f"max_tokens={asked} cannot be greater than max_model_len={st.max_model_len}.", "BadRequestError"
        )
    max_tokens = st.max_model_len - prompt if asked is None else min(asked, st.max_model_len - prompt)
    stream = bool(body.get("stream"))
    if st.busy_after is not None and len(st.active) >= st.busy_after:
        st.busy_rejections += 1
        busy = {
            "error": {
                "message": "The engine is currently busy and cannot accept new requests.",
                "type": "Service Unavailable",
                "code": 503,
            }
        }
        if stream:  # vLLM's second form: HTTP 200 carrying one SSE error event
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: " + orjson.dumps(busy) + b"\n\n")
            await resp.write_eof()
            return resp
        return web.Response(status=503, body=orjson.dumps(busy), content_type="application/json")

    st.next_id += 1
    rid = st.next_id
    st.active[rid] = Active(prompt, max_tokens)
    st.started.append(time.monotonic())
    st.prompt_tokens_total += prompt
    st.track()
    obj = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    usage = {"prompt_tokens": prompt, "completion_tokens": max_tokens, "total_tokens": prompt + max_tokens}
    try:
        if not stream:
            for _ in range(max_tokens):
                await _step(st, rid)
            text = " tok" * max_tokens
            choice = {"index": 0, "finish_reason": "length"}
            choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            st.completed += 1
            payload = {
                "id": f"cmpl-{rid}",
                "object": "chat.completion" if chat else "text_completion",
                "model": st.model,
                "choices": [choice],
                "usage": usage,
            }
            return web.Response(body=orjson.dumps(payload), content_type="application/json")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)
        if chat:
            first = {
                "id": f"c-{rid}",
                "object": obj,
                "model": st.model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            }
            await resp.write(b"data: " + orjson.dumps(first) + b"\n\n")
        # as vLLM's output processor: the first token at once, then one event per stream_interval tokens (the
        # request's or the engine's, the larger), the last with what is left
        interval = max(int(body.get("stream_interval") or 1), st.stream_interval)
        pending = 0
        for i in range(max_tokens):
            await _step(st, rid)
            pending += 1
            last = i == max_tokens - 1
            if not (last or i == 0 or pending >= interval):
                continue
            text = " tok" * pending
            pending = 0
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": "length" if last else None}
            else:
                choice = {"index": 0, "text": text, "finish_reason": "length" if last else None}
            chunk = {"id": f"c-{rid}", "object": obj, "model": st.model, "choices": [choice]}
            if last and not include_usage:  # as vLLM 0.32: the fingerprint goes on the final message
                chunk["system_fingerprint"] = FINGERPRINT
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if include_usage:
            final = {"id": f"c-{rid}", "object": obj, "model": st.model, "choices": [], "usage": usage}
            await resp.write(b"data: " + orjson.dumps({**final, "system_fingerprint": FINGERPRINT}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        if st.eof_delay_s > 0:  # the response's end, after [DONE], arrives a moment later (a busy server)
            await asyncio.sleep(st.eof_delay_s)
        await resp.write_eof()
        st.completed += 1
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        st.cancelled.append(time.monotonic())
        raise
    finally:
        st.active.pop(rid, None)


async def _step(st: State, rid: int) -> None:
    if st.token_delay_s > 0:
        await asyncio.sleep(st.token_delay_s)
    st.active[rid].generated += 1
    st.generation_tokens_total += 1
    st.track()


async def metrics(request: web.Request) -> web.Response:
    st: State = request.app["state"]
    labels = f'engine="0",model_name="{st.model}"'
    usage = st.used_blocks() / st.num_blocks
    lines = [
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {st.process_started}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(len(st.active))}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} 0.0",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{labels}}} {float(st.preemptions)}",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{st.block_size}",engine="0",num_gpu_blocks="{st.num_blocks}"}} 1.0',
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{labels}}} {float(st.prompt_tokens_total)}",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{labels}}} {float(st.generation_tokens_total)}",
    ]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def models(request: web.Request) -> web.Response:
    st: State = request.app["state"]
    data = [
        {"id": st.model, "object": "model", "owned_by": "vllm", "root": st.model, "max_model_len": st.max_model_len}
    ]
    return web.json_response({"object": "list", "data": data}, headers={"x-upstream": "mini-vllm"})


# --tokenize-fault: how a broken /tokenize misbehaves (for the gateway's `vllm` counter). "hang" answers after
# 60 s, "garbage" is a 200 that is not JSON, "no-count" is JSON without "count", "500" an internal error and
# "close" drops the connection without an answer.
TOKENIZE_FAULTS = ("none", "hang", "garbage", "no-count", "500", "close")


async def _tokenize_fault(request: web.Request, fault: str) -> web.StreamResponse:
    await request.read()
    if fault == "hang":
        await asyncio.sleep(60)
    if fault == "garbage":
        return web.Response(text="<html>oops</html>", content_type="text/html")
    if fault == "no-count":
        return web.json_response({"tokens": [1, 2, 3]})
    if fault == "close":
        assert request.transport is not None
        request.transport.close()
        return web.Response()
    return web.Response(status=500, text="Internal Server Error")


async def tokenize(request: web.Request) -> web.StreamResponse:
    st: State = request.app["state"]
    fault = request.app.get("tokenize_fault", "none")
    if fault != "none":
        return await _tokenize_fault(request, fault)
    body = orjson.loads(await request.read())
    n = _prompt_tokens(body)
    return web.json_response({"count": n, "max_model_len": st.max_model_len, "tokens": list(range(n))})


async def stats(request: web.Request) -> web.Response:
    st: State = request.app["state"]
    return web.json_response(
        {
            "active": len(st.active),
            "used_blocks": st.used_blocks(),
            "peak_blocks": st.peak_blocks,
            "num_blocks": st.num_blocks,
            "completed": st.completed,
            "cancelled": st.cancelled,
            "started": st.started,
            "busy_rejections": st.busy_rejections,
            "now": time.monotonic(),
        }
    )


async def reset_peak(request: web.Request) -> web.Response:
    st: State = request.app["state"]
    st.peak_blocks = st.used_blocks()
    st.cancelled.clear()
    st.started.clear()
    return web.json_response({"ok": True})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


@web.middleware
async def record(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every request that reached the engine, with its target exactly as it arrived (what tests of the
    gateway's routing check)."""
    if not request.raw_path.startswith("/debug/"):
        request.app["state"].seen.append((request.method, request.raw_path, request.headers.get("x-request-id", "")))
    response: web.StreamResponse = await handler(request)
    return response


FINGERPRINT = "fp-mini"  # vLLM's system_fingerprint (--fingerprint-mode full by default)


# vLLM's AuthenticationMiddleware guards these prefixes only (/tokenize, /metrics, /health stay open).
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


@web.middleware
async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
    """vLLM's ``--api-key``: 401 ``{"error": "Unauthorized"}`` on a guarded path without the bearer key (OPTIONS
    passes). Whether each request carried the key is kept for ``/debug/keyed``."""
    st: State = request.app["state"]
    if st.api_key is None or request.path.startswith("/debug/"):
        response: web.StreamResponse = await handler(request)
        return response
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    ok = scheme.lower() == "bearer" and key == st.api_key
    st.keyed.append((request.path, ok))
    if not ok and request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIXES):
        return web.json_response({"error": "Unauthorized"}, status=401)
    response = await handler(request)
    return response


async def keyed(request: web.Request) -> web.Response:
    return web.json_response(request.app["state"].keyed)


async def seen(request: web.Request) -> web.Response:
    return web.json_response(request.app["state"].seen)


async def priorities(request: web.Request) -> web.Response:
    return web.json_response(request.app["state"].priorities)


async def cache_salts(request: web.Request) -> web.Response:
    return web.json_response(request.app["state"].cache_salts)


async def responses_or_messages(request: web.Request) -> web.Response:
    """``/v1/responses`` and ``/v1/messages``, not streamed, answered as vLLM answers them: their usage says
    ``input_tokens`` / ``output_tokens`` (OpenAI Responses and Anthropic shapes), not ``prompt_tokens``."""
    st: State = request.app["state"]
    body = orjson.loads(await request.read())
    if request.path == "/v1/messages":
        prompt = _prompt_tokens(body)
        output = int(body.get("max_tokens") or 16)
        text = " tok" * output
        payload: dict[str, Any] = {"id": "msg-1", "type": "message", "role": "assistant", "model": st.model}
        payload["content"] = [{"type": "text", "text": text}]
        payload["usage"] = {"input_tokens": prompt, "output_tokens": output}
    else:
        given = body.get("input", "")
        prompt = _tok.count(given) if isinstance(given, str) else _tok.count_messages(given)
        output = int(body.get("max_output_tokens") or 16)
        payload = {"id": "resp-1", "object": "response", "status": "completed", "model": st.model, "output": []}
        payload["usage"] = {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output}
    st.completed += 1
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


async def any_route(request: web.Request) -> web.Response:
    """Every other route vLLM has (admin, pooling, scoring...): answered 200, so only the gateway's routing
    decides what a client can reach."""
    await request.read()
    return web.json_response({"route": request.path, "usage": {"prompt_tokens": 1, "total_tokens": 1}})


def make_app(args: argparse.Namespace) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[authenticate, record])
    app["state"] = State(
        args.num_blocks, args.block_size, args.max_model_len, args.token_delay_ms / 1000, args.busy_after, args.model
    )
    app["state"].stream_interval = getattr(args, "stream_interval", 1)
    app["state"].eof_delay_s = getattr(args, "eof_delay_ms", 0.0) / 1000
    app["tokenize_fault"] = getattr(args, "tokenize_fault", "none")
    app["state"].api_key = getattr(args, "api_key", None)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/responses", responses_or_messages)
    app.router.add_post("/v1/messages", responses_or_messages)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/debug/stats", stats)
    app.router.add_post("/debug/reset", reset_peak)
    app.router.add_get("/debug/requests", seen)
    app.router.add_get("/debug/priorities", priorities)
    app.router.add_get("/debug/cache_salts", cache_salts)
    app.router.add_get("/debug/keyed", keyed)
    app.router.add_route("*", "/{tail:.*}", any_route)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--token-delay-ms", type=float, default=0.0)
    p.add_argument("--busy-after", type=int, default=None, help="reject like vLLM's --max-num-queued-reqs")
    p.add_argument("--model", default="mini")
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed event, as vLLM's flag")
    p.add_argument("--eof-delay-ms", type=float, default=0.0, help="end a stream's response this long after [DONE]")
    p.add_argument("--tokenize-fault", choices=TOKENIZE_FAULTS, default="none", help="break /tokenize this way")
    p.add_argument("--api-key", default=None, help="as vLLM's flag: 401 on /v1/* without this bearer key")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    # vLLM aborts a non-streaming request when its client goes away (with_cancellation); so do we.
    web.run_app(make_app(args), host=args.host, port=args.port, access_log=None, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
