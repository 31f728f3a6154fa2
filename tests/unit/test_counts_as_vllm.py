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
from gateway.protocol.requests import template_tool
from gateway.tokens.counting import TokenCounter, _as_chat_parts
from gateway.tokens.tokenizers import HFTokenizer
from tests.support.bpe import build_bpe_dir

DATA = Path(__file__).parents[1] / "data" / "vllm-tool-dumps.json"
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
