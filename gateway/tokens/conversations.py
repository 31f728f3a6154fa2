"""Counts of conversations seen before: the exact part of a multi-turn chat's price. Pure: no clock, no I/O.

A multi-turn chat resends the whole conversation every turn, and long conversations are the ones that come
near the context limit, where the learned estimate's band (a few percent of the prompt: thousands of tokens
at 30k) straddles the limit and every turn would be counted again in full, locally (tens of milliseconds of
CPU) or by the engine's ``/tokenize`` (a round trip and as much CPU on its API server).

The previous turn's prompt is a prefix of this one, and its exact count is known: the engine reported it
(``usage.prompt_tokens``) when it served that turn, or kvgate counted it. Adding counts is not exact
(:mod:`gateway.tokens.count_cache` says why: templates render a message by its neighbours, BPE merges across
boundaries), so a prefix's count does not replace counting; it narrows the band. The new messages are checked
at the most text can make of their bytes (one token per byte: no byte-level BPE or byte-fallback tokenizer
exceeds it, however dense the new turn: code, hashes, CJK, tool output) plus :data:`FRAMING_TOKENS` each for
the template's framing and the boundary, and priced at the learned ratio. A 30k-token conversation with a
500-byte new turn is decided within ~500 tokens of the limit instead of ~3,000, without counting.

Keys chain blake2b digests over the model, the tools and each message's JSON in order (never the text):
``chain[i]`` stands for the conversation's first ``i + 1`` messages. What else a template renders from the
body (``chat_template``, ``chat_template_kwargs``, ``add_generation_prompt``) is not in the key, as it is not in
the ``/tokenize`` counts either: a whole-conversation hit sent with other template arguments is off by what they
change (a few tokens of generation prompt), which the live usage gate and the watermark's margin absorb.

Bounded: ``max_entries`` digests, the least recently used dropped first. Only conversations of at least
``min_bytes`` are remembered: a short chat is cheap to count and never near a limit. Forgotten when the
tokenizer is chosen again (``auto`` found another model).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import orjson

from gateway.protocol.requests import InferenceRequest
from gateway.tokens.prompt_estimate import text_only

FRAMING_TOKENS = 8  # per new message: role header and end-of-turn markers, the generation prompt's swap
DEFAULT_ENTRIES = 4096
DEFAULT_MIN_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat's digest chain and the bytes of its messages up to each point (the JSON of each message)."""

    digests: tuple[bytes, ...]
    sizes: tuple[int, ...]  # sizes[i]: bytes of messages[: i + 1]

    @property
    def total_bytes(self) -> int:
        return self.sizes[-1] if self.sizes else 0


@dataclass(frozen=True, slots=True)
class KnownPrefix:
    """The longest prefix of a conversation with a known count: its first ``messages`` messages, ``tokens``
    exactly, and what follows it: ``tail_messages`` messages of ``tail_bytes``."""

    messages: int
    tokens: int
    tail_messages: int
    tail_bytes: int

    @property
    def whole(self) -> bool:
        """The very conversation was counted before: its count is exact."""
        return self.tail_messages == 0


def conversation_of(request: InferenceRequest) -> Conversation | None:
    """The chain of a chat request; None for anything else, for a chat with images or audio (bytes do not
    describe them: such requests are always counted), or when its messages are not JSON."""
    if request.messages is None or not text_only(request.messages):
        return None
    try:
        # what else decides the count: the special tokens added to the rendered chat (a Responses request's BOS)
        head = [request.model or "", request.tools, request.template_kwargs, request.add_special_tokens is True]
        h = hashlib.blake2b(orjson.dumps(head), digest_size=16)
        digests: list[bytes] = []
        sizes: list[int] = []
        size = 0
        for message in request.messages:
            data = orjson.dumps(message)
            size += len(data)
            h.update(data)
            digests.append(h.copy().digest())
            sizes.append(size)
    except TypeError:  # orjson.JSONEncodeError: not JSON (built in code, not parsed from a body)
        return None
    return Conversation(tuple(digests), tuple(sizes))


class ConversationCounts:
    """Exact prompt counts of conversations, by digest. Event-loop only: no lock."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        if max_entries < 1 or min_bytes < 0:
            raise ValueError("need max_entries >= 1 and min_bytes >= 0")
        self.max_entries = max_entries
        self.min_bytes = min_bytes
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def remembers(self, conversation: Conversation) -> bool:
        return conversation.total_bytes >= self.min_bytes and bool(conversation.digests)

    def observe(self, conversation: Conversation, tokens: int) -> None:
        """The exact count of this whole conversation (the engine's ``usage.prompt_tokens``, or a count)."""
        if tokens <= 0 or not self.remembers(conversation):
            return
        key = conversation.digests[-1]
        self._counts[key] = tokens
        self._counts.move_to_end(key)
        while len(self._counts) > self.max_entries:
            self._counts.popitem(last=False)

    def longest_known(self, conversation: Conversation) -> KnownPrefix | None:
        """The longest prefix (the whole conversation included) whose count is known."""
        if not self.remembers(conversation):
            return None
        n = len(conversation.digests)
        for i in range(n - 1, -1, -1):
            tokens = self._counts.get(conversation.digests[i])
            if tokens is not None:
                self._counts.move_to_end(conversation.digests[i])
                return KnownPrefix(
                    messages=i + 1,
                    tokens=tokens,
                    tail_messages=n - i - 1,
                    tail_bytes=conversation.total_bytes - conversation.sizes[i],
                )
        return None

    def clear(self) -> None:
        """Another model or tokenizer counts differently: forget every count."""
        self._counts.clear()

    def __len__(self) -> int:
        return len(self._counts)
