"""The ledger's peak: the inlined exact count equals the plain one (``RequestCost.blocks_after`` of every
request at every instant), the O(n) bound is never below it and, for single-prompt requests, overstates by at
most one block per sequence, and ``slack_blocks`` picks the bound only where that is within the slack."""

from __future__ import annotations

from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.ledger import ENGINE_LEAD_TOKENS, Ledger, Reservation
from gateway.tokens.cost import RequestCost, blocks_for

BS = 16

request = st.tuples(
    st.lists(st.integers(1, 400), min_size=1, max_size=3),  # prompts
    st.integers(1, 3),  # sequences per prompt
    st.lists(st.integers(1, 300), min_size=3, max_size=3),  # output budgets (the first len(prompts) used)
    st.integers(0, 900),  # tokens generated so far, over all sequences
    st.booleans(),  # decoding (first token seen) or not yet
    st.integers(0, 120),  # lead: how much further per sequence a batched stream's engine may be
)
requests = st.lists(request, max_size=40)


def ledger_of(spec: list[tuple[list[int], int, list[int], int, bool, int]], bs: int = BS) -> Ledger:
    ledger = Ledger(bs)
    for prompts, copies, budgets, generated, decoding, lead in spec:
        outputs = tuple(budgets[: len(prompts)])
        blocks = copies * sum(blocks_for(p + o, bs) for p, o in zip(prompts, outputs, strict=True))
        cost = RequestCost(tuple(prompts), copies, max(outputs), blocks, outputs)
        res = ledger.reserve(cost, "t", 0.0, cost, ())
        if decoding:
            ledger.progress(res, max(1, generated), 0.1, lead)
    return ledger


def seen_per_sequence(cost: RequestCost, generated: int) -> int:
    """The most tokens a still-growing sequence can hold with ``generated`` over all sequences, those whose
    budget is smaller stopped at it (searched, not computed)."""
    budgets = cost.output_budgets
    s = 0
    while s < cost.max_output and cost.sequences_per_prompt * sum(min(b, s + 1) for b in budgets) <= generated:
        s += 1
    return s


def plain_peak(ledger: Ledger) -> int:
    """The definition, written the slow way."""
    fixed, decoding = 0, []
    for res in ledger.live():
        if res.first_token_at is None:
            fixed += res.blocks
            continue
        seen = seen_per_sequence(res.cost, res.generated)
        held = seen + ENGINE_LEAD_TOKENS
        if res.lead_tokens:
            held = max(held, min(held + res.lead_tokens, res.cost.max_output))
        decoding.append((max(1, res.cost.max_output - seen), res, held))
    decoding.sort(key=lambda d: d[0], reverse=True)
    peak = 0
    for j, (remaining, _, _) in enumerate(decoding):
        held = sum(
            r.cost.blocks_after((per_seq + remaining - 1) * r.cost.num_sequences, ledger.block_size)
            for _, r, per_seq in decoding[: j + 1]
        )
        peak = max(peak, held)
    return fixed + peak


def test_a_batchs_long_sequences_are_not_sized_by_its_short_ones() -> None:
    """Budgets of 10 and 1,000 (one prompt near the context): 510 tokens relayed are 10 in the short sequence
    and 500 in the long one, not 255 each; the long one's blocks are counted from 500."""
    cost = RequestCost((1600, 16), 1, 1000, blocks_for(1610, BS) + blocks_for(1016, BS), (10, 1000))
    ledger = Ledger(BS)
    res = ledger.reserve(cost, "t", 0.0, cost, ())
    ledger.progress(res, 510, 0.1)
    assert seen_per_sequence(cost, 510) == 500
    assert ledger.modelled_blocks() == blocks_for(1610, BS) + blocks_for(16 + 500 + ENGINE_LEAD_TOKENS, BS)
    assert ledger.peak_blocks() == plain_peak(ledger) == cost.blocks


def sequences(ledger: Ledger) -> int:
    """The bound's tolerance: a block per decoding sequence, and a batched stream's lead in blocks."""
    return sum(
        r.cost.num_sequences * (1 + blocks_for(r.lead_tokens, BS))
        for r in ledger.live()
        if isinstance(r, Reservation) and r.first_token_at
    )


@settings(max_examples=300, deadline=None)
@given(spec=requests)
def test_the_exact_peak_is_the_plain_one_and_the_bound_is_close_above(
    spec: list[tuple[list[int], int, list[int], int, bool, int]],
) -> None:
    ledger = ledger_of(spec)
    exact = ledger.peak_blocks()  # <= 40 decoding requests: the exact path
    assert exact == plain_peak(ledger)
    bound = ledger.peak_blocks(slack_blocks=10**9)  # any overstatement tolerated: the bound
    assert exact <= bound
    if all(len(prompts) == 1 for prompts, *_ in spec):  # (a batch's shorter budgets are counted as its longest)
        assert bound <= exact + sequences(ledger)


@settings(max_examples=25, deadline=None)
@given(spec=st.lists(request, min_size=100, max_size=300))
def test_the_exact_sweep_holds_at_a_busy_engines_concurrency(
    spec: list[tuple[list[int], int, list[int], int, bool, int]],
) -> None:
    """Hundreds of decoding requests, each instant's rounding counted per sequence: still the definition (the
    exact count lifted past EXACT_LIMIT, which keeps its CPU per admission decision under the bound's 3x)."""
    ledger = ledger_of(spec)
    with patch("gateway.admission.ledger.EXACT_LIMIT", 10**6):
        assert ledger.peak_blocks() == plain_peak(ledger)


def test_the_exact_count_follows_requests_as_they_start_decoding_grow_and_go() -> None:
    """The blocks of requests not yet decoding are kept as a running sum: it follows the first token, a resize
    and a release, and every decoding request leaves the sweep when released."""
    ledger = ledger_of([([100 + 10 * i], 1, [200, 1, 1], 5 * i + 1, i % 2 == 0, 0) for i in range(12)])
    live = list(ledger.live())
    assert ledger.peak_blocks() == plain_peak(ledger)
    waiting = next(r for r in live if r.first_token_at is None)
    ledger.resize(waiting, RequestCost((110,), 1, 400, blocks_for(510, BS)))
    assert ledger.peak_blocks() == plain_peak(ledger)
    ledger.progress(waiting, 3, 0.2)
    assert ledger.peak_blocks() == plain_peak(ledger)
    for res in live[::3]:
        ledger.release(res)
        assert ledger.peak_blocks() == plain_peak(ledger)
    for res in live:
        ledger.release(res)
    assert ledger.peak_blocks() == 0 == ledger.reserved_blocks


@settings(max_examples=100, deadline=None)
@given(spec=requests, bs=st.sampled_from([1, 2, 5, 64, 544, 2096]))
def test_the_exact_sweep_holds_at_any_block_size(
    spec: list[tuple[list[int], int, list[int], int, bool, int]], bs: int
) -> None:
    """Hybrid models' attention blocks run to hundreds or thousands of tokens: the rounding is counted from
    the growing sequences' sorted residues, at a cost that does not grow with the block size."""
    ledger = ledger_of(spec, bs)
    assert ledger.peak_blocks() == plain_peak(ledger)


def test_the_bound_is_taken_only_within_the_slack() -> None:
    spec = [([100 + 10 * i], 1, [200, 1, 1], 5 * i + 1, True, 0) for i in range(20)]
    ledger = ledger_of(spec)
    exact, bound = ledger.peak_blocks(), ledger.peak_blocks(slack_blocks=20)
    assert bound > exact  # the bound's rounding shows with 20 sequences
    assert ledger.peak_blocks(slack_blocks=19) == exact  # 20 sequences could overstate by more than 19


def test_a_batched_streams_lead_sizes_its_peak() -> None:
    """A stream the engine may be 40 tokens further into than its events show holds those tokens' blocks too."""
    plain, ahead = ledger_of([([100], 1, [300, 1, 1], 50, True, 0)]), ledger_of([([100], 1, [300, 1, 1], 50, True, 40)])
    assert ahead.peak_blocks() == plain.peak_blocks() == blocks_for(400, BS)  # at its end, both hold it all
    sample = [next(iter(ledger.live())) for ledger in (plain, ahead)]
    assert [r.lead_tokens for r in sample] == [0, 40]
