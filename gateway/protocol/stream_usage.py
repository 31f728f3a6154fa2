"""Every chat or completions stream reaches the engine asking for its usage, and the client gets only what it
asked for.

A stream's events are no count of its tokens: vLLM's API server merges the deltas its consumer has not taken
yet (busy: 24 tokens came as 12 events on a loaded CI machine), speculative decoding puts several accepted tokens
in one step, and ``stream_interval`` batches them. Counted as tokens, a stream without usage taught output
lengths short of the truth, under load above all, and was billed short. So kvgate asks the engine for the usage
(``stream_options.include_usage``) of every stream whose client did not, reads it, and drops that one event,
the last before ``[DONE]``, from what the client receives (:class:`UsageEventFilter`).

The body is rewritten only by appending the option as the object's last member, every other byte as sent,
unless it already has ``stream_options`` (or a ``\\u`` escape that could spell it): then it is parsed and
written again. Pure: no I/O.
"""

from __future__ import annotations

import orjson

from gateway.protocol.requests import json_object

_ASKED = b'"stream_options":{"include_usage":true}'


def asking_usage(raw: bytes) -> bytes:
    """The JSON object ``raw`` with ``stream_options.include_usage`` true (and ``continuous_usage_stats``
    false: the client asked for no usage, so none in every event either)."""
    if b"stream_options" not in raw and b"\\u" not in raw:
        head = raw.rstrip()[:-1].rstrip()  # without its closing brace
        return head + (b"" if head.endswith(b"{") else b",") + _ASKED + b"}"
    body = json_object(raw)
    options = body.get("stream_options")
    options = options if isinstance(options, dict) else {}
    return orjson.dumps({**body, "stream_options": {**options, "include_usage": True, "continuous_usage_stats": False}})


def is_usage_event(event: bytes) -> bool:
    """The event vLLM adds for ``include_usage``: its usage and no choice (``"choices":[]``)."""
    return b'"usage"' in event and (b'"choices":[]' in event or b'"choices": []' in event)


class UsageEventFilter:
    """Drops the usage event from a stream relayed chunk by chunk, every other byte kept in order. An event cut
    by a chunk's end is held back until its rest arrives (so nothing is written until an event is whole)."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        whole, self._pending = data[: end + 2], data[end + 2 :]
        if b'"usage"' not in whole:
            return whole
        return b"".join(event + b"\n\n" for event in whole[:-2].split(b"\n\n") if not is_usage_event(event))

    def flush(self) -> bytes:
        """What is held back when the stream ends (an event the engine never finished)."""
        rest, self._pending = self._pending, b""
        return rest
