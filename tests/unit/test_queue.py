"""The fair priority queue, driven directly: shares, priority order, shedding, and no ticket lost or duplicated."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.queue import AdmissionQueue, Pushed, QueueClass, Refused, Ticket
from gateway.tokens.cost import RequestCost


def ticket(
    tenant: str,
    tokens: int,
    priority: int = 1,
    weight: float = 1.0,
    max_queued: int | None = None,
    retry: bool = False,
) -> Ticket:
    cost = RequestCost((tokens // 2,), 1, tokens - tokens // 2, 1)
    return Ticket(cost, tenant, 0.0, 1e9, qclass=QueueClass(priority, weight, max_queued), retry=retry)


def test_fifo_inside_a_tenant() -> None:
    q = AdmissionQueue(100)
    ts = [ticket("a", random.Random(i).randint(1, 500)) for i in range(20)]
    for t in ts:
        q.push(t)
    assert [q.pop() for _ in ts] == ts


def test_equal_weights_flooder_gets_half_the_tokens_while_both_wait() -> None:
    """A sends 10x as many requests as B; while both have tickets queued each is served half the tokens."""
    q = AdmissionQueue(10_000)
    rng = random.Random(1)
    served = {"a": 0, "b": 0}
    for step in range(2000):
        for _ in range(10):
            q.push(ticket("a", rng.randint(100, 400)))
        if step % 1 == 0:
            q.push(ticket("b", rng.randint(100, 400)))
        for _ in range(2):  # service is slower than the arrivals: both stay backlogged
            t = q.pop()
            if q.tenant_len("b") and q.tenant_len("a"):
                served[t.tenant] += t.tokens
    share_b = served["b"] / (served["a"] + served["b"])
    assert 0.45 <= share_b <= 0.55, served


def test_weights_split_tokens_in_proportion() -> None:
    q = AdmissionQueue(10_000)
    for _ in range(300):
        q.push(ticket("heavy", 100, weight=3.0))
        q.push(ticket("light", 50, weight=1.0))
    served = {"heavy": 0, "light": 0}
    for _ in range(200):
        t = q.pop()
        served[t.tenant] += t.tokens
    assert 2.7 <= served["heavy"] / served["light"] <= 3.3, served


def test_an_idle_tenant_gets_no_credit_for_idling() -> None:
    q = AdmissionQueue(10_000)
    for _ in range(100):
        q.push(ticket("a", 100))
    for _ in range(50):
        q.pop()
    for _ in range(100):
        q.push(ticket("b", 100))
    # b arrives late: from now on it alternates with a instead of being served 50 in a row
    order = [q.pop().tenant for _ in range(20)]
    assert 8 <= order.count("b") <= 12, order


def test_strict_priority_between_classes() -> None:
    q = AdmissionQueue(100)
    q.push(ticket("s", 10, priority=2))
    q.push(ticket("n", 10, priority=1))
    q.push(ticket("c", 10, priority=0))
    assert [q.pop().tenant for _ in range(3)] == ["c", "n", "s"]
    assert not q.waiting_at_or_above(2)


def test_full_queue_sheds_sheddable_first_from_its_heaviest_tenant() -> None:
    q = AdmissionQueue(4)
    light, heavy = ticket("light", 10, 2), [ticket("heavy", 10, 2) for _ in range(2)]
    std = ticket("std", 10, 1)
    for t in (light, *heavy, std):
        assert isinstance(q.push(t), Pushed)
    out = q.push(ticket("crit", 10, 0))
    assert isinstance(out, Pushed) and out.shed == (heavy[-1],)
    assert isinstance(q.push(ticket("std2", 10, 1)), Pushed)  # sheds the remaining sheddable ones next
    assert isinstance(q.push(ticket("std3", 10, 1)), Pushed)
    assert q.push(ticket("std4", 10, 1)) == Refused("queue_full")  # nothing lower left to shed
    assert q.push(ticket("sh", 10, 2)) == Refused("queue_full")
    assert {t.priority for t in q} == {0, 1}


def test_tenant_queue_limit() -> None:
    q = AdmissionQueue(100)
    assert isinstance(q.push(ticket("a", 10, max_queued=1)), Pushed)
    assert q.push(ticket("a", 10, max_queued=1)) == Refused("tenant_queue_full")
    assert isinstance(q.push(ticket("b", 10, max_queued=1)), Pushed)


def test_position_counts_who_goes_first() -> None:
    q = AdmissionQueue(100)
    a1, a2, b1, c1 = ticket("a", 100), ticket("a", 100), ticket("b", 100), ticket("c", 100, priority=0)
    for t in (a1, a2, b1, c1):
        q.push(t)
    assert [q.position(t) for t in (c1, a1, b1, a2)] == [1, 2, 3, 4]
    assert q.position(ticket("x", 1)) == 0


def test_a_retry_goes_ahead_of_its_tenants_first_attempts_and_nobody_elses() -> None:
    """Tenant a has two first attempts queued, b one; a's retry takes a's first place, pushes a's own tickets
    back by its share, and b keeps its turn (it was first in line at the same virtual time)."""
    q = AdmissionQueue(100)
    a1, b1, a2 = ticket("a", 100), ticket("b", 100), ticket("a", 100)
    for t in (a1, b1, a2):
        q.push(t)
    retry = ticket("a", 100, retry=True)
    assert q.prospective_position("a", 1, retry=True) == 2 and q.prospective_position("a", 1) == 4
    q.push(retry)
    assert q.in_order() == [b1, retry, a1, a2] and q.position(retry) == 2
    assert [q.pop() for _ in range(4)] == [b1, retry, a1, a2]
    q.push(late := ticket("a", 100, retry=True))  # nothing of a's queued: a retry simply joins the line
    assert q.in_order() == [late]


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.sampled_from("abc"),
            st.integers(1, 1000),
            st.integers(0, 2),
            st.sampled_from([0.5, 1.0, 3.0]),
            st.booleans(),
        ),
        st.tuples(st.just("pop")),
        st.tuples(st.just("remove"), st.integers(0, 50)),
        st.tuples(st.just("expire"), st.floats(0, 100)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 12))
def test_no_ticket_lost_or_duplicated_and_order_holds(steps: list[tuple[object, ...]], max_length: int) -> None:
    q = AdmissionQueue(max_length)
    inside: list[Ticket] = []
    out: list[Ticket] = []  # every ticket that left, by any door
    pushed = 0
    for step in steps:
        if step[0] == "push":
            _, tenant, tokens, prio, weight, retry = step
            t = ticket(str(tenant), int(tokens), int(prio), float(weight), retry=bool(retry))  # type: ignore[arg-type]
            t.deadline = float(tokens) / 10
            expected_position = q.prospective_position(t.tenant, t.priority, t.retry)
            result = q.push(t)
            pushed += 1
            if isinstance(result, Pushed):
                assert q.position(t) == expected_position
                inside.append(t)
                for s in result.shed:
                    assert s.priority > t.priority
                    inside.remove(s)
                    out.append(s)
            else:
                out.append(t)
        elif step[0] == "pop" and inside:
            head = q.pop()
            inside.remove(head)
            # strict priority: nothing of a higher class was waiting; inside the tenant and class, retries first,
            # each kind in arrival order
            assert all(t.priority >= head.priority for t in inside)
            mine = [t for t in inside if t.tenant == head.tenant and t.priority == head.priority]
            assert all(t.id > head.id for t in mine if t.retry == head.retry)
            assert head.retry or not any(t.retry for t in mine)
            out.append(head)
        elif step[0] == "remove" and inside:
            victim = inside[int(step[1]) % len(inside)]  # type: ignore[call-overload]
            assert q.remove(victim) and not q.remove(victim)
            inside.remove(victim)
            out.append(victim)
        elif step[0] == "expire":
            for t in q.expired(float(step[1])):  # type: ignore[arg-type]
                inside.remove(t)
                out.append(t)
        assert len(q) == len(inside) <= max_length
        assert set(map(id, q)) == set(map(id, inside))
        for tenant in "abc":
            assert q.tenant_len(tenant) == sum(t.tenant == tenant for t in inside)
    assert len(out) + len(inside) == pushed
    assert len({id(t) for t in out + inside}) == pushed


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 400), min_size=40, max_size=40),
    st.lists(st.integers(1, 400), min_size=40, max_size=40),
    st.sampled_from([0.5, 1.0, 2.0]),
    st.sampled_from([0.5, 1.0, 2.0]),
)
def test_sfq_fairness_bound(a_sizes: list[int], b_sizes: list[int], wa: float, wb: float) -> None:
    """While both tenants are backlogged, normalized service differs by at most one max ticket each."""
    q = AdmissionQueue(1000)
    for x, y in zip(a_sizes, b_sizes, strict=True):
        q.push(ticket("a", x, weight=wa))
        q.push(ticket("b", y, weight=wb))
    served = {"a": 0.0, "b": 0.0}
    while q.tenant_len("a") and q.tenant_len("b"):
        t = q.pop()
        served[t.tenant] += t.tokens
        gap = abs(served["a"] / wa - served["b"] / wb)
        assert gap <= max(a_sizes) / wa + max(b_sizes) / wb + 1e-6
