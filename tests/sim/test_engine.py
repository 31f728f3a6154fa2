"""The engine against a hand-computed paged-attention model, and its invariants under random traffic."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sim.config import PRESETS, SimConfig
from gateway.sim.engine import Engine, SimRequest, Status


def small(**kw: object) -> SimConfig:
    """A tiny pool (block_size 16) so every count below can be done by hand."""
    base = dataclasses.replace(
        PRESETS["llama3-8b-h100"], num_gpu_blocks=11, max_model_len=160, max_num_batched_tokens=64, max_num_seqs=8
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def run_step(engine: Engine, now: float) -> float:
    step = engine.schedule(now)
    now += step.duration
    engine.complete(step, now)
    return now


def test_fixed_sequence_matches_hand_computed_block_counts() -> None:
    # Pool: 11 blocks, one is the null block -> 10 allocatable, usage = used / 10.
    eng = Engine(small())
    eng.add(SimRequest("a", prompt_len=40, max_tokens=20, arrival=0.0))
    eng.add(SimRequest("b", prompt_len=30, max_tokens=3, arrival=0.0))
    a, b = eng.requests["a"], eng.requests["b"]

    # Step 1: budget 64. a's 40-token prefill: ceil(40/16)=3 blocks; b gets the remaining 24 tokens as a chunk:
    # ceil(24/16)=2 blocks. 5 of 10 blocks in use.
    step = eng.schedule(0.0)
    assert step.scheduled == {"a": 40, "b": 24}
    assert (a.blocks, b.blocks, eng.pool.used) == (3, 2, 5)
    assert eng.usage() == pytest.approx(0.5)
    eng.complete(step, step.duration)
    assert (a.num_output, b.num_output) == (1, 0)  # a sampled its first token; b is mid-prefill

    # Step 2: a decodes token 41 (still within 3 blocks); b finishes its prefill: 30 tokens -> 2 blocks.
    step = eng.schedule(1.0)
    assert step.scheduled == {"a": 1, "b": 6}
    assert (a.blocks, b.blocks) == (3, 2)
    eng.complete(step, 1.1)
    assert (a.num_output, b.num_output) == (2, 1)

    # Steps 3-4: b writes KV for tokens 31, 32 (2 blocks hold 32) then 33 needs a third block; b finishes at
    # 3 outputs and frees its 3 blocks.
    now = 2.0
    for _ in range(2):
        now = run_step(eng, now)
    assert b.status is Status.FINISHED and b.finish_reason == "length" and b.num_output == 3
    assert b.blocks == 0
    # a: 40 prompt + 4 outputs; KV written for 43 tokens -> 3 blocks.
    assert a.num_output == 4 and a.num_computed == 43 and a.blocks == 3 and eng.pool.used == 3

    # Run a to the end: 40 + 20 tokens, KV for 59 -> 4 blocks at the last step; all freed at the end.
    while eng.has_work():
        prev = a.blocks
        now = run_step(eng, now)
        if a.status is Status.RUNNING:
            assert a.blocks == -(-a.num_computed // 16) and a.blocks >= prev
    assert a.num_output == 20 and eng.pool.used == 0
    assert eng.stats.prompt_tokens == 70 and eng.stats.generation_tokens == 23
    assert eng.stats.num_preemptions == 0


def test_decode_out_of_blocks_preempts_the_newest_by_recompute() -> None:
    # 10 allocatable blocks. Two requests of 64-token prompts hold 4 blocks each = 8; decode grows each by a
    # block every 16 tokens, so after 2 growths the pool is full and the next growth preempts the last one.
    eng = Engine(small(max_num_batched_tokens=128))
    eng.add(SimRequest("old", 64, 90, 0.0))
    eng.add(SimRequest("new", 64, 90, 0.0))
    old, new = eng.requests["old"], eng.requests["new"]
    now = run_step(eng, 0.0)
    assert (old.blocks, new.blocks) == (4, 4)
    # Token 65 (first decode input) needs block 5 for each: 10/10 used. Then 16 tokens later block 6: none left.
    while eng.stats.num_preemptions == 0:
        now = run_step(eng, now)
    assert new.status is Status.WAITING and new.num_computed == 0 and new.blocks == 0
    assert old.blocks == 6 and new.num_preemptions == 1
    assert eng.waiting[0] is new  # back at the front of the queue
    # old runs to completion, then new is recomputed (prompt + the outputs it already had) and finishes.
    while eng.has_work():
        now = run_step(eng, now)
    assert old.num_output == 90 and new.num_output == 90 and eng.pool.used == 0
    assert eng.stats.prompt_tokens == 128  # recomputation is not counted, as in vLLM


def test_a_waiting_request_is_admitted_only_when_its_whole_prompt_fits() -> None:
    # vLLM's scheduler_reserve_full_isl (on by default): 10 allocatable blocks, "a" holds 3 (40 tokens); "b"'s
    # 130-token prompt needs 9 blocks whole, though its first 24-token chunk would need only 2. It waits, and
    # nothing is preempted, until "a" has finished and freed its blocks.
    eng = Engine(small(max_num_batched_tokens=64))
    eng.add(SimRequest("a", prompt_len=40, max_tokens=20, arrival=0.0))
    eng.add(SimRequest("b", prompt_len=130, max_tokens=10, arrival=0.0))
    a, b = eng.requests["a"], eng.requests["b"]
    step = eng.schedule(0.0)
    assert step.scheduled == {"a": 40} and b.status is Status.WAITING and b.blocks == 0
    now = step.duration
    eng.complete(step, now)
    while a.status is not Status.FINISHED:
        now = run_step(eng, now)
        assert b.status is Status.WAITING
    while eng.has_work():
        now = run_step(eng, now)
    assert b.num_output == 10 and eng.stats.num_preemptions == 0


def test_max_num_seqs_and_token_budget_bound_each_step() -> None:
    eng = Engine(small(num_gpu_blocks=200, max_num_seqs=3, max_num_batched_tokens=50))
    for i in range(6):
        eng.add(SimRequest(f"r{i}", 20, 5, 0.0))
    step = eng.schedule(0.0)
    assert len(eng.running) == 3 and sum(step.scheduled.values()) == 50  # 20 + 20 + a 10-token chunk


def test_oom_when_prefill_lands_on_a_nearly_full_pool() -> None:
    cfg = PRESETS["llama3-8b-h100"]
    assert cfg.oom_usage_threshold(0) > 1.0  # decode alone never OOMs on this preset
    assert 0.90 < cfg.oom_usage_threshold(cfg.max_num_batched_tokens) < 0.96
    eng = Engine(cfg)
    # Fill the pool to ~95% with running prefills, then a full 8192-token chunk must OOM.
    for i in range(200):
        eng.add(SimRequest(f"r{i}", 3000, 256, 0.0))
    now, oom_usage = 0.0, None
    while eng.has_work():
        step = eng.schedule(now)
        if step.oom:
            oom_usage = eng.usage()
            break
        assert step.memory_bytes <= cfg.card_bytes
        now += step.duration
        eng.complete(step, now)
    assert oom_usage is not None and oom_usage > 0.90


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_scaled_preset_keeps_usage_thresholds(name: str) -> None:
    cfg = PRESETS[name]
    small_cfg = cfg.scaled(1 / 32)
    assert small_cfg.num_gpu_blocks < cfg.num_gpu_blocks / 30
    assert small_cfg.max_num_batched_tokens == 256
    for tokens in (0, 1024, 8192):
        assert small_cfg.oom_usage_threshold(tokens // 32) == pytest.approx(cfg.oom_usage_threshold(tokens), abs=1e-3)


requests_st = st.lists(
    st.tuples(st.integers(1, 150), st.integers(1, 60), st.integers(0, 3)),  # prompt, max_tokens, arrival step
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(
    reqs=requests_st,
    blocks=st.integers(12, 40),
    seqs=st.integers(1, 8),
    budget=st.integers(16, 200),
    abort_at=st.integers(0, 40),
)
def test_invariants_under_random_traffic(
    reqs: list[tuple[int, int, int]], blocks: int, seqs: int, budget: int, abort_at: int
) -> None:
    cfg = small(num_gpu_blocks=blocks, max_model_len=160, max_num_seqs=seqs, max_num_batched_tokens=budget)
    eng = Engine(cfg)
    pending = sorted(
        ((arr, f"r{i}", p, min(m, 160 - p)) for i, (p, m, arr) in enumerate(reqs) if p < 160),
        key=lambda r: r[0],
    )
    expected_outputs = {rid: m for _, rid, _, m in pending}
    finished: dict[str, int] = {}
    aborted: set[str] = set()
    now, step_no = 0.0, 0
    while pending or eng.has_work():
        while pending and pending[0][0] <= step_no:
            _, rid, p, m = pending.pop(0)
            eng.add(SimRequest(rid, p, m, now))
        if step_no == abort_at and eng.running:
            victim = eng.running[-1].request_id
            eng.abort(victim, now)
            aborted.add(victim)
        step = eng.schedule(now)
        # Blocks in use never exceed the pool, and the pool's count is the sum of what sequences hold.
        assert 0 <= eng.pool.used <= eng.pool.capacity
        assert eng.pool.used == sum(r.blocks for r in eng.requests.values())
        assert len(eng.running) <= cfg.max_num_seqs
        assert sum(step.scheduled.values()) <= cfg.max_num_batched_tokens
        for r in eng.running:
            assert r.blocks * cfg.block_size >= r.num_computed + step.scheduled.get(r.request_id, 0)
        now += max(step.duration, 1e-3)
        for ev in eng.complete(step, now):
            if ev.finished:
                finished[ev.request.request_id] = ev.request.num_output
        step_no += 1
        assert step_no < 10_000, "engine made no progress"
    # Every request that was not aborted finished with all its tokens, and all blocks came back.
    assert eng.pool.used == 0
    assert finished == {rid: m for rid, m in expected_outputs.items() if rid not in aborted}
