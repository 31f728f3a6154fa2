"""The hysteresis gate: closes at the high watermark, reopens only at the low one.

Without the gap between the two, a gate at a single threshold flaps open and shut with every scrape while
usage hovers near it, letting a burst through on each flap.
"""

from __future__ import annotations


class HysteresisGate:
    def __init__(self, high: float = 0.90, low: float = 0.80) -> None:
        if not 0 < low < high <= 1:
            raise ValueError(f"need 0 < low < high <= 1, got low={low} high={high}")
        self.high = high
        self.low = low
        self.is_open = True

    def observe(self, usage: float) -> bool:
        """Feed one usage sample (0..1). Returns True when the state changed."""
        if self.is_open and usage >= self.high:
            self.is_open = False
            return True
        if not self.is_open and usage <= self.low:
            self.is_open = True
            return True
        return False
