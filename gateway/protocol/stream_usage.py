"""Every chat or completions stream reaches the engine asking for its usage, and the client gets only what it
asked for.

A stream's events are no count of its tokens: vLLM's API server merges the deltas its consumer has not taken
yet (busy: 24 tokens came as 12 events on a loaded CI machine), speculative decoding puts several accepted tokens
in one step, and ``stream_interval`` batches them. Counted as tokens, a stream without usage taught output
lengths short of the truth, under load above all, and was billed short. So kvgate asks the engine for the usage
(``stream_options.include_usage``) of every stream whose client did not, reads it, and drops that one event,
the last before ``[DONE]``, from what the client receives (:class:`UsageEventFilter`).

The body is rewritten only by appending the option as the object's last member, every other byte as sent,
unless it already has ``stream_options``: then it is parsed and written again. Pure: no I/O.
"""

from __future__ import annotations

import orjson

from gateway.protocol.requests import json_object

_ASKED = b'"stream_options":{"include_usage":true}'
_GIVE_UP_BYTES = 1 << 16  # held this much with no event ended yet: not SSE framed as "\n\n" (pass it through)
# what makes an event one the filter acts on: a usage object, a choice's end (see is_usage_event, _is_terminal)
_MATTERS = (b'"usage"', b'"finish_reason":"', b'"finish_reason": "')


def asking_usage(raw: bytes, merge: bool) -> bytes:
    """The JSON object ``raw`` with ``stream_options.include_usage`` true (and ``continuous_usage_stats``
    false: the client asked for no usage, so none in every event either). ``merge``: the body has
    ``stream_options`` already (it is parsed and written again); else the option is appended."""
    if not merge:
        head = raw.rstrip()[:-1].rstrip()  # without its closing brace
        return head + (b"" if head.endswith(b"{") else b",") + _ASKED + b"}"
    body = json_object(raw)
    options = body.get("stream_options")
    options = options if isinstance(options, dict) else {}
    return orjson.dumps({**body, "stream_options": {**options, "include_usage": True, "continuous_usage_stats": False}})


def is_usage_event(event: bytes) -> bool:
    """The event vLLM adds for ``include_usage``: its usage and no choice (``"choices":[]``)."""
    return b'"usage"' in event and (b'"choices":[]' in event or b'"choices": []' in event)


def _is_terminal(event: bytes) -> bool:
    """A choice's last event (``finish_reason`` set): vLLM stamps it with the ``system_fingerprint`` only when
    no usage event follows, and puts it on the usage event otherwise."""
    return b'"finish_reason":"' in event or b'"finish_reason": "' in event


def _streams_a_choice(event: bytes) -> bool:
    """An event of a choice (chat's ``delta``, completions' ``text``), not an error or the usage."""
    return b'"choices":[{' in event or b'"choices": [{' in event


def _fingerprint(usage_event: bytes) -> bytes | None:
    """The usage event's ``"system_fingerprint":"..."`` member, to stamp on the events it was taken from."""
    if b'"system_fingerprint"' not in usage_event:
        return None
    try:
        value = orjson.loads(usage_event.partition(b"data:")[2]).get("system_fingerprint")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return b'"system_fingerprint":' + orjson.dumps(value) if isinstance(value, str) else None


def _stamped(event: bytes, member: bytes | None) -> bytes:
    body = event.rstrip()
    if member is None or not body.endswith(b"}") or b'"system_fingerprint"' in body:
        return event
    return body[:-1] + b"," + member + b"}"


class UsageEventFilter:
    """Drops the usage event from a stream relayed chunk by chunk, every other event kept in order, and gives
    the choices' last events the ``system_fingerprint`` vLLM moved onto it: the client's stream is the one it
    would have had without the usage it did not ask for. An event cut by a chunk's end is held back until its
    rest arrives (nothing is written before an event is whole), and so is each choice's last event
    (``finish_reason``) until the usage event, whose fingerprint it gets, with any other event behind it but
    the other choices' own: those of an ``n > 1`` stream go on streaming meanwhile. A stream not framed as SSE
    events ("\n\n") is passed through as it comes."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []  # an event's start, in pieces (joined once it ends: linear in its size)
        self._held: list[bytes] = []  # whole events from a terminal one on, waiting for the usage event
        self._framed = False  # an event has ended: it is SSE
        self._through = False  # not SSE: pass everything through

    def feed(self, chunk: bytes) -> bytes:
        if self._through:
            return chunk
        last = self._pending[-1][-1:] if self._pending else b""
        end = (last + chunk).rfind(b"\n\n")
        if end < 0:
            self._pending.append(chunk)
            if not self._framed and sum(map(len, self._pending)) > _GIVE_UP_BYTES:
                self._through = True
                return self.flush()
            return b""
        self._framed = True
        cut = end + 2 - len(last)  # in ``chunk``: where its last whole event ends
        whole = b"".join([*self._pending, chunk[:cut]]) if self._pending else chunk[:cut]
        self._pending = [chunk[cut:]] if cut < len(chunk) else []
        if not self._held and b'"usage"' not in whole and not _is_terminal(whole):
            return whole
        out: list[bytes] = []
        if not self._held:  # the events before the first that matters (a terminal or the usage one) go as they are
            at = min(i for i in map(whole.find, _MATTERS) if i >= 0)
            head = whole.rfind(b"\n\n", 0, at) + 2
            if head > 1:
                out.append(whole[:head])
                whole = whole[head:]
        for event in whole[:-2].split(b"\n\n"):
            if is_usage_event(event):
                member = _fingerprint(event)
                out.extend(_stamped(e, member) + b"\n\n" for e in self._held)
                self._held = []
            elif event.startswith(b"data: [DONE]"):  # no usage event came (an error): as they were
                out.extend(e + b"\n\n" for e in self._held)
                self._held = []
                out.append(event + b"\n\n")
            elif _is_terminal(event) or (self._held and not _streams_a_choice(event)):
                self._held.append(event)  # not the other choices of an n > 1 stream: they go on as they come
            else:
                out.append(event + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        """What is held back when the stream ends: events no usage event followed, and an event the engine never
        finished."""
        rest = b"".join(e + b"\n\n" for e in self._held) + b"".join(self._pending)
        self._held, self._pending = [], []
        return rest
