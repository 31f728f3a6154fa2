"""ConversationCounts: digests chain over a conversation's messages, so an earlier turn is a prefix of the
later one; anything else that changes the rendered prompt (model, tools, a message's text) misses."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.requests import InferenceRequest, parse_request
from gateway.tokens.conversations import Conversation, ConversationCounts, conversation_of

_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=30)}),
    min_size=1,
    max_size=8,
)


def chat(messages: list[dict[str, Any]], **extra: Any) -> InferenceRequest:
    return parse_request("chat", orjson.dumps({"model": "m", "messages": messages, **extra}))


def conv(request: InferenceRequest) -> Conversation:
    conversation = conversation_of(request)
    assert conversation is not None
    return conversation


@given(_messages, _messages)
def test_an_earlier_turn_is_the_longest_known_prefix_of_a_later_one(first: list[Any], more: list[Any]) -> None:
    counts = ConversationCounts(min_bytes=0)
    earlier, later = conv(chat(first)), conv(chat(first + more))
    counts.observe(earlier, 1000)
    known = counts.longest_known(later)
    assert known is not None and (known.messages, known.tokens) == (len(first), 1000)
    assert known.tail_messages == len(more)
    assert known.tail_bytes == sum(len(orjson.dumps(m)) for m in more)
    again = counts.longest_known(earlier)
    assert again is not None and again.whole and again.tokens == 1000


def test_another_model_other_tools_or_an_edited_message_miss() -> None:
    counts = ConversationCounts(min_bytes=0)
    base = [{"role": "user", "content": "a long document"}]
    counts.observe(conv(chat(base)), 500)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    follow = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    for other in (
        parse_request("chat", orjson.dumps({"model": "other", "messages": base + follow})),
        chat(base + follow, tools=[tool]),
        chat([{"role": "user", "content": "a long document!"}, *follow]),
    ):
        assert counts.longest_known(conv(other)) is None


def test_bounded_least_recently_used_and_short_chats_are_not_remembered() -> None:
    counts = ConversationCounts(max_entries=2, min_bytes=0)
    convs = [conv(chat([{"role": "user", "content": f"document {i}"}])) for i in range(3)]
    counts.observe(convs[0], 10)
    counts.observe(convs[1], 11)
    assert counts.longest_known(convs[0]) is not None  # used: now the most recent
    counts.observe(convs[2], 12)
    assert len(counts) == 2 and counts.longest_known(convs[1]) is None
    short = ConversationCounts(min_bytes=1000)
    short.observe(convs[0], 10)
    assert len(short) == 0 and short.longest_known(convs[0]) is None


def test_only_chats_have_a_conversation() -> None:
    assert conversation_of(parse_request("completions", b'{"prompt": "a"}')) is None
