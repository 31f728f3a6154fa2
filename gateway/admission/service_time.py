"""How long an admitted request takes to be answered, from the requests answered lately. Pure.

A client that reads a whole answer at once (not a stream) under a read timeout, as the OpenAI SDKs do, gets
nothing until the engine has generated all of it: admitted after waiting most of its timeout, it times out
while the engine decodes it, and the SDK sends it again. The engine did the work twice for no answer. So the
time such a request may wait in the queue is its timeout less the time it will then take to be answered:
its expected output length at the pace answers have lately come at (prefill and queueing in the engine
included, from admission to the last byte).

The pace is the median of the latest answers' seconds per output token, counting only answers long enough for
their decoding to outweigh their prefill. It errs short rather than long: a wait budget cut too far refuses a
request that would have been served, one cut too little only leaves things as they were.
"""

from __future__ import annotations

from collections import deque
from statistics import median

MIN_TOKENS = 16  # shorter answers are mostly prefill: their seconds per token say little about decoding
MIN_SAMPLES = 8  # answers needed before the pace is trusted
WINDOW = 64  # the latest answers: the pace follows the engine's load as it changes


class ServicePace:
    """Seconds per output token of the latest answers (admission to last byte)."""

    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self._per_token: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self._median: float | None = None

    def __len__(self) -> int:
        return len(self._per_token)

    def observe(self, output_tokens: int, seconds: float) -> None:
        """An answer of ``output_tokens`` that took ``seconds`` from admission to its end."""
        if output_tokens < MIN_TOKENS or seconds <= 0:
            return
        self._per_token.append(seconds / output_tokens)
        self._median = None

    def seconds_per_token(self) -> float | None:
        """The median pace, or None while too few answers are known."""
        if len(self._per_token) < self.min_samples:
            return None
        if self._median is None:
            self._median = median(self._per_token)
        return self._median

    def answer_s(self, output_tokens: int) -> float:
        """Seconds an answer of ``output_tokens`` is expected to take once admitted; 0 while unknown."""
        pace = self.seconds_per_token()
        return 0.0 if pace is None else pace * output_tokens
