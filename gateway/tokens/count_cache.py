"""Exact ``/tokenize`` counts of whole requests seen before: a request sent again costs no round trip.

Multi-turn chats resend the whole conversation each turn, so caching the count of every conversation prefix
and adding a count of the new messages is tempting. It would not be exact, and admission needs the engine's
exact count:

* a chat template renders a message according to its place and its neighbours: the generation prompt only
  after the last message; the system prompt or the tool definitions folded into the first (or last) user
  turn; earlier assistant turns stripped of their reasoning once a later user turn exists (Qwen3); turn
  numbers, separators between turns, BOS only at the start;
* tokenization is not additive: BPE merges across the boundary between the prefix's text and the rest, so
  ``count(a + b)`` may be ``count(a) + count(b) - 1`` (or more).

So the only exact reuse is a whole-request hit (what an earlier turn's count does give is a narrow band for
the next: :mod:`gateway.tokens.conversations`): the very bytes sent to /tokenize before (same messages,
tools, model and add_generation_prompt, in the same order; key order too, since a template that renders the
tools with ``tojson`` renders their keys as sent). Keys are blake2b-256 digests of that body, never the text:
the cache keeps no prompt, and both its entries and the bytes of its keys are bounded.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

DEFAULT_ENTRIES = 8192
DEFAULT_BYTES = 1 << 20


class CountCache:
    """A least-recently-used map from a /tokenize body's digest to its count. Event-loop only: no lock."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES, max_bytes: int = DEFAULT_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        self.key_bytes = 0
        self.hits = 0  # monotonic, for kvgate_tokenize_cache_lookups_total; clear() keeps them
        self.misses = 0

    @staticmethod
    def key(body: bytes) -> bytes:
        return hashlib.blake2b(body, digest_size=32).digest()

    def get(self, key: bytes) -> int | None:
        count = self._counts.get(key)
        if count is None:
            self.misses += 1
            return None
        self.hits += 1
        self._counts.move_to_end(key)
        return count

    def put(self, key: bytes, count: int) -> None:
        if key in self._counts:
            self._counts.move_to_end(key)
        else:
            self.key_bytes += len(key)
        self._counts[key] = count
        while self._counts and (len(self._counts) > self.max_entries or self.key_bytes > self.max_bytes):
            old, _ = self._counts.popitem(last=False)
            self.key_bytes -= len(old)

    def clear(self) -> None:
        """Another engine model (or tokenizer) may count differently: forget every count."""
        self._counts.clear()
        self.key_bytes = 0

    def __len__(self) -> int:
        return len(self._counts)
