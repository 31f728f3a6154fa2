"""Run summaries: counters across engine restarts, time in a usage band, and the engine-clock remap."""

from __future__ import annotations

import math

import pytest

from loadtests.stats import RequestRecord, Sample, counter_increase, time_fraction, to_engine_time


def test_counter_increase_survives_a_reset() -> None:
    # 0 -> 5 -> 7, engine restarts (counter back to 0) -> 3: increase is 7 + 3.
    assert counter_increase([0, 5, 7, math.nan, 0, 3]) == 10


def test_time_fraction_counts_down_time_as_outside() -> None:
    samples = [
        Sample(0, True, 0.85),
        Sample(1, True, 0.95),
        Sample(2, False),
        Sample(4, True, 0.82),
        Sample(5, True, 0.5),
    ]
    inside, frac = time_fraction(samples, 0.80, 0.90)
    assert inside == 2 and frac == pytest.approx(2 / 5)


def test_to_engine_time_uses_the_simulator_clock() -> None:
    # The engine clock ran at half speed between client times 0 and 10 (CPU lag), then at full speed.
    samples = [Sample(0, True, clock=100.0), Sample(10, True, clock=105.0), Sample(20, True, clock=115.0)]
    rec = RequestRecord(0, "c", None, sent=2.0, prompt_tokens=1, max_tokens=1, status=200, ttft=8.0, latency=18.0)
    (out,), remapped = to_engine_time([rec], samples)
    assert [s.t for s in remapped] == [0.0, 5.0, 15.0]
    assert out.sent == pytest.approx(1.0)
    assert out.ttft == pytest.approx(5.0 - 1.0)
    assert out.latency == pytest.approx(15.0 - 1.0)
