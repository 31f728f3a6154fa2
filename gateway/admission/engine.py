"""One engine's books: its gate, its ledger, its geometry and its last sample. Pure: time comes in as ``now``.

Each engine of a pool is its own truth: vLLM pods may differ in pool size (``cache_config_info``), each is
scraped on its own, and a request placed on one holds blocks there only. Projected usage, in blocks, is what
the engine may hold if we admit this request:

* ``A`` = the last sample + the ledger's outstanding blocks (requests admitted since that sample, and the
  output that in-flight requests may still grow into) + this request;
* when the gateway is the engine's only client (``exclusive_upstream``), also ``B`` = every block the ledger
  has reserved + this request, a hard upper bound that, unlike ``A``, drops the moment a request ends. Gateway
  replicas that share their books (Redis) are one client: ``B`` then adds the other replicas' claims (each
  replica's at the peak it last said, plus what it claimed since, whole), or what the sample shows beyond all
  this replica has reserved if that is more (a replica that lost Redis, or claims a restarted Redis forgot,
  still show there); while the shared books cannot say, ``B`` is no bound and ``A`` decides.

A request fits when the gate is open and ``min(A, B) <= high x total``, or, if its reservation alone is more
than that (a whole output budget on a pool of about one context, while no output estimate is learned), when
nothing else of the gateway's is on the engine and it fits the whole pool. With stale metrics the ``ledger``
policy admits against ``B`` alone under a lower cap; ``hold`` admits nothing.

An engine of a pool that refuses connections, or whose scrapes keep failing, is *ejected*: nothing is placed
on it for a backoff that doubles with each ejection in a row (1 s up to 60 s), and it rejoins with its first
good sample after that. An engine whose counters went backwards restarted: whatever the ledger held there
died with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission.gate import HysteresisGate
from gateway.admission.ledger import Ledger, Reservation
from gateway.config import AdmissionConfig
from gateway.tokens.cost import KvGeometry

EJECT_BASE_S = 1.0
EJECT_MAX_S = 60.0
BUSY_HOLD_S = 30.0  # a busy hold lasts this long after the engine's latest refusal
SCRAPE_FAILURES_TO_EJECT = 3  # in a row: one lost scrape is noise, three are an engine in trouble

# Of the engine's pool: how far the ledger's peak bound may overstate (one block per decoding sequence) before
# the exact count (three times the bound's CPU) is worth it at every admission decision.
BOUND_SLACK = 0.005


@dataclass(frozen=True, slots=True)
class SampleMark:
    """Which moment of an engine's life a sample shows, comparable between gateway replicas without trusting
    their clocks: the engine's process (its start time) and the tokens it had processed by then. Every step
    that grows a request's blocks past what its client has been sent counts tokens before the client hears of
    them, so a sample of the same process whose count is at least another's shows everything the other showed
    of every request still running and not preempted since (the shared books' scripts compare them so)."""

    process: float
    tokens: float


@dataclass(frozen=True, slots=True)
class UsageSample:
    """One scrape of the engine, already aggregated over data-parallel engines. ``started_at`` is when the
    engine's process started (None when it does not say); with ``served`` (requests it finished, a counter)
    and ``preemptions`` it tells a restart from a busy engine. ``tokens``: prompt and generated tokens the
    engine has processed (None when it does not say)."""

    usage: float
    taken_at: float
    geometry: KvGeometry | None = None
    running: float = 0.0
    waiting: float = 0.0
    preemptions: float = 0.0
    served: float = 0.0
    started_at: float | None = None
    tokens: float | None = None
    multi_token_steps: bool = False  # speculative decoding: a stream's events are a floor of its tokens

    @property
    def mark(self) -> SampleMark | None:
        if self.started_at is None or self.tokens is None:
            return None
        return SampleMark(self.started_at, self.tokens)

    def restarted_since(self, previous: UsageSample) -> bool:
        if self.started_at is not None and previous.started_at is not None:
            return self.started_at != previous.started_at
        return self.served < previous.served or self.preemptions < previous.preemptions


@dataclass(frozen=True, slots=True)
class SampleVerdict:
    """What a sample said beyond the numbers: trouble our reservations may have caused (preemptions, or usage
    well past the high watermark, while requests of ours were in flight), and whether the engine restarted
    (``lost``: the reservations that died with it, released here)."""

    trouble: bool
    lost: tuple[Reservation, ...] = ()


class EngineBook:
    def __init__(
        self, name: str, config: AdmissionConfig, geometry: KvGeometry | None = None, shared: bool = False
    ) -> None:
        self.name = name
        self.config = config
        self.gate = HysteresisGate(config.high_watermark, config.low_watermark)
        self.geometry = geometry
        self.ledger = Ledger(geometry.block_size if geometry else 16)
        self.sample: UsageSample | None = None
        self._geometry_pinned = geometry is not None
        # Other gateway replicas' blocks here that the last sample may not show: None while the shared books
        # (``shared``) have not said, or cannot say now; always 0 for a gateway that shares no books.
        self.others_blocks: int | None = None if shared else 0
        self.shared = shared
        self.leaving = False  # gone from discovery: nothing new is placed here; dropped once its ledger is empty
        # its KV blocks are another size than the pool's (a rolling update changing --block-size): requests are
        # priced in the pool's blocks, so none is placed here until its size is the pool's
        self.other_block_size = False
        self.ejected_until: float | None = None
        self.down = False  # its latest connection (a request's, a scrape's) was refused: until a good sample
        self.rejoined_at: float | None = None
        self.ejections_in_a_row = 0
        self.scrape_failures = 0
        # it turned a request away, its own queue full (vLLM's --max-num-queued-reqs caps its unfinished
        # requests, waiting and running): how many it then held, and until when that cap stands (hold_busy)
        self.busy_cap: int | None = None
        self._busy_until = 0.0
        self._others = 0  # unfinished requests in the engine that are not ours, at the latest sample
        # counters for the metrics, kept here so that they leave with the engine (label values stay bounded)
        self.restarts = 0
        self.placements = 0
        self.ejections = {"scrape": 0, "connect": 0}

    # --- telemetry in -------------------------------------------------------------------------------

    def begin_sample(self) -> None:
        self.ledger.begin_sample()

    def apply_sample(self, sample: UsageSample) -> SampleVerdict:
        if sample.geometry is not None and not self._geometry_pinned:
            self.geometry = sample.geometry
            self.ledger.set_block_size(sample.geometry.block_size)
        previous = self.sample
        self.sample = sample
        self.scrape_failures = 0
        self.down = False
        if self.ejected_until is not None and sample.taken_at >= self.ejected_until:
            self.ejected_until = None  # healthy again after its backoff: it rejoins
            self.rejoined_at = sample.taken_at
        elif self.rejoined_at is not None and sample.taken_at - self.rejoined_at >= EJECT_MAX_S:
            self.ejections_in_a_row = 0  # healthy for as long as the longest backoff: the next one starts short
            self.rejoined_at = None
        lost: tuple[Reservation, ...] = ()
        if previous is not None and sample.restarted_since(previous):
            self.restarts += 1
            # what was admitted before the old process's last sample was sent to it and died with it; what came
            # later may be running on the new one (it is released by its own request if it died too)
            lost = self.ledger.drop_admitted_before(previous.taken_at)
        self.ledger.commit_sample()
        self.gate.observe(sample.usage)
        unfinished = round(sample.running + sample.waiting)
        self._others = max(0, unfinished - len(self.ledger))
        if self.busy_cap is not None:  # it held that many at once: its cap is no lower (a cap set from a sample
            self.busy_cap = max(self.busy_cap, unfinished)  # that missed others' burst would never lift)
        preempted = previous is not None and not lost and sample.preemptions > previous.preemptions
        # Usage a block or two past the watermark is rounding; halfway to a full pool is an overshoot.
        overshoot = sample.usage > (1 + self.config.high_watermark) / 2
        # Only trouble our own estimates could have caused: with nothing of ours in flight, a preempting engine
        # is someone else's doing (traffic around the gateway), and reserving more would not help.
        return SampleVerdict(len(self.ledger) > 0 and (preempted or overshoot), lost)

    def scrape_failed(self, now: float, pooled: bool, refused: bool = False) -> bool:
        """A scrape failed (``refused``: its connection was); in a pool (``pooled``), the third in a row ejects
        the engine. True if it did."""
        self.scrape_failures += 1
        self.down = refused
        if pooled and self.scrape_failures >= SCRAPE_FAILURES_TO_EJECT and not self.ejected:
            self.eject(now, "scrape")
            return True
        return False

    def hold_busy(self, now: float) -> None:
        """The engine turned a request away as busy: its unfinished requests (waiting and running, ours and
        others') reached its cap (vLLM's --max-num-queued-reqs). That cap is taken as what it held then, the
        refused one aside (ours in flight, and others' as the latest sample showed them), and for
        ``BUSY_HOLD_S`` after the refusal nothing more is admitted here while that many are in it: each
        admission would only be turned away in its turn, and the queue here emptied into 503s. A request of
        ours that ends makes room at once; one of others', at the next sample, and the cap is never below what a
        sample showed it holding. On an engine that refuses everything (cap 0) nothing is sent for
        ``BUSY_HOLD_S`` at a time: each request waits its budget and then hears it was busy."""
        self.busy_cap = max(0, len(self.ledger) - 1 + self._others)  # the refused one is still in the ledger
        self._busy_until = now + BUSY_HOLD_S

    def busy_full(self, now: float) -> bool:
        """Held by :meth:`hold_busy`, and as full as when it refused."""
        if self.busy_cap is None:
            return False
        if now >= self._busy_until:
            self.busy_cap = None  # no refusal for a while: whatever it was, it may have room now
            return False
        return len(self.ledger) + self._others >= self.busy_cap

    # --- health -------------------------------------------------------------------------------------

    def eject(self, now: float, reason: str) -> float:
        """Place nothing here for a backoff that doubles with each ejection in a row; returns the backoff.
        ``reason``: scrape (its metrics kept failing) or connect (it refused a request's connection)."""
        self.ejections[reason] += 1
        if reason == "connect":
            self.down = True
        backoff = min(EJECT_MAX_S, EJECT_BASE_S * 2.0**self.ejections_in_a_row)
        self.ejections_in_a_row += 1
        self.ejected_until = now + backoff
        return backoff

    @property
    def ejected(self) -> bool:
        """Ejected until its backoff is over and a good sample has come in since."""
        return self.ejected_until is not None

    @property
    def events_are_tokens(self) -> bool:
        """Each stream event of this engine is one token (at ``--stream-interval 1``): not with speculative
        decoding, whose steps emit several."""
        return self.sample is None or not self.sample.multi_token_steps

    @property
    def placeable(self) -> bool:
        return not self.leaving and not self.ejected and not self.other_block_size

    # --- the decision -------------------------------------------------------------------------------

    def is_stale(self, now: float) -> bool:
        return self.sample is None or now - self.sample.taken_at > self.config.stale_after_s

    def projected_blocks(self, extra_blocks: int, now: float) -> int | None:
        """Blocks the engine may hold if ``extra_blocks`` more are admitted; None if unknowable."""
        if self.geometry is None:
            return None
        ledger = self.ledger
        others = self.others_blocks or 0
        if self.is_stale(now):  # no fresh picture of the engine: trust nothing but reservations, if they bound it
            if self.config.stale_policy != "ledger" or not self._ledger_bounds_engine():
                return None
            return ledger.reserved_blocks + extra_blocks + others
        lockstep = self.config.growth_model == "lockstep"
        if lockstep:
            ours = ledger.peak_blocks(slack_blocks=int(BOUND_SLACK * self.geometry.num_blocks))
        else:
            ours = ledger.reserved_blocks
        assert self.sample is not None
        sampled = round(self.sample.usage * self.geometry.num_blocks)
        if self.config.exclusive_upstream and (self.others_blocks is not None or not self.shared):
            # The engine is ours (and the other replicas' claims'), but the sample still bounds the ledger from
            # below: what it shows beyond what the ledger counted then is real and not in the ledger (answers
            # that outgrew an expected-output reservation unseen: not streamed, or several tokens per event; a
            # kvgate process's requests before it restarted; claims a replica that lost Redis, or a restarted
            # Redis, does not show). Under lockstep what the ledger counted is its model of that moment, not
            # the whole reservations: streams whose events ran behind their tokens (vLLM merges the deltas a busy
            # API server has not sent; a relay held up by a slow client) hold more than the model grows them
            # from, and will go on holding it. Reservations released since do not count against it: a finished
            # request's room is refilled at once, not a scrape later.
            counted = ledger.sample_modelled_blocks if lockstep else ledger.sample_reserved_blocks
            beyond = sampled - counted
            return ours + extra_blocks + max(others, beyond)
        # Whatever the sample shows beyond what we know to be ours belongs to someone else.
        external = max(0, sampled - ledger.in_sample_blocks)
        return external + ours + extra_blocks + others

    def _ledger_bounds_engine(self) -> bool:
        """Whether the reservations alone can stand for the engine while its metrics are stale: only when kvgate
        has it to itself (with the other replicas' claims, if there are any to be had), has seen it at least
        once, and did not last see its gate closed with requests of its own still in (the reservations were
        short of what it held then)."""
        if not self.config.exclusive_upstream or self.sample is None:
            return False  # other clients' use is unknown, or the engine was never seen
        if self.shared and self.others_blocks is None:
            return False  # the other replicas' claims are unknown (Redis down)
        return self.gate.is_open or len(self.ledger) == 0

    def fits(self, blocks: int, now: float) -> float | None:
        """The projected usage (0..1) with ``blocks`` more admitted, if that may be admitted now; else None."""
        if self.busy_full(now):
            return None
        projected = self.projected_blocks(blocks, now)
        if projected is None or self.geometry is None:
            return None
        total = self.geometry.num_blocks
        if self.is_stale(now):
            ok = projected <= min(self.config.stale_ledger_cap, self.config.high_watermark) * total
        else:
            cap = self.config.high_watermark * total
            ok = self.gate.is_open and (projected <= cap or (blocks > cap and self._alone() and projected <= total))
        return projected / total if ok else None

    def _alone(self) -> bool:
        """Nothing of the gateway's (this replica's or, as far as the shared books say, the others') is here.
        A reservation larger than the watermark leaves room for (a whole output budget that is most of a pool
        holding one context, as vLLM's ``--max-model-len -1`` sizes it) runs then, alone: vLLM itself checked
        at startup that one sequence of the whole context fits its pool, and it would serve it."""
        return len(self.ledger) == 0 and self.others_blocks == 0

    def room_for_others(self, now: float) -> int:
        """How many blocks other replicas may hold here, not yet in the sample, with what this replica holds
        (the request just placed included) still under the cap: the limit of a shared claim."""
        projected = self.projected_blocks(0, now)
        if projected is None or self.geometry is None:
            return 0
        cap = self.config.stale_ledger_cap if self.is_stale(now) else self.config.high_watermark
        # never below 0: a request running alone past the cap (:meth:`fits`) leaves the others no room at all
        return max(0, int(cap * self.geometry.num_blocks) - (projected - (self.others_blocks or 0)))

    def shared_mark(self, now: float) -> SampleMark | None:
        """The sample this replica's projections rest on, as the other replicas' claims are weighed against it:
        None when they rest on no sample (stale, or ``exclusive_upstream``: the ledgers together are the bound)
        or the engine does not say which moment its sample shows. Then every claim counts whole."""
        if self.config.exclusive_upstream or self.is_stale(now) or self.sample is None:
            return None
        return self.sample.mark

    def shared_peak(self) -> int:
        """The most this replica's reservations here can hold at one future moment, as the other replicas are
        to count them: as this replica counts them itself (their sum under ``worst_case``)."""
        if self.config.growth_model != "lockstep" or self.geometry is None:
            return self.ledger.reserved_blocks
        return self.ledger.peak_blocks(slack_blocks=int(BOUND_SLACK * self.geometry.num_blocks))

    def claims(self) -> dict[str, tuple[int, int]]:
        """This replica's live reservations as the other replicas must weigh them: (blocks, of which the
        last sample shows), by id."""
        return {str(res.id): (res.blocks, res.in_sample_blocks) for res in self.ledger.live()}

    def projected_usage(self, now: float) -> float | None:
        projected = self.projected_blocks(0, now)
        if projected is None or self.geometry is None:
            return None
        return projected / self.geometry.num_blocks
