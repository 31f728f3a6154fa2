"""Two gateway replicas admitting to one engine as one client (``exclusive_upstream`` with shared books): the
books are modelled here as the Redis scripts keep them (each replica at the peak it last said, plus what it
claimed since), the engine as continuous batching does. However the replicas' admissions,
samples and restates interleave, and in whatever order a replica's restates reach the books, what the engine
really holds never exceeds the high watermark."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings, target
from hypothesis import strategies as st

from gateway.admission.controller import AdmissionController, Admitted, Queued, UsageSample
from gateway.admission.engine import EngineBook
from gateway.admission.ledger import ENGINE_LEAD_TOKENS, Reservation
from gateway.config import AdmissionConfig
from gateway.tokens.cost import KvGeometry, RequestCost

GEO = KvGeometry(block_size=16, num_blocks=100)
CAP = 90  # the high watermark's blocks


@dataclass
class Books:
    """The shared engine books for one engine, weighed without a sample: each replica's members, and the peak
    it last said of its reservations up to some id (a late restate's peak is not taken over a newer one)."""

    members: dict[int, dict[int, int]] = field(default_factory=lambda: {0: {}, 1: {}})
    peaks: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # replica -> (number, peak, upto)

    def others(self, replica: int) -> int:
        total = 0
        for r, held in self.members.items():
            if r == replica:
                continue
            _, peak, upto = self.peaks.get(r, (0, 0, -1))
            total += peak + sum(blocks for rid, blocks in held.items() if rid > upto)
        return total

    def claim(self, replica: int, res: Reservation, limit: int) -> tuple[bool, int]:
        seen = self.others(replica)
        if seen > limit:
            return False, seen
        self.members[replica][res.id] = res.blocks
        return True, seen

    def restate(self, message: Restate) -> int:
        """A full restate lists every member up to its ``upto``; a release names one that ended."""
        members = self.members[message.replica]
        if message.held is not None:
            later = {rid: blocks for rid, blocks in members.items() if rid > message.upto}
            self.members[message.replica] = {**later, **message.held}
        if message.gone is not None:
            members.pop(message.gone, None)
        if message.number > self.peaks.get(message.replica, (0, 0, 0))[0]:
            self.peaks[message.replica] = (message.number, message.peak, message.upto)
        return self.others(message.replica)


@dataclass
class Restate:
    replica: int
    held: dict[int, int] | None
    gone: int | None
    number: int
    peak: int
    upto: int


class Replica:
    def __init__(self, index: int, books: Books) -> None:
        config = AdmissionConfig(exclusive_upstream=True, queue_max_wait_s=1e9, growth_model="lockstep")
        self.index = index
        self.books = books
        self.controller = AdmissionController(config, GEO, shared_books=True)
        self.book: EngineBook = next(iter(self.controller.engines.values()))
        self.tickets: list = []
        self.outbox: list[Restate] = []  # restates on their way to the books, in any order
        self.numbers = 0

    def restate(self, held: bool, gone: int | None = None) -> None:
        """Taken now (as the admitter's task does before it awaits Redis), delivered later, in any order."""
        members = {res.id: res.blocks for res in self.book.ledger.live()} if held else None
        self.numbers += 1
        peak = self.book.shared_peak()
        self.outbox.append(Restate(self.index, members, gone, self.numbers, peak, self.book.ledger.last_id))

    def deliver(self, which: int) -> None:
        if self.outbox:
            message = self.outbox.pop(which % len(self.outbox))
            self.book.others_blocks = self.books.restate(message)

    def claimed(self, res: Reservation, now: float) -> bool:
        ok, seen = self.books.claim(self.index, res, self.book.room_for_others(now))
        self.book.others_blocks = seen
        if not ok:
            self.controller.release(res, now, finished=False)
            self.restate(held=False, gone=res.id)
        return ok


ops = st.lists(
    st.one_of(
        st.tuples(st.just("burst"), st.integers(0, 1), st.integers(1, 30), st.integers(1, 30), st.integers(1, 6)),
        st.tuples(st.just("step"), st.integers(1, 40), st.integers(0, ENGINE_LEAD_TOKENS), st.just(0), st.just(0)),
        st.tuples(st.just("sample"), st.integers(0, 1), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("deliver"), st.integers(0, 1), st.integers(0, 20), st.just(0), st.just(0)),
        st.tuples(st.just("pump"), st.integers(0, 1), st.just(0), st.just(0), st.just(0)),
    ),
    max_size=150,
)


@settings(max_examples=400, deadline=None)
@given(script=ops)
def test_replicas_sharing_books_never_overrun_the_engine_together(script: list[tuple[str, int, int, int, int]]) -> None:
    books = Books()
    replicas = [Replica(0, books), Replica(1, books)]
    now = 0.0
    highest = 0  # steers the search towards a full engine, where an overrun would be
    live: dict[tuple[int, int], Reservation] = {}  # (replica, id) -> reservation, in the engine
    generated: dict[tuple[int, int], int] = {}  # per sequence, as the engine has it

    def engine_blocks() -> int:
        return sum(res.cost.blocks_after(generated[key] * res.cost.num_sequences, 16) for key, res in live.items())

    def admitted(replica: Replica, res: Reservation) -> None:
        if replica.claimed(res, now):
            replica.controller.placed(res)
            live[(replica.index, res.id)] = res
            generated[(replica.index, res.id)] = 0

    def pump(replica: Replica) -> None:
        for ticket, res in replica.controller.pump(now):
            replica.tickets.remove(ticket)
            admitted(replica, res)

    for replica in replicas:  # each has had one sample, and one answer from the books
        replica.controller.begin_sample()
        replica.controller.apply_sample(UsageSample(usage=0.0, taken_at=0.0))
        replica.restate(held=True)
        replica.deliver(0)

    for op, a, b, c, n in script:
        if op == "burst":
            replica = replicas[a]
            cost = RequestCost((b * 4,), 1, c * 4, (b * 4 + c * 4 + 15) // 16)
            for _ in range(n):
                decision = replica.controller.submit(cost, "t", now)
                if isinstance(decision, Admitted):
                    admitted(replica, decision.reservation)
                elif isinstance(decision, Queued):
                    replica.tickets.append(decision.ticket)
        elif op == "step":
            for _ in range(a):
                now += 0.001
                for (index, rid), res in list(live.items()):
                    owner = replicas[index]
                    generated[(index, rid)] += 1
                    if generated[(index, rid)] >= res.cost.max_output:
                        del live[(index, rid)]
                        owner.controller.release(res, now)
                        owner.restate(held=False, gone=rid)
                    else:  # each replica sees its streams up to ENGINE_LEAD_TOKENS tokens late
                        lag = (b * rid + rid // 3) % (ENGINE_LEAD_TOKENS + 1)
                        owner.controller.progress(res, max(0, generated[(index, rid)] - lag), now)
                assert engine_blocks() <= CAP
        elif op == "sample":
            replica = replicas[a]
            replica.controller.begin_sample()
            replica.controller.apply_sample(UsageSample(usage=engine_blocks() / 100, taken_at=now))
            replica.restate(held=True)
        elif op == "deliver":
            replicas[a].deliver(b)
        elif op == "pump":
            pump(replicas[a])
        assert engine_blocks() <= CAP, (engine_blocks(), books)
        highest = max(highest, engine_blocks())
    target(float(highest))
    for replica in replicas:
        for (index, _), res in live.items():
            if index == replica.index:
                replica.controller.release(res, now)
        assert len(replica.book.ledger) == 0
