"""How many tokens a text prompt has, without tokenizing it: tokens per byte, learned from the engine's own
counts. Pure: no clock, no I/O.

Counting a prompt exactly costs 2-3.5 ms of CPU per 1,000 tokens with a local tokenizer (more than everything
else kvgate does for a request), or a round trip with ``/tokenize``. The count only changes a decision near a
limit (the context length, the pool's never-fits ceiling); far from them an estimate with an honest error band
decides the same, and the engine reports the exact count (``usage.prompt_tokens``) for every request anyway.
:class:`gateway.tokens.estimator.CostEstimator` checks a request's limits at the band's high end and, when even
that end is clearly inside them, prices it without tokenizing (:meth:`PromptLengths.reserved`); otherwise it
tokenizes it.

**What is measured** (:func:`prompt_sizes`): the UTF-8 bytes of what the tokenizer sees. For a plain prompt,
its text. For a chat, the messages and tools as JSON: every string a chat template may render (contents,
names, tool calls, tools), with the keys and punctuation of each message standing in for the template's
per-message framing, plus :data:`CHAT_OVERHEAD_BYTES` for its fixed part (BOS, a default system prompt, the
generation prompt). The template itself is never rendered: the learned ratio (tokens / size) absorbs what
the measure leaves out, and the band its variation. Content parts that are not text (images, audio) are not
described by bytes: such requests are always counted.

**The band** is split-conformal: over the last ``window`` ratios of a key, the high end is the
``ceil((1 - miss_rate) * (n + 1))``-th smallest, so a new request drawn from the same traffic lands above it
with probability at most ``miss_rate`` (``1 / (n + 1)`` while ``n`` is too small for that: see
:meth:`PromptLengths.miss_rate`), whatever the distribution; then widened by ``margin``, and never closer to
the median than ``min_spread``. The low end mirrors it. The guarantee is over the request mix, not per request
size: a rare kind of prompt (a long document in chat traffic) is covered only as far as the margin reaches; a
miss is caught by the engine (vLLM refuses a prompt past its context itself) and by the live usage gate.

Keys are (model, endpoint): chats and plain prompts are measured differently. Until a key has
``min_samples`` observations it answers the prior (:class:`Prior`), whose high end (one token per byte) no
byte-level BPE or byte-fallback tokenizer exceeds on text. Memory is bounded: ``window`` ratios per key and
``max_keys`` keys, the least recently observed dropped first.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.protocol.requests import InferenceRequest

Key = tuple[str, str]  # (model, endpoint)

CHAT_OVERHEAD_BYTES = 128  # a chat template's fixed part: ~30 tokens at 0.25 token/byte (Llama 3's date header)
PROMPT_OVERHEAD_BYTES = 8  # BOS and friends
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def key_of(request: InferenceRequest) -> Key:
    return (request.model or "", request.endpoint)


def prompt_sizes(request: InferenceRequest) -> tuple[int, ...] | None:
    """The measure of each prompt (one for a chat), in bytes; None when bytes do not describe it: token ids
    (exact and free to count anyway), or a chat with non-text content parts."""
    if request.messages is not None:
        if not text_only(request.messages):
            return None
        try:
            size = len(orjson.dumps(request.messages)) + CHAT_OVERHEAD_BYTES
            if request.tools:
                size += len(orjson.dumps(request.tools))
            if request.template_kwargs:
                size += len(orjson.dumps(request.template_kwargs))
        except TypeError:  # orjson.JSONEncodeError: not JSON (built in code, not parsed from a body)
            return None
        return (size,)
    if not request.prompts or not all(isinstance(p, str) for p in request.prompts):
        return None
    return tuple(_utf8_len(p) + PROMPT_OVERHEAD_BYTES for p in request.prompts if isinstance(p, str))


def text_only(messages: list[dict[str, Any]]) -> bool:
    """No content part other than text: images and audio are not described by bytes."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type") not in _TEXT_PARTS for part in content
        ):
            return False
    return True


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))  # isascii() is O(1)


@dataclass(frozen=True, slots=True)
class TokenBand:
    """A prompt's estimated tokens and where the truth lies: ``low <= tokens <= high`` but at the learner's
    miss rate. ``samples``: the observations behind it (0: the prior)."""

    low: int
    estimate: int
    high: int
    samples: int


@dataclass(frozen=True, slots=True)
class Prior:
    """Tokens per byte before anything is learned. English is ~0.25, code ~0.3, CJK ~0.35-0.5; ``high`` is
    the most a byte-level BPE (or a byte-fallback SentencePiece) makes of text: one token per byte."""

    ratio: float = 0.28
    low: float = 0.05
    high: float = 1.0


RESERVE_REFRESH = 128  # observations between two computations of a key's byte-weighted reserve ratio


class _Window:
    """The last ``size`` ratios, in arrival order (to evict, with their prompts' sizes) and sorted (to answer
    by rank, with each one's prompt size alongside: the byte-weighted reserve); and the reserve ratio last
    computed from them."""

    def __init__(self, size: int) -> None:
        self.order: deque[tuple[float, int]] = deque()  # (ratio, prompt bytes)
        self.sorted: list[float] = []
        self.sorted_bytes: list[int] = []  # the prompt bytes of each ratio in ``sorted``, in its place
        self._size = size
        self.reserve: tuple[float, float] | None = None  # (quantile, byte-weighted ratio at it)
        self.added_since_reserve = 0
        self.ratios: tuple[float, float, float] | None = None  # (low, typical, high) since the last add

    def add(self, value: float, size: int) -> None:
        if len(self.order) == self._size:
            old, old_size = self.order.popleft()
            lo = bisect.bisect_left(self.sorted, old)
            at = self.sorted_bytes.index(old_size, lo, bisect.bisect_right(self.sorted, old, lo))
            del self.sorted[at], self.sorted_bytes[at]
        self.order.append((value, size))
        at = bisect.bisect_right(self.sorted, value)
        self.sorted.insert(at, value)
        self.sorted_bytes.insert(at, size)
        self.added_since_reserve += 1
        self.ratios = None

    def byte_weighted(self, quantile: float) -> float:
        """The ratio below which ``quantile`` of the window's prompt *bytes* lie: what the pool fills with is
        tokens, so a kind of prompt that is both long and dense weighs as much as it fills. Recomputed every
        ``RESERVE_REFRESH`` observations, cached in between."""
        if self.reserve is None or self.reserve[0] != quantile or self.added_since_reserve >= RESERVE_REFRESH:
            running = list(itertools.accumulate(self.sorted_bytes))
            at = bisect.bisect_left(running, quantile * running[-1])
            self.reserve = (quantile, self.sorted[min(at, len(running) - 1)])
            self.added_since_reserve = 0
        return self.reserve[1]


class PromptLengths:
    """Tokens per byte of text prompts, per key, from (size, tokens the engine counted) pairs."""

    def __init__(
        self,
        *,
        window: int = 2048,
        min_samples: int = 200,
        miss_rate: float = 0.001,
        margin: float = 0.05,
        min_spread: float = 0.05,
        max_keys: int = 64,
        prior: Prior | None = None,
    ) -> None:
        prior = prior or Prior()
        if not 1 <= min_samples <= window or max_keys < 1:
            raise ValueError("need 1 <= min_samples <= window and max_keys >= 1")
        if not 0 < miss_rate < 0.5 or margin < 0 or min_spread < 0:
            raise ValueError("need 0 < miss_rate < 0.5, margin >= 0 and min_spread >= 0")
        if not 0 < prior.low <= prior.ratio <= prior.high:
            raise ValueError("need 0 < prior.low <= prior.ratio <= prior.high")
        self.window = window
        self.min_samples = min_samples
        self.alpha = miss_rate
        self.margin = margin
        self.min_spread = min_spread
        self.max_keys = max_keys
        self.prior = prior
        self._keys: OrderedDict[Key, _Window] = OrderedDict()

    def observe(self, key: Key, size: int, tokens: int) -> None:
        """One served prompt: its measure and the tokens the engine counted. Nonsense (<= 0) teaches nothing."""
        if size <= 0 or tokens <= 0:
            return
        window = self._keys.get(key)
        if window is None:
            window = self._keys[key] = _Window(self.window)
            if len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        window.add(tokens / size, size)

    def samples(self, key: Key) -> int:
        window = self._keys.get(key)
        return len(window.order) if window is not None else 0

    def learned(self, key: Key) -> bool:
        return self.samples(key) >= self.min_samples

    def miss_rate(self, key: Key) -> float | None:
        """How often a new prompt falls above the band's high end (or below its low end), at most, before the
        margin widens it; None while the key answers the prior (no guarantee but the prior's own)."""
        n = self.samples(key)
        return (n + 1 - self._high_rank(n)) / (n + 1) if n >= self.min_samples else None

    def ratios(self, key: Key) -> tuple[float, float, float]:
        """(low, typical, high) tokens per byte for ``key``: learned, or the prior."""
        window = self._keys.get(key)
        n = len(window.order) if window is not None else 0
        if window is None or n < self.min_samples:
            return self.prior.low, self.prior.ratio, self.prior.high
        if window.ratios is not None:  # pricing asks for them per request; they change only as the window does
            return window.ratios
        ranked = window.sorted
        typical = ranked[n // 2]
        low_rank = max(1, n + 1 - self._high_rank(n))  # the mirror image of the high rank
        high = max(ranked[self._high_rank(n) - 1] * (1 + self.margin), typical * (1 + self.min_spread))
        low = min(ranked[low_rank - 1] * (1 - self.margin), typical * (1 - self.min_spread))
        window.ratios = (max(0.0, low), typical, high)
        return window.ratios

    def reserved(self, key: Key, size: int, quantile: float) -> int:
        """Tokens to reserve for a prompt of ``size`` bytes (the prior's typical ratio while there are too few
        observations). The ``quantile`` of the learned ratios, or of the ratios weighted by prompt bytes when
        that is higher: per prompt above the median, and over the dozens of prompts an engine holds at once
        above their true total, as with output lengths, also when long prompts are denser than short ones
        (long code or CJK documents among short English chat turns)."""
        window = self._keys.get(key)
        if window is None or len(window.order) < self.min_samples:
            return round(self.prior.ratio * size)
        ranked = window.sorted
        by_count = ranked[min(len(ranked) - 1, int(quantile * len(ranked)))]
        return math.ceil(max(by_count, window.byte_weighted(quantile)) * size)

    def high(self, key: Key, size: int) -> int:
        """The band's high end alone (what the fast path checks limits at)."""
        return math.ceil(self.ratios(key)[2] * size)

    def band(self, key: Key, size: int) -> TokenBand:
        low, typical, high = self.ratios(key)
        return TokenBand(math.floor(low * size), round(typical * size), math.ceil(high * size), self.samples(key))

    def _high_rank(self, n: int) -> int:
        """1-based rank of the conformal upper bound among ``n`` sorted ratios (the largest at most)."""
        return min(n, math.ceil((1 - self.alpha) * (n + 1) - 1e-9))

    def __len__(self) -> int:
        return len(self._keys)


# actual / estimated tokens: a few buckets either side of 1
ERROR_BUCKETS: tuple[float, ...] = (0.5, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0)


@dataclass(slots=True)
class EstimateErrors:
    """How far the estimate was from the engine's count (actual / estimated), as a fixed-bucket histogram:
    ``counts[i]`` holds the ratios in ``(bounds[i-1], bounds[i]]``, the last entry those past ``bounds[-1]``
    (Prometheus wants :meth:`cumulative`). ``above_high``: prompts past the band's high end, which the fast path
    would have priced short."""

    bounds: tuple[float, ...] = ERROR_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(ERROR_BUCKETS) + 1))
    total: float = 0.0  # the sum of the ratios
    count: int = 0
    above_high: int = 0

    def record(self, tokens: int, band: TokenBand) -> None:
        ratio = tokens / max(1, band.estimate)
        self.counts[bisect.bisect_left(self.bounds, ratio)] += 1
        self.total += ratio
        self.count += 1
        self.above_high += tokens > band.high

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or under it), ending with (inf, count)."""
        running, out = 0, []
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out
