"""The simulated vLLM V1 engine: continuous batching over a paged KV pool, with preemption and OOM.

Follows ``vllm/v1/core/sched/scheduler.py``: each step first gives running requests their tokens (one per
decoding sequence, a chunk for an unfinished prefill) within ``max_num_batched_tokens``; when a request needs
a block and none is free, the lowest-priority running request (the last one, FCFS) is preempted by recompute:
its blocks are freed and it goes back to the front of the waiting queue. Waiting requests are admitted only
in steps without preemption, while blocks (for the whole sequence so far, as vLLM's default
``scheduler_reserve_full_isl`` checks, not just the first prefill chunk), token budget and ``max_num_seqs``
allow. The KV of the token
sampled in a step is written in the next step, so a sequence holds ``ceil(computed / block_size)`` blocks.
A request finishes as ``vllm/v1/core/sched/utils.py`` ``check_stop`` decides: EOS ("stop") at its natural
length if it has one, else (or first) at ``max_tokens`` or ``max_model_len`` ("length").

Pure and synchronous: time is passed in, nothing here sleeps or does I/O.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field

from gateway.sim.blocks import BlockPool, blocks_for
from gateway.sim.config import SimConfig
from gateway.sim.timing import StepShape, step_seconds


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SimRequest:
    """One sequence's progress. ``max_tokens`` is already capped at ``max_model_len - prompt_len``.

    ``output_tokens`` is the natural length: the model samples EOS as that output token (counted, as vLLM
    counts it). It belongs to the request, not to an attempt, so a request recomputed after preemption
    stops at the same place. ``None`` models a request that never samples EOS.
    """

    request_id: str
    prompt_len: int
    max_tokens: int
    arrival: float
    output_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    num_computed: int = 0
    num_output: int = 0
    blocks: int = 0
    status: Status = Status.WAITING
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output

    @property
    def stop_at(self) -> int | None:
        """The output token that is EOS, or None if none will be.

        ``ignore_eos`` drops the natural stop. ``min_tokens`` masks EOS while fewer than ``min_tokens`` tokens
        have been produced (vLLM's ``MinTokensLogitsProcessor``), so a model that wanted to stop earlier
        stops at the first token it may: ``min_tokens + 1``.
        """
        if self.ignore_eos or self.output_tokens is None:
            return None
        return max(self.output_tokens, self.min_tokens + 1)


@dataclass(frozen=True)
class Step:
    """A scheduled batch: what runs, how long it takes, and what memory it needs."""

    scheduled: dict[str, int]  # request_id -> tokens computed this step
    prefill_tokens: int
    duration: float
    memory_bytes: float
    oom: bool
    preempted: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """A request produced its ``index``-th output token (1-based); ``finished`` when it was the last."""

    request: SimRequest
    index: int
    finished: bool


@dataclass
class Stats:
    """Monotonic counters with vLLM's semantics (prompt tokens exclude recomputation)."""

    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: collections.Counter[str] = field(default_factory=collections.Counter)
    iterations: int = 0
    iteration_tokens: int = 0
    peak_memory_bytes: float = 0.0


class Engine:
    """Scheduler + block pool. ``schedule`` plans a step; ``complete`` applies it when its time has passed."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.pool = BlockPool(cfg.num_gpu_blocks)
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.stats = Stats()

    # -- admission -------------------------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        if req.prompt_len < 1 or req.prompt_len + req.max_tokens > self.cfg.max_model_len:
            raise ValueError("request does not fit max_model_len; validate before adding")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if req.output_tokens is not None and req.output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str, now: float) -> SimRequest | None:
        """Drop a request (client went away); its blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        req.finished_at = now
        return req

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def usage(self) -> float:
        return self.pool.usage()

    # -- one step --------------------------------------------------------------------------------------
    def schedule(self, now: float) -> Step:
        budget = self.cfg.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed, budget)
            if num_new <= 0:
                i += 1
                continue
            need = blocks_for(req.num_computed + num_new, self.cfg.block_size) - req.blocks
            while need > self.pool.free:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            self._grow(req, need)
            scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
                req = self.waiting[0]
                num_new = min(req.num_tokens - req.num_computed, budget)
                need = blocks_for(req.num_computed + num_new, self.cfg.block_size) - req.blocks
                # vLLM's scheduler_reserve_full_isl (on by default): a waiting request is admitted only if its
                # whole sequence so far fits, not just its first prefill chunk
                if blocks_for(req.num_tokens, self.cfg.block_size) - req.blocks > self.pool.free:
                    break
                self.waiting.popleft()
                self._grow(req, need)
                req.status = Status.RUNNING
                if req.first_scheduled is None:
                    req.first_scheduled = now
                self.running.append(req)
                scheduled[req.request_id] = num_new
                budget -= num_new
        return self._plan(scheduled, tuple(preempted))

    def complete(self, step: Step, now: float) -> list[TokenEvent]:
        """Apply a step's results: advance computed tokens, sample one token where a sequence caught up."""
        self.stats.iterations += 1
        self.stats.iteration_tokens += sum(step.scheduled.values())
        events: list[TokenEvent] = []
        for request_id, num_new in step.scheduled.items():
            req = self.requests.get(request_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted while the step ran
            req.num_computed += num_new
            if req.num_computed < req.num_tokens:
                continue  # partial prefill chunk
            req.num_output += 1
            self.stats.generation_tokens += 1
            if req.first_token is None:
                req.first_token = now
                self.stats.prompt_tokens += req.prompt_len
            reason = self._check_stop(req)
            if reason is not None:
                self._finish(req, reason, now)
            events.append(TokenEvent(req, req.num_output, reason is not None))
        return events

    def fail_all(self, now: float) -> list[SimRequest]:
        """The engine died: every request ends with an error and the pool is empty."""
        failed = list(self.requests.values())
        for req in failed:
            req.status = Status.FINISHED
            req.finish_reason = "error"
            req.finished_at = now
            self.stats.finished_by_reason["error"] += 1
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()
        self.pool.used = 0
        return failed

    # -- internals -------------------------------------------------------------------------------------
    def _check_stop(self, req: SimRequest) -> str | None:
        """vLLM's order: EOS first, so a natural stop on the very last allowed token is still "stop"."""
        if req.num_output == req.stop_at:
            return "stop"
        if req.num_output >= req.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    def _plan(self, scheduled: dict[str, int], preempted: tuple[str, ...]) -> Step:
        prefill = context = pairs = 0
        for request_id, num_new in scheduled.items():
            req = self.requests[request_id]
            ctx = req.num_computed + num_new
            context += ctx
            pairs += num_new * ctx
            if req.num_computed < req.prompt_len or num_new > 1:
                prefill += num_new
        shape = StepShape(len(scheduled), sum(scheduled.values()), context, pairs)
        memory = (
            self.cfg.fixed_bytes
            + self.pool.used * self.cfg.block_bytes
            + self.cfg.activation_bytes_per_prefill_token * prefill
        )
        self.stats.peak_memory_bytes = max(self.stats.peak_memory_bytes, memory)
        return Step(
            scheduled=scheduled,
            prefill_tokens=prefill,
            duration=step_seconds(self.cfg, shape),
            memory_bytes=memory,
            oom=memory > self.cfg.card_bytes,
            preempted=preempted,
        )

    def _grow(self, req: SimRequest, n: int) -> None:
        if n > 0:
            if not self.pool.allocate(n):
                raise AssertionError("scheduler allocated beyond the free pool")
            req.blocks += n

    def _release(self, req: SimRequest) -> None:
        self.pool.release(req.blocks)
        req.blocks = 0

    def _preempt(self, req: SimRequest) -> None:
        self._release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: SimRequest, reason: str, now: float) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finished_at = now
        self.stats.finished_by_reason[reason] += 1
        del self.requests[req.request_id]
