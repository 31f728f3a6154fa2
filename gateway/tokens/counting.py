"""Counting prompt tokens for a parsed request, without stalling the event loop.

Token-id prompts are counted exactly for free. Text goes to the configured tokenizer: a local one runs
inline for short prompts and on a worker thread for long ones (the tokenizers and tiktoken libraries
release the GIL while they encode); ``vllm`` asks the engine's ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import InferenceRequest
from gateway.tokens.tokenizers import (
    HeuristicTokenizer,
    LocalTokenizer,
    TokenizerUnavailable,
    load_tokenizer,
    message_text,
)

log = logging.getLogger("kvgate.counting")

_JSON = {"content-type": "application/json"}  # vLLM answers 415 to anything else


class TokenCounter:
    """Counts a request's prompt tokens with a local tokenizer, or remotely with the engine's /tokenize."""

    def __init__(
        self,
        local: LocalTokenizer | None,
        *,
        session: aiohttp.ClientSession | None = None,
        upstream: str | None = None,
        offload_chars: int = 4096,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        if local is None and (session is None or upstream is None):
            raise ValueError("a remote counter needs a session and an upstream URL")
        self.local = local
        self._session = session
        self._upstream = (upstream or "").rstrip("/")
        self._offload_chars = offload_chars
        self._executor = executor or ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvgate-tokenize")
        self.name = local.name if local else "vllm"
        self.exact = local.exact if local else True

    async def count(self, request: InferenceRequest) -> tuple[int, ...]:
        """Prompt tokens per prompt (one entry for chat)."""
        if request.endpoint == "completions" and all(isinstance(p, list) for p in request.prompts):
            return tuple(len(p) for p in request.prompts)
        if self.local is None:
            return await self._count_remote(request)
        size = _text_size(request)
        if size <= self._offload_chars:
            return _count_local(self.local, request)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, _count_local, self.local, request)

    async def _count_remote(self, request: InferenceRequest) -> tuple[int, ...]:
        assert self._session is not None
        counts = []
        payloads: list[dict[str, Any]]
        if request.endpoint == "chat":
            payloads = [{"messages": request.messages, "add_generation_prompt": True}]
            if request.tools:
                payloads[0]["tools"] = request.tools
        else:
            payloads = [{"prompt": p} for p in request.prompts]
        for payload in payloads:
            if request.model:
                payload["model"] = request.model
            async with self._session.post(
                f"{self._upstream}/tokenize", data=orjson.dumps(payload), headers=_JSON
            ) as resp:
                body = await resp.read()
                if resp.status != 200:
                    # The engine's own validation errors (unknown model, bad messages) go back as they are.
                    raise GatewayError(
                        resp.status if resp.status < 500 else 502,
                        f"The engine could not tokenize the request: {body[:500].decode(errors='replace')}",
                        type="invalid_request_error" if resp.status < 500 else "upstream_error",
                        code="tokenize_failed",
                    )
                counts.append(int(orjson.loads(body)["count"]))
        return tuple(counts)


def _text_size(request: InferenceRequest) -> int:
    if request.messages is not None:
        return sum(len(message_text(m)) for m in request.messages)
    return sum(len(p) for p in request.prompts if isinstance(p, str))


def _count_local(tokenizer: LocalTokenizer, request: InferenceRequest) -> tuple[int, ...]:
    if request.messages is not None:
        return (tokenizer.count_messages(request.messages, request.tools),)
    return tuple(len(p) if isinstance(p, list) else tokenizer.count(p) for p in request.prompts)


async def build_counter(
    spec: str,
    *,
    session: aiohttp.ClientSession,
    upstream: str,
    model_root: str | None,
    offload_chars: int,
) -> TokenCounter:
    """Resolve a tokenizer spec; ``auto`` tries, in order: the served model's own directory (when the engine
    reports a local path in /v1/models, as a sidecar sharing the model volume sees), the engine's /tokenize,
    then the heuristic. The choice is logged, because it decides how exact admission is."""

    def make(local: LocalTokenizer | None) -> TokenCounter:
        return TokenCounter(local, session=session, upstream=upstream, offload_chars=offload_chars)

    if spec == "vllm":
        return make(None)
    if spec != "auto":
        return make(load_tokenizer(spec))
    if model_root and (Path(model_root) / "tokenizer.json").is_file():
        try:
            counter = make(load_tokenizer(f"hf:{model_root}"))
            log.info("tokenizer auto: using the served model's tokenizer at %s (exact)", model_root)
            return counter
        except TokenizerUnavailable as exc:
            log.warning("tokenizer auto: %s", exc)
    if await _tokenize_endpoint_works(session, upstream):
        log.info("tokenizer auto: using the engine's /tokenize at %s (exact, one extra round trip)", upstream)
        return make(None)
    log.warning(
        "tokenizer auto: no local tokenizer and no /tokenize on the upstream; using the ~4 chars/token "
        "heuristic (inexact). Pass --tokenizer hf:/path/to/model for exact admission."
    )
    return make(HeuristicTokenizer())


async def _tokenize_endpoint_works(session: aiohttp.ClientSession, upstream: str) -> bool:
    try:
        async with session.post(
            f"{upstream.rstrip('/')}/tokenize",
            data=orjson.dumps({"prompt": "hello"}),
            headers=_JSON,
            timeout=aiohttp.ClientTimeout(total=5),
        ) as resp:
            return resp.status == 200 and "count" in orjson.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False
