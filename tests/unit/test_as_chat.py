"""Responses and Anthropic bodies become the chat messages vLLM 0.32 builds from them (its
``construct_input_messages`` and ``AnthropicServingMessages.to_chat_completion_request``), so that what kvgate
counts is what the engine's template renders: images stay images, tool calls become ``tool_calls``."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest

from gateway.protocol.bodies import parse_body
from gateway.protocol.errors import GatewayError
from gateway.tokens.prompt_estimate import prompt_sizes
from gateway.tokens.tokenizers import HeuristicTokenizer

PNG = base64.b64encode(bytes(range(256)) * 1500).decode()  # 384 KB of base64: ~96k "tokens" read as text
IMAGE_URL = f"data:image/png;base64,{PNG}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def parsed(kind: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Any] | None]:
    request = parse_body(kind, orjson.dumps(body))  # type: ignore[arg-type]
    assert request.messages is not None
    return request.messages, request.tools


def test_anthropic_blocks_become_what_vllm_renders() -> None:
    body = {
        "model": "m",
        "max_tokens": 64,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; hash=abc"},
            {"type": "text", "text": "Be brief."},
            {"type": "text", "text": " Use tools."},
        ],
        "tools": [{"name": "look", "description": "looks", "input_schema": {"type": "object"}}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Let me look.", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "look", "input": {"zoom": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [
                            {"type": "text", "text": "a cat"},
                            {"type": "image", "source": {"type": "url", "url": "https://x/cat.png"}},
                        ],
                    }
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
        ],
    }
    messages, tools = parsed("messages", body)
    assert messages == [
        {"role": "system", "content": "Be brief. Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(IMAGE_URL)]},
        {
            "role": "assistant",
            "reasoning": "Let me look.",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "look", "arguments": '{"zoom": 2}'}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "a cat"},
        {"role": "user", "content": [image_part("https://x/cat.png")]},
        {"role": "user", "content": "Thanks."},  # the tool result's own user message had nothing else: dropped
    ]
    assert tools == [
        {"type": "function", "function": {"name": "look", "description": "looks", "parameters": {"type": "object"}}}
    ]


def test_responses_items_become_what_vllm_renders() -> None:
    image = {"type": "input_image", "image_url": IMAGE_URL}
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "tools": [{"type": "function", "name": "look", "parameters": {}}, {"type": "web_search"}],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, image]},
            {"type": "reasoning", "id": "r", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
            {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "look", "arguments": '{"z": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "a cat"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A cat."}]},
        ],
    }
    messages, tools = parsed("responses", body)
    call = {"type": "function", "function": {"name": "look", "arguments": "{}"}, "id": "c1"}
    assert messages == [
        {"role": "system", "content": "Be brief."},
        body["input"][0],  # as sent: its image is an image part
        {
            "role": "assistant",
            "reasoning": "Hm.",
            "tool_calls": [call, {**call, "id": "c2", "function": {"name": "look", "arguments": '{"z": 1}'}}],
        },
        {"role": "tool", "content": "a cat", "tool_call_id": "c1"},
        {"role": "assistant", "content": "A cat."},
    ]
    assert tools == [
        {"type": "function", "function": {"name": "look", "description": None, "parameters": {}}}
    ]  # as vLLM dumps it


def test_a_history_sent_in_previous_input_messages_is_priced_before_the_input() -> None:
    """vLLM's previous_input_messages (a harmony model such as gpt-oss renders them before the input; chat or
    harmony form): every text counted, at the head of the first user turn, so a small input cannot carry a long
    unpriced history past admission, and in no turn of its own: a template that refuses a system turn (Gemma)
    or turns out of alternation renders it (vLLM ignores the field for such models, and serves the request)."""
    history = [
        {"role": "user", "content": "Long question " * 500},
        {"author": {"role": "assistant"}, "content": [{"type": "text", "text": "Long answer " * 500}]},
        {"author": {"role": "tool", "name": "functions.look"}, "content": [{"type": "text", "text": "seen"}, {"x": 1}]},
        {"role": "developer", "content": None},
    ]
    messages, _ = parsed("responses", {"instructions": "Be brief.", "previous_input_messages": history, "input": "hi"})
    turns = ["user: " + "Long question " * 500, "assistant: " + "Long answer " * 500]
    turns += ['tool: seen\n{"x": 1}', "developer: "]  # every part: never less than sent
    folded = "\n\n".join(turns)
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": folded + "\n\nhi"}]
    parts = [{"type": "input_text", "text": "and now?"}]
    body = {"previous_input_messages": history[:1], "input": [{"role": "user", "content": parts}]}
    messages, _ = parsed("responses", body)
    assert messages == [{"role": "user", "content": [{"type": "text", "text": turns[0]}, *parts]}]
    body = {"previous_input_messages": history[:1], "input": [{"type": "function_call_output", "call_id": "c"}]}
    messages, _ = parsed("responses", body)  # no user turn to fold it into: a system turn, first
    assert messages[0] == {"role": "system", "content": turns[0]}
    for bad in ({"previous_input_messages": "x"}, {"previous_input_messages": ["x"]}):
        with pytest.raises(GatewayError) as err:
            parsed("responses", {"input": "hi", **bad})
        assert err.value.param.startswith("previous_input_messages")


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        (
            "messages",
            {
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
                        ],
                    }
                ],
            },
        ),
        ("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE_URL}]}]}),
    ],
    ids=["anthropic", "responses"],
)
def test_an_image_is_not_counted_as_its_base64_text(kind: str, body: dict[str, Any]) -> None:
    """Read as text, the image was ~96k tokens: a 400 (longer than the context) for what vLLM serves, or the
    whole pool reserved for one request. It is an image part now, priced as a chat's image is."""
    messages, _ = parsed(kind, body)
    assert HeuristicTokenizer().count_messages(messages) < 20
    assert prompt_sizes(parse_body(kind, orjson.dumps(body))) is None  # not text: no bytes-per-token estimate  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("messages", {"messages": []}, "messages"),
        ("messages", {"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]"),
        ("messages", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ("messages", {"system": 3, "messages": [{"role": "user", "content": "x"}]}, "system"),
        ("messages", {"tools": {}, "messages": [{"role": "user", "content": "x"}]}, "tools"),
        ("responses", {"input": [3]}, "input[0]"),
        ("responses", {"input": [{"type": "mystery"}]}, "input"),
        ("responses", {"input": 3}, "input"),
        ("responses", {"instructions": ["x"], "input": "x"}, "instructions"),
        ("responses", {"input": []}, "input"),
    ],
)
def test_malformed_bodies_are_the_clients_400(kind: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as err:
        parse_body(kind, orjson.dumps(body))  # type: ignore[arg-type]
    assert err.value.status == 400 and err.value.param == param


def test_responses_truncation_is_vllms_truncate_to_the_context() -> None:
    def truncate_to(**extra: Any) -> int | None:
        return parse_body("responses", orjson.dumps({"input": "x", **extra})).truncate_to

    assert truncate_to() is None and truncate_to(truncation="disabled") is None
    assert truncate_to(truncation="auto") == -1 and truncate_to(truncation=None) == -1  # vLLM: not "disabled"


def test_responses_custom_and_namespaced_tools_are_shown_as_vllm_shows_them() -> None:
    """A custom tool is a function of one string (its calls' input wrapped as ``{"input": ...}``, so a patch an
    agent sent is counted, not parsed away to ``{}``); a namespace's functions are ``<namespace>__<name>``."""
    body = {
        "tools": [
            {"type": "custom", "name": "apply_patch", "description": "patches"},
            {"type": "namespace", "name": "fs", "tools": [{"type": "function", "name": "read", "parameters": {}}]},
            {"type": "web_search"},
        ],
        "input": [
            {"role": "user", "content": "fix it"},
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch ü"},
            {"type": "function_call", "call_id": "c2", "namespace": "fs", "name": "read", "arguments": "{}"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]},
        ],
    }
    messages, tools = parsed("responses", body)
    calls = messages[1]["tool_calls"]
    assert calls[0]["function"] == {"name": "apply_patch", "arguments": '{"input": "*** Begin Patch ü"}'}
    assert calls[1]["function"]["name"] == "fs__read"
    assert messages[2] == {"role": "tool", "content": [{"type": "input_text", "text": "ok"}], "tool_call_id": "c1"}
    assert tools is not None and [t["function"]["name"] for t in tools] == ["apply_patch", "fs__read"]
    assert tools[0]["function"]["parameters"]["required"] == ["input"]


def test_a_top_level_system_string_is_kept_as_sent() -> None:
    """vLLM keeps a string ``system`` whole (its chat parser drops only a leading billing-header line); only
    header *blocks* are dropped here."""
    header = "x-anthropic-billing-header: cc_version=2; cch=1f\nBe brief."
    messages, _ = parsed("messages", {"system": header, "messages": [{"role": "user", "content": "hi"}]})
    assert messages[0] == {"role": "system", "content": header}


@pytest.mark.parametrize(
    "item",
    [
        {"role": "user", "content": [{"type": ["x"], "text": "hi"}]},
        {"role": "user", "content": [{"type": "input_text", "text": 3}]},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text"}]},
        {"type": "function_call_output", "call_id": "c", "output": 3},
    ],
)
def test_malformed_responses_parts_are_a_400_not_a_crash(item: dict[str, Any]) -> None:
    with pytest.raises(GatewayError) as err:
        parse_body("responses", orjson.dumps({"input": [item]}))
    assert err.value.status == 400 and err.value.param is not None and err.value.param.startswith("input[0]")


def test_scoring_truncates_as_asked() -> None:
    body = {"query": "q", "documents": ["a", "b"], "truncate_prompt_tokens": 10}
    assert parse_body("score", orjson.dumps(body)).truncate_to == 10
