"""The messages a chat template sees are the ones vLLM 0.32 hands it, not the request's as sent.
(tests/e2e/test_vllm_engine.py checks the counts against the real engine.)"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from gateway.tokens.chat_render import content_format, conversation, media_items
from gateway.tokens.tokenizers import load_tokenizer
from tests.support.bpe import build_bpe_dir

LOOPS_OVER_CONTENT = (
    "{% for message in messages %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"
)
STRING_ONLY = "{% for message in messages %}{{ message['role'] + ': ' + message['content'] }}\n{% endfor %}"
VIA_ALIAS_AND_MACRO = (
    "{% macro render(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% set msgs = messages[1:] %}{% for m in msgs %}{{ render(m.content) }}{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (LOOPS_OVER_CONTENT, "openai"),
        (STRING_ONLY, "string"),
        (VIA_ALIAS_AND_MACRO, "openai"),  # a sliced alias of messages, content given to a macro
        ("{% set content = messages[0]['content'] %}{% for x in content %}{{ x }}{% endfor %}", "openai"),
        ("{% for m in messages %}{% for x in m['tool_calls'] %}{{ x }}{% endfor %}{% endfor %}", "string"),
        ("{% for m in messages %", "string"),  # does not parse: vLLM's default
    ],
)
def test_the_content_format_is_read_off_the_template(template: str, expected: str) -> None:
    assert content_format(template) == expected


IMAGE = {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "x-anthropic-billing-header: cc_version=2; cch=1f\nBe brief."},
    {"role": "user", "content": ["What is ", {"type": "text", "text": "this?"}, IMAGE]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "look", "arguments": '{"zoom": 2}'}},
            {"id": "b", "type": "function", "function": {"name": "look", "arguments": "not json"}},
            {"id": "c", "type": "function", "function": {"name": "look", "arguments": ""}},
        ],
        "reasoning": "Look first.",
    },
    {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "cat"}]},
    {"role": "assistant", "content": "A cat.", "tool_calls": []},
]


def test_a_conversation_as_vllm_hands_it_to_a_string_template() -> None:
    sent = copy.deepcopy(TOOL_TURNS)
    assert conversation(TOOL_TURNS, "string") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is \nthis?"},  # text parts joined, the image is the processor's
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "look", "arguments": {"zoom": 2}}},
                {"id": "b", "type": "function", "function": {"name": "look", "arguments": {}}},
                {"id": "c", "type": "function", "function": {"name": "look", "arguments": {}}},
            ],
            "reasoning": "Look first.",
            "reasoning_content": "Look first.",
        },
        {"role": "tool", "content": "a\ncat", "tool_call_id": "a"},
        {"role": "assistant", "content": "A cat."},  # an empty tool_calls list is dropped
    ]
    assert sent == TOOL_TURNS  # the request's own messages are left as they were


def test_an_openai_template_gets_wrapped_parts() -> None:
    user, assistant, tool = conversation(TOOL_TURNS, "openai")[1:4]
    texts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "this?"}]
    assert user["content"] == [*texts, {"type": "image"}]
    assert assistant["content"] == []
    assert tool["content"] == "a\ncat"


def test_developer_turns_become_one_system_turn_unless_the_template_knows_them() -> None:
    messages = [
        {"role": "system", "content": "One."},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": [{"type": "text", "text": "Two."}], "tools": [{"x": 1}]},
    ]
    assert conversation(messages, "string", STRING_ONLY) == [
        {"role": "system", "content": "One.\n\nTwo."},
        {"role": "user", "content": "hi"},
    ]
    knows = STRING_ONLY + "{% if message['role'] == 'developer' %}{% endif %}"
    assert [m["role"] for m in conversation(messages, "string", knows)] == ["system", "user", "developer"]


def test_a_tool_call_turn_without_content_renders_instead_of_a_400(tmp_path: Path) -> None:
    """A template that loops over content failed on the ``None`` content of an assistant turn that only calls
    tools (what the OpenAI SDK sends back): kvgate answered 400, vLLM serves it."""
    tok = load_tokenizer(f"hf:{build_bpe_dir(tmp_path, ['what is this? a cat'] * 20, 300, LOOPS_OVER_CONTENT)}")
    assert tok.render_chat(TOOL_TURNS) == "Be brief.What is this?A cat."


def test_media_parts_are_counted_typed_or_not() -> None:
    parts = [
        IMAGE,
        {"type": "input_image", "image_url": "https://x/a.png"},
        {"audio_url": {"url": "https://x/a.wav"}},
        {"input_audio": {"data": "", "format": "wav"}},
        {"video_url": {"url": "https://x/a.mp4"}},
        {"type": "text", "text": "and"},
        {"type": ["not", "a", "type"]},
        "a string",
    ]
    counted = media_items([{"role": "user", "content": parts}, {"role": "user", "content": "x"}])
    assert counted == {"image": 2, "audio": 2, "video": 1}
