"""Prefix affinity: a request whose prompt starts like an earlier one's goes to the engine that served it, so
vLLM's prefix cache (on by default in V1) finds those blocks there instead of computing them again elsewhere.

Multi-turn chats resend the whole conversation, and many requests share a system prompt: on the engine that
saw the prefix, its prefill costs nothing and its blocks are shared. A pool that places by headroom alone
scatters such requests. Affinity is only a tie-breaker: the affine engine is taken only when the request fits
there and its projected usage after the request is at most ``max_headroom_cost`` above the best engine's
(:meth:`gateway.admission.controller.AdmissionController.place`), so it never costs safety and bounds what it
may cost in balance.

The prompt is not tokenized for this: its leading bytes (:func:`gateway.protocol.prompt_prefix.leading_bytes`)
are cut into fixed chunks and hashed as a chain (each
hash covers everything before it, as vLLM's block hashes do), and the longest chain seen before names the
engine. Only whole chunks count, as only whole blocks are cached. Pure, bounded memory: the most recent
``max_entries`` chunk hashes.
"""

from __future__ import annotations

from collections import OrderedDict


def prefix_chain(data: bytes, chunk_bytes: int, max_chunks: int, seed: str = "") -> tuple[int, ...]:
    """Hashes of ``data``'s leading whole chunks, each covering every chunk before it too (and ``seed``: whose
    prefix cache the prompt may hit, when tenants' caches are kept apart)."""
    chain: list[int] = []
    running = hash(seed) if seed else 0
    for start in range(0, min(len(data) // chunk_bytes, max_chunks) * chunk_bytes, chunk_bytes):
        running = hash((running, data[start : start + chunk_bytes]))
        chain.append(running)
    return tuple(chain)


SHARED = "\x00shared"  # a chunk taken by more than one engine (no engine is named so): it prefers none


class PrefixMap:
    """Which engine took each chunk hash (or :data:`SHARED`); the least recently used forgotten first beyond
    ``max_entries``. A prefix every request starts with (a system prompt) soon reaches every engine and stops
    deciding anything: only what follows it, a conversation's own turns, still points somewhere."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._engine_of: OrderedDict[int, str] = OrderedDict()

    def lookup(self, chain: tuple[int, ...]) -> tuple[str, int] | None:
        """The engine that took the longest known prefix of ``chain``, and how many chunks of it matched; None
        when nothing of it is known, or its longest known part is on several engines."""
        for depth in range(len(chain), 0, -1):
            engine = self._engine_of.get(chain[depth - 1])
            if engine is not None:
                return None if engine == SHARED else (engine, depth)
        return None

    def record(self, chain: tuple[int, ...], engine: str) -> None:
        """``engine`` took a request with this prefix: it now holds (or will) these blocks in its cache."""
        entries = self._engine_of
        for h in chain:
            known = entries.get(h)
            entries[h] = engine if known is None or known == engine else SHARED
            entries.move_to_end(h)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._engine_of)
