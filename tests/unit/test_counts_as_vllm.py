"""What kvgate counts locally is what vLLM 0.32 counts: the tools a chat template is shown, and where the
tokenizer's special tokens are added (a review against the real engine found kvgate 7-12 tokens short per tool
without a description, and one token short on every Responses request)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import orjson
import pytest

from gateway.protocol.bodies import parse_body
from gateway.protocol.requests import lax_bool, template_tool
from gateway.tokens.conversations import conversation_of
from gateway.tokens.counting import TokenCounter, _as_chat_parts
from gateway.tokens.tokenizers import HFTokenizer
from tests.support.bpe import build_bpe_dir

DATA = Path(__file__).parents[1] / "data" / "vllm-tool-dumps.json"
USER = [{"role": "user", "content": "hello"}]
# prints the tools as JSON, as many real templates do (Llama 3.1's, Qwen 2.5's)
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tools_are_shown_to_the_template_as_vllm_dumps_them() -> None:
    """Recorded from vLLM 0.32's ChatCompletionToolsParam: missing description and parameters as nulls, strict
    and defer_loading only when set, unknown keys dropped."""
    cases = json.loads(DATA.read_text())["cases"]
    assert len(cases) >= 6
    for case in cases:
        assert json.dumps(template_tool(case["tool"])) == json.dumps(case["dumped"]), case["tool"]


def test_anthropic_tools_are_shown_as_vllm_converts_them() -> None:
    """vLLM's AnthropicTool adds "type": "object" to an input schema without one, and its conversion keeps
    strict and defer_loading."""
    cases = json.loads(DATA.read_text())["anthropic_cases"]
    assert len(cases) >= 3
    for case in cases:
        shown = parse_body("messages", orjson.dumps({"max_tokens": 1, "messages": USER, "tools": [case["tool"]]})).tools
        assert shown is not None and json.dumps(shown[0]) == json.dumps(case["dumped"]), case["tool"]


@pytest.mark.parametrize(
    ("value", "read"),
    [
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        ("true", True),
        ("Off", False),
        ("maybe", None),
        (None, None),
    ],
)
def test_flags_are_read_as_vllm_reads_booleans(value: object, read: bool | None) -> None:
    """pydantic's lax booleans: a body vLLM serves is not refused (an add_special_tokens of 1 was a 400)."""
    assert lax_bool(value) is read
    body = {"prompt": "hi", "add_special_tokens": value}
    assert parse_body("completions", orjson.dumps(body)).add_special_tokens is read


def test_a_chat_and_a_responses_turn_of_the_same_text_are_different_conversations() -> None:
    """The Responses API adds the special tokens: its count of the same messages is one more (a BOS), so a count
    one route learned is not the other's."""
    chat = parse_body("chat", orjson.dumps({"model": "m", "messages": USER}))
    responses = parse_body("responses", orjson.dumps({"model": "m", "input": USER[0]["content"]}))
    assert chat.messages == responses.messages
    one, other = conversation_of(chat), conversation_of(responses)
    assert one is not None and other is not None and one.digests != other.digests


@pytest.fixture(scope="module")
def counter(tmp_path_factory: pytest.TempPathFactory) -> TokenCounter:
    rng = random.Random(2)
    words = [
        "get",
        "weather",
        "city",
        "name",
        "description",
        "parameters",
        "null",
        "true",
        "user",
        "hello",
        "world",
        "the",
        "a",
        "of",
    ]
    corpus = [" ".join(rng.choices(words, k=40)) for _ in range(200)]
    directory = build_bpe_dir(tmp_path_factory.mktemp("bpe"), corpus, 400, TEMPLATE)
    return TokenCounter(HFTokenizer.load(str(directory)))


def count(counter: TokenCounter, kind: str, body: dict[str, object]) -> tuple[int, ...]:
    return asyncio.run(counter.count(parse_body(kind, orjson.dumps(body))))  # type: ignore[arg-type]


def test_a_tool_without_description_counts_its_nulls(counter: TokenCounter) -> None:
    user = [{"role": "user", "content": "hello"}]
    bare = {"type": "function", "function": {"name": "get_weather"}}
    explicit = {"type": "function", "function": {"name": "get_weather", "description": None, "parameters": None}}
    assert count(counter, "chat", {"messages": user, "tools": [bare]}) == count(
        counter, "chat", {"messages": user, "tools": [explicit]}
    )
    raw = counter.local.count_messages(user, [bare])  # type: ignore[union-attr]  # what kvgate rendered before
    assert count(counter, "chat", {"messages": user, "tools": [bare]})[0] > raw
    flat = {"type": "function", "name": "get_weather"}  # the Responses API's form
    assert count(counter, "responses", {"input": "hello", "tools": [flat]}) == (
        count(counter, "chat", {"messages": user, "tools": [explicit]})[0] + 1,  # + the BOS, as below
    )


def test_special_tokens_are_added_where_vllm_adds_them(counter: TokenCounter) -> None:
    user = [{"role": "user", "content": "hello world"}]
    (chat,) = count(counter, "chat", {"messages": user})
    assert count(counter, "chat", {"messages": user, "add_special_tokens": True}) == (chat + 1,)
    assert count(counter, "responses", {"input": "hello world"}) == (chat + 1,)  # ResponsesRequest's default
    assert count(counter, "messages", {"max_tokens": 5, "messages": user}) == (chat,)  # a chat underneath
    (text,) = count(counter, "completions", {"prompt": "hello world"})
    assert count(counter, "completions", {"prompt": "hello world", "add_special_tokens": False}) == (text - 1,)


def test_the_engines_tokenize_gets_chat_parts_not_responses_parts() -> None:
    message = {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert _as_chat_parts(message) == {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    plain = {"role": "user", "content": "a"}
    assert _as_chat_parts(plain) is plain
