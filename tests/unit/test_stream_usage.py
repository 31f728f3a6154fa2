"""Streams whose client asked for no usage: kvgate asks the engine for it, and the client's stream is the
engine's without that one event, whatever the chunks it came in."""

from __future__ import annotations

import itertools
import json

import orjson
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.requests import parse_request
from gateway.protocol.stream_usage import UsageEventFilter, asking_usage

CHAT = [{"role": "user", "content": "hi"}]


def test_only_streams_without_usage_ask_for_it() -> None:
    def hidden(**body: object) -> bool:
        return parse_request("chat", orjson.dumps({"messages": CHAT, **body})).usage_hidden

    assert hidden(stream=True) and hidden(stream=True, stream_options={"include_usage": False})
    assert hidden(stream=True, stream_options={"continuous_usage_stats": True})  # no usage without include_usage
    assert not hidden(stream=True, stream_options={"include_usage": True})
    assert not hidden() and not hidden(stream=False)


def test_the_option_is_appended_or_merged() -> None:
    big = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "seed": 123456789012345678901234567890}\n'
    out = asking_usage(big)
    assert out.startswith(big.rstrip()[:-1]) and b"123456789012345678901234567890" in out  # every byte kept
    assert json.loads(out)["stream_options"] == {"include_usage": True}
    merged = json.loads(asking_usage(b'{"stream": true, "stream_options": {"continuous_usage_stats": true}}'))
    assert merged["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    escaped = json.loads(asking_usage(b'{"stream": true, "\\u0073tream_options": {"include_usage": false}}'))
    assert escaped["stream_options"]["include_usage"] is True


def _event(payload: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


TOKENS = [_event({"id": "c", "choices": [{"index": 0, "delta": {"content": f' "usage" {i}'}}]}) for i in range(5)]
USAGE = _event({"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
DONE = b"data: [DONE]\n\n"


@given(st.lists(st.integers(0, 2000), max_size=12), st.booleans())
def test_the_client_gets_every_byte_but_the_usage_event(cuts: list[int], with_usage: bool) -> None:
    """Cut anywhere (inside an event, between its two newlines), the stream the client reads is the engine's
    without the usage event, in order, and nothing of an event is written before it is whole."""
    stream = b"".join(TOKENS) + (USAGE if with_usage else b"") + DONE
    bounds = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    hidden, written = UsageEventFilter(), b""
    for start, end in itertools.pairwise(bounds):
        out = hidden.feed(stream[start:end])
        assert out == b"" or out.endswith(b"\n\n")
        written += out
    assert written + hidden.flush() == b"".join(TOKENS) + DONE


def test_an_event_the_engine_never_finished_is_flushed_as_it_came() -> None:
    hidden = UsageEventFilter()
    assert hidden.feed(TOKENS[0] + b'data: {"partial') == TOKENS[0]
    assert hidden.flush() == b'data: {"partial'
