"""Counting prompt tokens for a parsed request, without stalling the event loop.

Token-id prompts are counted exactly for free (and checked against the vocabulary when the tokenizer is the
served model's). Text goes to the configured tokenizer: a local one runs inline for short prompts and, past
``offload_chars`` of tokenized text, on a small pool of worker threads with ``off_loop=True``, so that it
releases the GIL while it encodes (see :mod:`gateway.tokens.tokenizers`: a worker thread that holds the GIL
stalls the loop as surely as the loop itself). ``vllm`` asks the engine's ``/tokenize``, with a short timeout:
an engine that cannot tokenize is a 502/503 for the client, never a 500 or a request hung for minutes. Its
counts of whole requests are cached (:mod:`gateway.tokens.count_cache`: why only whole requests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import orjson

from gateway.protocol.errors import GatewayError, bad_request, upstream_unavailable
from gateway.protocol.requests import InferenceRequest, Prompt
from gateway.tokens.count_cache import CountCache
from gateway.tokens.tokenizers import LocalTokenizer

log = logging.getLogger("kvgate.counting")

_JSON = {"content-type": "application/json"}  # vLLM answers 415 to anything else
TOKENIZE_TIMEOUT_S = 5.0
TOKENIZE_RETRY_AFTER_S = 1.0


def engine_headers(api_key: str | None) -> dict[str, str]:
    """What kvgate's own calls to the engine send: the engine's key (``upstream.api_key``) when it has one,
    since an engine run with ``--api-key`` answers 401 to calls without it."""
    return {"authorization": f"Bearer {api_key}"} if api_key is not None else {}


class TokenCounter:
    """Counts a request's prompt tokens with a local tokenizer, or remotely with the engine's /tokenize.

    ``workers`` bounds the threads that tokenize long prompts at once (they use a core each while the loop
    keeps serving); ``tokenize_timeout_s`` bounds one /tokenize call, connect and answer together; ``cache``
    keeps /tokenize counts of whole requests (one that outlives this counter keeps its hit/miss totals);
    ``api_key`` is the engine's, sent with each /tokenize call. ``kind`` (hf, tiktoken, heuristic, vllm) and
    ``source`` (where the tokenizer came from) label ``kvgate_tokenizer_info``."""

    def __init__(
        self,
        local: LocalTokenizer | None,
        *,
        session: aiohttp.ClientSession | None = None,
        upstream: str | Callable[[], str] | None = None,
        api_key: str | None = None,
        offload_chars: int = 4096,
        executor: ThreadPoolExecutor | None = None,
        workers: int = 2,
        tokenize_timeout_s: float = TOKENIZE_TIMEOUT_S,
        cache: CountCache | None = None,
        source: str = "config",
    ) -> None:
        if local is None and (session is None or upstream is None):
            raise ValueError("a remote counter needs a session and an upstream URL")
        self.local = local
        self._session = session
        # where /tokenize is: one engine, or whichever engine of a pool takes requests at each call (they come
        # and go: a URL fixed at start-up may be an engine since gone, or none at all)
        self._upstream: Callable[[], str] = upstream if callable(upstream) else (lambda: upstream or "")
        self._headers = {**_JSON, **engine_headers(api_key)}
        self._offload_chars = offload_chars
        self._executor = executor or ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvgate-tokenize")
        self._timeout_s = tokenize_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=tokenize_timeout_s)
        self.name = local.name if local else "vllm"
        self.exact = local.exact if local else True
        self.kind = local.name.partition(":")[0] if local else "vllm"
        self.source = source
        self.cache = cache if cache is not None else CountCache()

    async def count(self, request: InferenceRequest) -> tuple[int, ...]:
        """Prompt tokens per prompt (one entry for chat)."""
        if request.endpoint == "completions" and all(isinstance(p, list) for p in request.prompts):
            if self.local is not None and self.local.vocab_size is not None:
                _check_vocabulary(request.prompts, self.local.vocab_size)
            return tuple(len(p) for p in request.prompts)
        if self.local is None:
            return await self._count_remote(request)
        if not _text_exceeds(request, self._offload_chars):
            return _count_local(self.local, request, False)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, _count_local, self.local, request, True)

    async def _count_remote(self, request: InferenceRequest) -> tuple[int, ...]:
        payloads: list[dict[str, Any]]
        if request.endpoint == "chat":
            messages = [_as_chat_parts(m) for m in request.messages or []]
            payloads = [{"messages": messages, "add_generation_prompt": True}]
            if request.add_special_tokens is not None:
                payloads[0]["add_special_tokens"] = request.add_special_tokens
            if request.tools:
                payloads[0]["tools"] = request.tools
            if request.template_kwargs:  # vLLM's /tokenize has no documents field: its template reads them here
                payloads[0]["chat_template_kwargs"] = request.template_kwargs
        else:
            special = {} if request.add_special_tokens is None else {"add_special_tokens": request.add_special_tokens}
            payloads = [{"prompt": p, **special} for p in request.prompts]
        counts = []
        for payload in payloads:
            if request.model:
                payload["model"] = request.model
            counts.append(await self._tokenize(payload))
        return tuple(counts)

    async def _tokenize(self, payload: dict[str, Any]) -> int:
        """One /tokenize call, unless the same body was counted before. Unreachable or silent: 503 with a
        retry hint; a 5xx or an answer without a count: 502; a 4xx is the engine judging the client's request
        (unknown model, bad messages): as is. Only good counts are cached."""
        body = orjson.dumps(payload)
        key = self.cache.key(body)
        count = self.cache.get(key)
        if count is None:
            count = await self._post_tokenize(body)
            self.cache.put(key, count)
        return count

    async def _post_tokenize(self, payload: bytes) -> int:
        assert self._session is not None
        url = f"{self._upstream().rstrip('/')}/tokenize"
        try:
            async with self._session.post(url, data=payload, headers=self._headers, timeout=self._timeout) as resp:
                status, body = resp.status, await resp.read()
        except TimeoutError:
            log.warning("/tokenize at %s: no answer within %gs", url, self._timeout_s)
            raise upstream_unavailable(
                f"The engine's /tokenize did not answer within {self._timeout_s:g}s; retry later.",
                TOKENIZE_RETRY_AFTER_S,
            ) from None
        except aiohttp.ClientConnectorError as exc:
            log.warning("/tokenize at %s: %s", url, exc)  # the address is for the log, not for the client
            raise upstream_unavailable(
                "The engine's /tokenize is unreachable; retry later.", TOKENIZE_RETRY_AFTER_S
            ) from None
        except aiohttp.ClientError as exc:
            log.warning("/tokenize at %s: %s: %s", url, type(exc).__name__, exc)
            raise _bad_tokenize_answer(f"the connection failed before a whole answer ({type(exc).__name__})") from None
        text = body[:500].decode(errors="replace")
        if 400 <= status < 500:
            raise GatewayError(status, f"The engine could not tokenize the request: {text}", code="tokenize_failed")
        if status != 200:
            raise _bad_tokenize_answer(f"HTTP {status}: {text}")
        try:
            count = orjson.loads(body)["count"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise _bad_tokenize_answer(f"no 'count' in its answer: {text}") from None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise _bad_tokenize_answer(f"'count' is not a token count: {count!r}")
        return count


def _bad_tokenize_answer(detail: str) -> GatewayError:
    return GatewayError(
        502, f"The engine's /tokenize gave no usable answer: {detail}", type="upstream_error", code="tokenize_failed"
    )


def _check_vocabulary(prompts: Sequence[Prompt], vocab_size: int) -> None:
    """vLLM refuses ids past its vocabulary with a 400; refusing them here spares them a wait in the queue.
    (Negative ids were refused when the request was parsed.)"""
    for j, prompt in enumerate(prompts):
        highest = max(prompt, default=0) if isinstance(prompt, list) else 0
        if highest >= vocab_size:
            where = "prompt" if len(prompts) == 1 else f"prompt[{j}]"
            raise bad_request(
                f"Token id {highest} in {where} is out of vocabulary (the model has {vocab_size} token ids).",
                param="prompt",
            )


def _text_exceeds(request: InferenceRequest, limit: int) -> bool:
    """Whether the text to tokenize is longer than ``limit`` characters, counting every string the tokenizer
    sees: message content and its parts, names, tool calls and any other message field a chat template may
    render, and the tools. Stops as soon as the limit is passed."""
    if request.messages is None:
        return sum(len(p) for p in request.prompts if isinstance(p, str)) > limit
    size = 0
    stack: list[Any] = [request.messages, request.tools, request.template_kwargs]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item)
            if size > limit:
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _count_local(tokenizer: LocalTokenizer, request: InferenceRequest, off_loop: bool) -> tuple[int, ...]:
    if request.messages is not None:
        special = request.add_special_tokens is True  # a chat's default: none added to the rendered template
        return (
            tokenizer.count_messages(
                request.messages,
                request.tools,
                off_loop=off_loop,
                extra=request.template_kwargs,
                add_special_tokens=special,
            ),
        )
    special = request.add_special_tokens is not False  # a completion's default: added
    return tuple(
        len(p) if isinstance(p, list) else tokenizer.count(p, off_loop=off_loop, add_special_tokens=special)
        for p in request.prompts
    )


_CHAT_TEXT_PARTS = frozenset({"input_text", "output_text"})


def _as_chat_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A message for the engine's /tokenize, which takes chat completions' messages alone: the Responses API's
    ``input_text`` / ``output_text`` parts (kvgate keeps them as sent, as vLLM's renderer reads them) become
    ``text`` parts."""
    content = message.get("content")
    if not isinstance(content, list) or not any(
        isinstance(part, dict) and part.get("type") in _CHAT_TEXT_PARTS for part in content
    ):
        return message
    parts = [
        {"type": "text", "text": part.get("text")}
        if isinstance(part, dict) and part.get("type") in _CHAT_TEXT_PARTS
        else part
        for part in content
    ]
    return {**message, "content": parts}
