"""The reservation ledger: blocks the gateway has promised to requests in flight.

A usage sample from ``/metrics`` is a picture of the past. The ledger is what fills the gap until the next
one: for every admitted request it knows how many blocks the request may grow to and how many the latest
sample already shows (only once the request's first token was seen before that sample started is its
progress known to be inside it), and :meth:`Ledger.peak_blocks` says how much they can hold at once as
they go on decoding. Whatever a sample shows beyond our known part belongs to other clients.

Every reservation is released exactly once: :meth:`Ledger.release` answers False on a second call, and the
counters let tests check that nothing is left behind.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from bisect import bisect_left, insort
from collections.abc import Iterator
from dataclasses import dataclass, field

from gateway.tokens.cost import RequestCost

_reservation_ids = itertools.count(1)  # unique in the process, across engines that come and go
ENGINE_LEAD_TOKENS = 8  # how far a decoding sequence may be ahead of the tokens the gateway has relayed
EXACT_LIMIT = 64  # decoding requests up to which the peak is computed exactly (the exact count costs 3x the bound)
# What the peak reads of a request's cost: (largest output budget, sequences, prompt tokens over all sequences,
# blocks, sequences per prompt, (prompt, output budget) of each prompt)
Shape = tuple[int, int, int, int, int, tuple[tuple[int, int], ...]]
# A decoding request as the peak weighs it: (steps remaining, tokens held per sequence, prompt tokens over all
# sequences, sequences, blocks when done, the reservation)
_Growth = tuple[int, int, int, int, int, "Reservation"]
_remaining = operator.itemgetter(0)


@dataclass(slots=True, eq=False)
class Reservation:
    """What one admitted request holds: ``cost`` as expected now (it may grow, up to ``full``, the request's
    own budget), for the request of ``key`` (model, endpoint, tenant) whose output lengths teach the estimate."""

    id: int
    cost: RequestCost
    tenant: str
    admitted_at: float
    full: RequestCost
    key: tuple[str, ...] = ()
    engine: str = ""  # the engine of the pool it was placed on
    by_affinity: bool = False  # placed there by prefix affinity, over the engine with the most headroom
    prefix: tuple[int, ...] = ()  # its prompt's chunk hashes (prefix affinity), recorded once it takes effect
    outran: bool = False  # has grown past its first estimate
    first_token_at: float | None = None
    generated: int = 0  # output tokens seen over all sequences: what the engine holds at least
    lead_tokens: int = 0  # per sequence, how much further the engine may be beyond ENGINE_LEAD_TOKENS
    in_sample_blocks: int = 0
    pending_sample_blocks: int = 0
    projected_usage: float = 0.0  # projected KV usage (0..1) when it was admitted
    released: bool = field(default=False)
    shape: Shape = (0, 1, 0, 0, 1, ())  # of ``cost``, what the peak reads

    @property
    def blocks(self) -> int:
        return self.cost.blocks


class Ledger:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._live: dict[int, Reservation] = {}
        self._decoding: dict[int, Reservation] = {}  # the live ones whose first token was seen
        self.reserved_blocks = 0
        self._waiting_blocks = 0  # of the live ones not yet decoding: they count whole in the peak
        self._in_sample_blocks = 0
        self._reserved_at_begin = 0
        # what our reservations covered while the latest sample was taken (the more of its start and end): what
        # the sample shows beyond it is not ours, or is ours beyond what we reserved
        self.sample_reserved_blocks = 0
        # what the lockstep model said our reservations held at that moment (decoding ones as far as they were
        # seen, plus the engine's lead; the others whole): the sample beyond it is what the model missed
        self.sample_modelled_blocks = 0
        self._modelled_at_begin = 0
        self.reserved_count = 0
        self.released_count = 0
        self.last_id = 0  # the newest reservation's id: ids only grow, so any made later is above it

    def __len__(self) -> int:
        return len(self._live)

    def live(self) -> Iterator[Reservation]:
        """The reservations not yet released."""
        return iter(self._live.values())

    def reserve(
        self,
        cost: RequestCost,
        tenant: str,
        now: float,
        full: RequestCost | None = None,
        key: tuple[str, ...] = (),
    ) -> Reservation:
        res = Reservation(next(_reservation_ids), cost, tenant, admitted_at=now, full=full or cost, key=key)
        res.shape = _shape(cost)
        self.last_id = res.id
        self._live[res.id] = res
        self.reserved_blocks += res.blocks
        self._waiting_blocks += res.blocks
        self.reserved_count += 1
        return res

    def progress(self, res: Reservation, generated: int, now: float, lead_tokens: int = 0) -> None:
        """Record output seen so far (tokens over all sequences, at least; ``lead_tokens`` per sequence more
        the engine may hold: a batched stream); the first call marks the first token."""
        if res.released:
            return
        if res.first_token_at is None:
            res.first_token_at = now
            self._waiting_blocks -= res.blocks
            self._decoding[res.id] = res
        res.generated = max(res.generated, generated)
        res.lead_tokens = max(res.lead_tokens, lead_tokens)

    def resize(self, res: Reservation, cost: RequestCost) -> None:
        """A live request is now expected to hold ``cost`` (it outran its estimate); the books follow."""
        if res.released:
            return
        self.reserved_blocks += cost.blocks - res.blocks
        if res.first_token_at is None:
            self._waiting_blocks += cost.blocks - res.blocks
        res.cost = cost
        res.shape = _shape(cost)

    def release(self, res: Reservation) -> bool:
        """Return the reservation's blocks. True the first time, False on any later call."""
        if res.released:
            return False
        res.released = True
        del self._live[res.id]
        if res.first_token_at is None:
            self._waiting_blocks -= res.blocks
        else:
            del self._decoding[res.id]
        self.reserved_blocks -= res.blocks
        self._in_sample_blocks -= res.in_sample_blocks
        self.released_count += 1
        return True

    def drop_admitted_before(self, when: float) -> tuple[Reservation, ...]:
        """The engine restarted: the reservations admitted before ``when`` died with it. Each is released here
        (a later :meth:`release` of one of them answers False), and returned."""
        lost = tuple(res for res in self._live.values() if res.admitted_at < when)
        for res in lost:
            self.release(res)
        return lost

    def begin_sample(self) -> None:
        """A scrape starts now: note how much of each request the engine certainly holds at this moment."""
        self._reserved_at_begin = self.reserved_blocks
        self._modelled_at_begin = self.modelled_blocks()
        for res in self._live.values():
            if res.first_token_at is None:
                res.pending_sample_blocks = 0
            else:
                res.pending_sample_blocks = min(res.blocks, res.cost.blocks_after(res.generated, self.block_size))

    def commit_sample(self) -> None:
        """The scrape begun by :meth:`begin_sample` succeeded: its picture now includes those blocks."""
        total = 0
        for res in self._live.values():
            res.in_sample_blocks = res.pending_sample_blocks
            total += res.in_sample_blocks
        self._in_sample_blocks = total
        self.sample_reserved_blocks = max(self._reserved_at_begin, self.reserved_blocks)
        self.sample_modelled_blocks = max(self._modelled_at_begin, self.modelled_blocks())

    def modelled_blocks(self) -> int:
        """What the lockstep model says the live reservations hold now (the start of :meth:`peak_blocks`'s
        schedule): a decoding request what it was seen to generate plus the engine's lead, the rest whole."""
        held = self._waiting_blocks
        bs = self.block_size
        for res in self._decoding.values():
            out, seqs, _, blocks, _, _ = res.shape
            per_seq = _seen(res.generated, res.shape) + ENGINE_LEAD_TOKENS
            if res.lead_tokens:
                per_seq = max(per_seq, min(per_seq + res.lead_tokens, out))
            held += min(blocks, res.cost.blocks_after(per_seq * seqs, bs))
        return held

    @property
    def in_sample_blocks(self) -> int:
        """Blocks of ours the latest sample certainly contains (a lower bound)."""
        return self._in_sample_blocks

    def peak_blocks(self, slack_blocks: int = 0) -> int:
        """The most blocks the live reservations can hold at any one future moment.

        A request not yet seen decoding counts whole, for the whole horizon. A decoding one holds its prompt
        plus what it has generated, grows by one token per sequence per engine step (vLLM decodes every
        running sequence each step) and frees everything when it reaches its output budget. The sum is
        highest just before some request finishes, so only those instants are evaluated, with the requests
        sorted by remaining tokens. Each sequence is assumed ``ENGINE_LEAD_TOKENS`` ahead of what the gateway
        has seen of it (the stream trails the engine). Up to ``EXACT_LIMIT`` decoding requests the blocks are
        counted exactly, O(n log n); beyond that, running sums with per-sequence rounding bounded from above,
        also O(n log n) and a third of the exact count's CPU, which overstates by at most one block per
        sequence, and a batched stream's lead (rounded up to blocks) more, the lead being added to its whole
        growth (more also for a batch whose prompts have shorter budgets than its longest: they are counted as
        growing to it). That bound is also taken whenever
        one block per decoding sequence is within ``slack_blocks``: a large pool need not pay the exact count's
        CPU at every admission decision for a difference it cannot tell.
        """
        fixed = self._waiting_blocks
        if not self._decoding:
            return fixed
        decoding: list[_Growth] = []
        sequences = 0
        for res in self._decoding.values():
            out, seqs, prompt_total, blocks, _, pairs = res.shape
            # _seen's one-budget case inline: a call per request here cost 40 us at 256 decoding
            seen = _seen(res.generated, res.shape) if pairs and pairs[0][1] < out else res.generated // seqs
            if seen > out:
                seen = out
            remaining = out - seen if seen < out else 1  # done generating: holds its blocks until it ends
            # sized as if the engine were ENGINE_LEAD_TOKENS ahead (and a batched stream's lead, never past its
            # budget), timed as if it were not: both err safe
            held = seen + ENGINE_LEAD_TOKENS
            if res.lead_tokens:
                held = max(held, min(held + res.lead_tokens, out))
            decoding.append((remaining, held, prompt_total, seqs, blocks, res))
            sequences += seqs
        decoding.sort(key=_remaining, reverse=True)
        if len(decoding) <= EXACT_LIMIT and sequences > slack_blocks:
            return fixed + self._peak_exact(decoding)
        return fixed + self._peak_bound(decoding)

    def _peak_exact(self, decoding: list[_Growth]) -> int:
        """The blocks held (``RequestCost.blocks_after`` of each request, rounded per sequence) at each instant
        just before one finishes, swept from the last instant to the first in O(n log n).

        A sequence holds ``min(cap, x + t)`` tokens at step ``t`` (``x``: its prompt and what it holds now;
        ``cap``: its prompt and budget). Going back in time a sequence only ever leaves its cap, so the capped
        ones wait in a heap until they do; the rest are summed through ``ceil((x + t) / bs) = q + u + [r + v >=
        bs]`` (``x + bs - 1 = q bs + r``, ``t = u bs + v``): per instant, a sum of their ``q``, their count and
        how many of their ``r`` (kept sorted) reach ``bs - v``, whatever the block size."""
        bs = self.block_size
        round_up = bs - 1
        capped: list[tuple[int, int, int, int]] = []  # (x - cap: minus the step below which it grows, w, x, blocks)
        capped_blocks = 0  # of the sequences at their cap
        quotients = weight = 0  # of the growing ones: sum of w * q, sum of w
        residues: list[int] = []  # of the growing ones: each r, once per sequence, sorted
        peak = 0
        last = len(decoding) - 1
        for j, (remaining, per_seq, _, _, _, res) in enumerate(decoding):
            t = remaining - 1  # the last step before this request (and every one with less left) is done
            _, _, _, _, w, pairs = res.shape
            for prompt, budget in pairs:
                x, cap = prompt + per_seq, prompt + budget
                if x + t >= cap:
                    blocks = w * ((cap + round_up) // bs)
                    heapq.heappush(capped, (x - cap, w, x, blocks))
                    capped_blocks += blocks
                else:  # as the loop below takes one off the heap, inline: a heap round trip per sequence cost 1.5x
                    q, r = divmod(x + round_up, bs)
                    quotients += w * q
                    weight += w
                    for _ in range(w):
                        insort(residues, r)
            if j < last and decoding[j + 1][0] == remaining:
                continue  # the next has as much left: the same instant, with one more request held
            while capped and -capped[0][0] > t:  # below its cap from this step back: growing
                _, w, x, blocks = heapq.heappop(capped)
                capped_blocks -= blocks
                q, r = divmod(x + round_up, bs)
                quotients += w * q
                weight += w
                for _ in range(w):
                    insort(residues, r)
            u, v = divmod(t, bs)
            rounding = weight - bisect_left(residues, bs - v) if v else 0  # those with r + v >= bs
            held = capped_blocks + quotients + u * weight + rounding
            if held > peak:
                peak = held
        return peak

    def _peak_bound(self, decoding: list[_Growth]) -> int:
        round_up = self.block_size - 1
        bs = self.block_size
        peak = tokens = sequences = full = 0
        for remaining, per_seq, prompt_total, seqs, blocks, _ in decoding:
            tokens += prompt_total + seqs * per_seq
            sequences += seqs
            full += blocks
            bound = (tokens + sequences * (remaining - 1 + round_up)) // bs
            if bound > full:
                bound = full
            if bound > peak:
                peak = bound
        return peak

    def set_block_size(self, block_size: int) -> None:
        self.block_size = block_size


def _shape(cost: RequestCost) -> Shape:
    # by budget: the first has the smallest, and a batch whose prompts have one budget shows it at once
    pairs = tuple(sorted(zip(cost.prompt_tokens, cost.output_budgets, strict=True), key=_budget))
    copies = cost.sequences_per_prompt
    return cost.max_output, max(1, cost.num_sequences), cost.total_prompt_tokens, cost.blocks, copies, pairs


_budget = operator.itemgetter(1)


def _seen(generated: int, shape: Shape) -> int:
    """Tokens each sequence still generating holds, from ``generated`` over all of them: the sequences that
    reached their budget stopped there, and the others share the rest. An even share would size a batch's long
    sequences short once its short ones are done."""
    out, seqs, _, _, copies, pairs = shape
    if not pairs or pairs[0][1] >= out:  # one budget for all (the usual case)
        return min(out, generated // seqs)
    left = generated // copies  # per copy of the batch
    growing = len(pairs)
    for _, budget in pairs:
        if budget * growing >= left:
            return left // growing
        left -= budget  # this one is done: it holds its budget
        growing -= 1
    return out
