"""Streams whose client asked for no usage: kvgate asks the engine for it, and the client's stream is the one the
engine would have sent without it (the usage event gone, its system_fingerprint back on the final events),
whatever the chunks it came in."""

from __future__ import annotations

import itertools
import json

import orjson
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.bodies import parse_body
from gateway.protocol.requests import parse_request
from gateway.protocol.stream_usage import UsageEventFilter, asking_usage

CHAT = [{"role": "user", "content": "hi"}]


def test_only_streams_without_usage_ask_for_it() -> None:
    def parsed(**body: object) -> tuple[bool, bool]:
        request = parse_request("chat", orjson.dumps({"messages": CHAT, **body}))
        return request.usage_hidden, request.stream_options_given

    assert parsed(stream=True) == (True, False)
    assert parsed(stream=True, stream_options={"include_usage": False}) == (True, True)
    assert parsed(stream=True, stream_options={"continuous_usage_stats": True})[0]  # no usage without include
    assert not parsed(stream=True, stream_options={"include_usage": True})[0]
    assert not parsed()[0] and not parsed(stream=False)[0]
    pooled = parse_body("pooling", orjson.dumps({"messages": CHAT, "stream": True}))
    assert not pooled.usage_hidden  # embeddings do not stream


def test_the_option_is_appended_or_merged() -> None:
    big = b'{"messages": [{"role": "user", "content": "h\\u00e9"}], "stream": true, "seed": %d}\n' % 10**29
    out = asking_usage(big, merge=False)
    assert out.startswith(big.rstrip()[:-1]) and b"%d" % 10**29 in out  # every byte kept
    assert json.loads(out)["stream_options"] == {"include_usage": True}
    merged = json.loads(asking_usage(b'{"stream": true, "stream_options": {"continuous_usage_stats": true}}', True))
    assert merged["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    escaped = b'{"prompt": "p", "stream": true, "\\u0073tream_options": {"include_usage": false}}'
    assert parse_request("completions", escaped).stream_options_given  # the key as parsed, however spelled
    assert json.loads(asking_usage(escaped, True))["stream_options"]["include_usage"] is True


def _event(payload: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _token(i: int, finish: str | None = None, **extra: object) -> dict[str, object]:
    choice = {"index": 0, "delta": {"content": f' "usage" {i}'}, "finish_reason": finish}
    return {"id": "c", "choices": [choice], "usage": None, **extra}  # a "usage" key that is no usage event


TOKENS = b"".join(_event(_token(i)) for i in range(4))
LAST = _event(_token(4, "length"))
LAST_STAMPED = _event(_token(4, "length", system_fingerprint="fp"))
USAGE = _event({"id": "c", "choices": [], "usage": {"completion_tokens": 5}, "system_fingerprint": "fp"})
DONE = b"data: [DONE]\n\n"


def _relay(stream: bytes, cuts: list[int]) -> bytes:
    bounds = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    hidden, written = UsageEventFilter(), b""
    for start, end in itertools.pairwise(bounds):
        out = hidden.feed(stream[start:end])
        assert out == b"" or out.endswith(b"\n\n")  # nothing of an event before it is whole
        written += out
    return written + hidden.flush()


def _events(raw: bytes) -> list[object]:
    return [e if e == b"data: [DONE]" else json.loads(e[len(b"data: ") :]) for e in raw[:-2].split(b"\n\n")]


@given(st.lists(st.integers(0, 3000), max_size=12))
def test_the_client_gets_the_stream_it_would_have_had_without_usage(cuts: list[int]) -> None:
    """Cut anywhere (inside an event, between its two newlines): the usage event is gone and the final event
    carries the fingerprint vLLM moved onto it, every other event byte for byte, in order."""
    relayed = _relay(TOKENS + LAST + USAGE + DONE, cuts)
    assert relayed.startswith(TOKENS) and relayed.endswith(DONE)
    assert _events(relayed) == _events(TOKENS + LAST_STAMPED + DONE)
    error = _event({"error": {"message": "boom", "code": 500}})
    assert _relay(TOKENS + LAST + error + DONE, cuts) == TOKENS + LAST + error + DONE  # no usage came: as sent
    assert _relay(TOKENS + b'data: {"partial', cuts) == TOKENS + b'data: {"partial'  # cut off: as sent


@given(st.lists(st.integers(0, 3000), max_size=12))
def test_events_before_the_last_go_through_in_one_piece_as_vllm_sends_them(cuts: list[int]) -> None:
    """vLLM's choice events carry no usage key without continuous_usage_stats: the filter passes everything
    before the first event it acts on as one slice (a zero-delay stream arrives in one chunk), the same bytes."""
    plain = b"".join(_event({"id": "c", "choices": [{"index": 0, "delta": {"content": f"{i}"}}]}) for i in range(6))
    last = _event({"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]})
    stamped = _event(
        {
            "id": "c",
            "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}],
            "system_fingerprint": "fp",
        }
    )
    relayed = _relay(plain + last + USAGE + DONE, cuts)
    assert relayed.startswith(plain) and _events(relayed) == _events(plain + stamped + DONE)
    assert UsageEventFilter().feed(plain + last + USAGE + DONE) == plain + stamped + DONE


def test_the_other_choices_of_an_n_stream_go_on_streaming_after_the_first_ends() -> None:
    """n=2: choice 0 ends first. Its last event waits for the usage event's fingerprint, but choice 1's
    events are not held behind it until the whole stream ends: each goes out as it comes."""

    def choice(index: int, i: int, finish: str | None = None) -> bytes:
        return _event({"id": "c", "choices": [{"index": index, "delta": {"content": f"{i}"}, "finish_reason": finish}]})

    hidden = UsageEventFilter()
    assert hidden.feed(choice(0, 0) + choice(1, 0)) == choice(0, 0) + choice(1, 0)
    assert hidden.feed(choice(0, 1, "stop")) == b""  # held for its fingerprint
    for i in range(1, 4):
        assert hidden.feed(choice(1, i)) == choice(1, i)  # as it comes
    end = hidden.feed(choice(1, 4, "length") + USAGE + DONE)
    stamped = [e for e in _events(end) if isinstance(e, dict)]
    assert [e["choices"][0]["index"] for e in stamped] == [0, 1]  # type: ignore[index]
    assert all(e["system_fingerprint"] == "fp" for e in stamped) and end.endswith(DONE)  # type: ignore[index]


def test_a_stream_not_framed_as_sse_is_passed_through() -> None:
    hidden = UsageEventFilter()
    body = b"x" * 70_000
    assert hidden.feed(body[:40_000]) == b""
    assert hidden.feed(body[40_000:]) == body
    assert hidden.feed(USAGE) == USAGE
