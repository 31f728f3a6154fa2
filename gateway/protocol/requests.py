"""Parsing: turn a request body into the few fields admission needs, or a 400 that says what is wrong.

The body itself is forwarded unchanged; we read it, never rewrite it. Checks stop at what the gateway relies
on (prompt, messages, n/best_of, max_tokens, stream); everything else is the engine's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.protocol.errors import bad_request

Endpoint = Literal["chat", "completions"]
Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    endpoint: Endpoint
    model: str | None
    sequences_per_prompt: int
    max_tokens: int | None
    messages: list[dict[str, Any]] | None
    prompts: list[Prompt]
    tools: list[Any] | None


def parse_request(endpoint: Endpoint, raw: bytes) -> InferenceRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")

    model = _optional(body, "model", str)
    _optional(body, "stream", bool)
    stream_options = _optional(body, "stream_options", dict) or {}
    for key in ("include_usage", "continuous_usage_stats"):
        _optional(stream_options, key, bool, f"stream_options.{key}")
    n = _positive_int(body, "n") or 1
    best_of = _positive_int(body, "best_of")
    if best_of is not None and best_of < n:
        raise bad_request("best_of must be greater than or equal to n.", param="best_of")
    max_tokens = _positive_int(body, "max_tokens")
    if endpoint == "chat":
        max_tokens = _positive_int(body, "max_completion_tokens") or max_tokens

    messages: list[dict[str, Any]] | None = None
    prompts: list[Prompt] = []
    tools = _optional(body, "tools", list)
    if endpoint == "chat":
        messages = _messages(body)
    else:
        prompts = _prompts(body)
    return InferenceRequest(
        endpoint=endpoint,
        model=model,
        sequences_per_prompt=max(n, best_of or 1),
        max_tokens=max_tokens,
        messages=messages,
        prompts=prompts,
        tools=tools,
    )


def _optional(body: dict[str, Any], key: str, kind: type, param: str | None = None) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise bad_request(f"'{param or key}' must be of type {kind.__name__}.", param=param or key)
    return value


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = _optional(body, key, int)
    if value is not None and value < 1:
        raise bad_request(f"'{key}' must be at least 1, got {value}.", param=key)
    return value  # type: ignore[no-any-return]


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'.", param=f"messages[{i}]")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad_request(f"messages[{i}].content must be a string or an array.", param=f"messages[{i}]")
    return messages


def _prompts(body: dict[str, Any]) -> list[Prompt]:
    """A completions prompt: a string, token ids, or a batch of either (each one is its own request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return list(prompt)
    raise bad_request(
        "'prompt' must be a string, an array of strings, an array of token ids, or an array of those.",
        param="prompt",
    )
