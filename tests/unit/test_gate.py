from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.gate import HysteresisGate

usages = st.lists(st.floats(min_value=0, max_value=1, allow_nan=False), max_size=200)


def test_closes_at_high_and_reopens_only_at_low() -> None:
    gate = HysteresisGate(0.9, 0.8)
    assert gate.is_open
    assert not gate.observe(0.89)
    assert gate.observe(0.90) and not gate.is_open
    for u in (0.89, 0.85, 0.81, 0.95):
        assert not gate.observe(u) and not gate.is_open
    assert gate.observe(0.80) and gate.is_open


@given(usages)
def test_never_flaps_inside_the_band(samples: list[float]) -> None:
    gate = HysteresisGate(0.9, 0.8)
    for u in samples:
        before = gate.is_open
        changed = gate.observe(u)
        assert changed == (before != gate.is_open)
        if 0.8 < u < 0.9:
            assert not changed, f"state changed at {u}, inside the band"
        if changed and before:
            assert u >= 0.9
        if changed and not before:
            assert u <= 0.8


@given(usages)
def test_state_is_a_function_of_the_last_crossing(samples: list[float]) -> None:
    gate = HysteresisGate(0.9, 0.8)
    expected = True
    for u in samples:
        gate.observe(u)
        if u >= 0.9:
            expected = False
        elif u <= 0.8:
            expected = True
        assert gate.is_open == expected
