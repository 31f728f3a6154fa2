import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.errors import GatewayError
from gateway.server.settle import stream_lead, tokens_streamed, tokens_used
from gateway.tokens.cost import KvGeometry, RequestCost, blocks_for, estimate_cost
from gateway.upstream.forwarder import Usage

GEO = KvGeometry(block_size=16, num_blocks=1000)


def cost(prompts: tuple[int, ...], max_tokens: int | None = None, n: int = 1, max_model_len: int | None = 4096):
    return estimate_cost(
        prompts,
        max_tokens=max_tokens,
        sequences_per_prompt=n,
        max_model_len=max_model_len,
        geometry=GEO,
    )


def test_blocks_round_up_per_sequence() -> None:
    assert cost((100,), 28).blocks == 8  # 128 tokens = 8 blocks exactly
    assert cost((100,), 29).blocks == 9
    assert cost((100,), 28, n=3).blocks == 24
    assert cost((10, 20), 6).blocks == 1 + 2  # each prompt of a batch is its own sequence


def test_missing_max_tokens_reserves_up_to_max_model_len() -> None:
    c = cost((1000,), None, max_model_len=4096)
    assert c.max_output == 3096
    assert c.blocks == 4096 // 16


def test_missing_max_tokens_without_max_model_len_is_a_400() -> None:
    with pytest.raises(GatewayError) as err:
        cost((10,), None, max_model_len=None)
    assert err.value.status == 400 and err.value.param == "max_tokens"


def test_a_prompt_longer_than_the_context_is_a_400() -> None:
    with pytest.raises(GatewayError) as err:
        cost((4097,), 200, max_model_len=4096)
    assert err.value.code == "context_length_exceeded" and "4097" in err.value.message
    with pytest.raises(GatewayError):
        cost((4096,), None, max_model_len=4096)  # a generation needs room for one token
    assert cost((4096,), 0, max_model_len=4096).max_output == 0  # pooling: no output, the whole context


def test_max_tokens_past_the_context_is_clamped_as_vllm_does() -> None:
    """vLLM's get_max_tokens: min(max_model_len - prompt, max_tokens); the request is served, not refused."""
    c = cost((4000,), 200, max_model_len=4096)
    assert c.max_output == 96 and c.blocks == 4096 // 16 and c.total_tokens == 4096


def test_each_prompt_of_a_batch_gets_its_own_budget() -> None:
    """Without max_tokens, a short prompt may run longer than a long one: each gets max_model_len - itself."""
    c = cost((100, 4000), None, max_model_len=4096)
    assert c.output_budgets == (3996, 96) and c.max_output == 3996
    assert c.blocks == 2 * (4096 // 16)  # each sequence may fill the context
    assert c.total_tokens == 2 * 4096
    assert c.blocks_after(2 * 50, 16) == blocks_for(150, 16) + blocks_for(4050, 16)
    assert c.blocks_after(2 * 4000, 16) == c.blocks  # the short one past the long one's budget


def test_a_request_that_can_never_fit_names_the_numbers() -> None:
    with pytest.raises(GatewayError) as err:
        cost((15600,), 500, max_model_len=None)  # 1007 blocks > the pool's 1000
    assert err.value.status == 400 and err.value.code == "kv_cache_capacity_exceeded"
    assert "1007" in err.value.message and "1000" in err.value.message


def test_a_request_past_the_watermark_but_inside_the_pool_is_priced() -> None:
    """vLLM serves one sequence of its whole context (its startup check says the pool holds one); with
    ``--max-model-len -1`` the context is the pool. A chat without max_tokens there reserves the whole pool:
    admission runs it alone rather than refusing what the engine would serve (the 400 was at 90%)."""
    assert cost((14000,), 500, max_model_len=None).blocks == 907
    whole = estimate_cost((20,), max_tokens=None, sequences_per_prompt=1, max_model_len=16_000, geometry=GEO)
    assert whole.blocks == 1000 and whole.max_output == 15_980
    with pytest.raises(GatewayError):
        estimate_cost((20,), max_tokens=None, sequences_per_prompt=2, max_model_len=16_000, geometry=GEO)


def test_a_truncated_prompt_is_priced_as_the_engine_keeps_it() -> None:
    """vLLM keeps ``truncate_prompt_tokens`` of a prompt (-1: the context, less the token a generation needs),
    so a prompt longer than the context is served, not refused, and reserves only what is kept."""
    kept = estimate_cost((9000, 50), max_tokens=10, sequences_per_prompt=1, max_model_len=4096, geometry=GEO,
                         truncate_to=100, prompt_high=(9500, 60))  # fmt: skip
    assert kept.prompt_tokens == (100, 50) and kept.prompt_high == (100, 60)
    whole = estimate_cost((9000,), max_tokens=None, sequences_per_prompt=1, max_model_len=4096, geometry=GEO,
                          truncate_to=-1)  # fmt: skip
    assert whole.prompt_tokens == (4095,) and whole.max_output == 1
    pooled = estimate_cost((9000,), max_tokens=0, sequences_per_prompt=1, max_model_len=4096, geometry=GEO,
                           truncate_to=-1)  # fmt: skip
    assert pooled.prompt_tokens == (4096,)
    with pytest.raises(GatewayError) as err:
        estimate_cost((10,), max_tokens=1, sequences_per_prompt=1, max_model_len=4096, geometry=GEO, truncate_to=5000)
    assert err.value.status == 400 and err.value.param == "truncate_prompt_tokens"
    with pytest.raises(GatewayError):  # without it, the same prompt is longer than the context
        estimate_cost((9000,), max_tokens=10, sequences_per_prompt=1, max_model_len=4096, geometry=GEO)


def test_total_tokens_is_what_rate_limits_charge() -> None:
    c = cost((100, 50), 10, n=2)
    assert c.total_prompt_tokens == 300 and c.total_tokens == 300 + 10 * 4


@given(
    st.lists(st.integers(1, 2000), min_size=1, max_size=4),
    st.integers(1, 2000),
    st.integers(1, 4),
    st.integers(0, 10_000),
)
def test_blocks_after_grows_to_the_reservation(prompts: list[int], out: int, n: int, generated: int) -> None:
    c = estimate_cost(
        tuple(prompts),
        max_tokens=out,
        sequences_per_prompt=n,
        max_model_len=None,
        geometry=KvGeometry(16, 10**9),
    )
    now = c.blocks_after(generated, 16)
    assert c.blocks_after(0, 16) == n * sum(blocks_for(p, 16) for p in prompts)
    assert now <= c.blocks
    assert c.blocks_after(out * c.num_sequences, 16) == c.blocks
    assert c.blocks_after(generated + 1, 16) >= now


def test_an_estimated_prompt_is_charged_at_its_high_end_and_billed_by_usage() -> None:
    """Priced without the tokenizer, a prompt reserves its estimate (700) but a token rate limit pre-charges
    its band's high end (1,300): the engine's count (1,000) plus the output is billed in full, never capped at
    a pre-charge that was short of it."""
    estimated = RequestCost((700,), 1, 256, 60, prompt_high=(1300,))
    assert estimated.total_tokens == 956 and estimated.charge_tokens == 1556
    assert estimated.capped(100, 16).prompt_high == (1300,)
    assert tokens_used(estimated, Usage(1000, 256), 256, reached_engine=True) == 1256
    counted = RequestCost((1000,), 1, 256, 79)
    assert counted.charge_tokens == counted.total_tokens == 1256
    # counted short (the heuristic on CJK: 300 for what the engine counts 1,200): billed what the engine counted
    short = RequestCost((300,), 1, 1, 19)
    assert tokens_used(short, Usage(1200, 1), 1, reached_engine=True) == 1201


def test_a_whole_answer_without_usage_is_billed_as_charged_not_as_nothing() -> None:
    """A 200 answered in one piece whose usage says no token count (audio transcriptions report seconds) used
    what it was charged for, as far as anyone knows; a stream is billed by its events, and a request the
    engine never saw, or that broke off before its first token, by nothing."""
    cost = RequestCost((1000,), 1, 256, 79)
    assert tokens_used(cost, None, 0, reached_engine=True, whole_answer=True) == cost.charge_tokens
    assert tokens_used(cost, None, 10, reached_engine=True) == 1010
    assert tokens_used(cost, None, 0, reached_engine=True) == 0
    assert tokens_used(cost, None, 0, reached_engine=False, whole_answer=True) == 0
    # a charge cut below what the request takes whatever it generates (a replica's share while Redis is down)
    assert tokens_used(cost, None, 0, reached_engine=True, whole_answer=True, charged=10) == cost.least_charge_tokens
    assert tokens_used(cost, None, 0, reached_engine=True, whole_answer=True, charged=1005) == 1005


def test_a_batched_streams_events_count_the_tokens_they_carry_at_least() -> None:
    """Unbatched, the event count as before; batched by 8, events less the ones that may carry nothing (role,
    usage, [DONE]), two per sequence at one token, the rest at 8."""
    assert [tokens_streamed(e, 1) for e in range(5)] == [0, 1, 2, 3, 4]
    assert [tokens_streamed(e, 8) for e in range(8)] == [0, 0, 0, 0, 1, 2, 10, 18]
    # 50 tokens by 8, and [DONE]: 34 at least, and at most 1 + 8 x 8 sent, 7 more unsent: 38 past the floor
    assert tokens_streamed(9, 8) == 34 and stream_lead(9, 8) == 38
    # a chat with interval 100: its role chunk and first token say 0 at least, at most 1 + 99 unsent
    assert tokens_streamed(2, 100) == 0 and stream_lead(2, 100, opening=1) == 100
    assert stream_lead(9, 1) == 0


@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=4),
    st.integers(2, 64),
    st.booleans(),
    st.booleans(),
    st.data(),
)
def test_a_batched_stream_lies_between_its_floor_and_its_lead(
    lengths: list[int], interval: int, chat: bool, usage: bool, data: st.DataObject
) -> None:
    """Sequences of ``lengths`` tokens cut into events as vLLM cuts them (each its first token at once, then
    per ``interval``, the rest at the end; a chat's role chunks first; the usage and [DONE] last), read at any
    point of the stream: the tokens the events so far carry are at least the floor, and what the engine has
    made until its next event (less the tokens of that event's own step, ENGINE_LEAD_TOKENS' part) at most
    the floor plus the lead per sequence."""
    n = len(lengths)
    timeline: list[int] = [0] * n if chat else []  # per event, the tokens it carries, in the order relayed
    made_by: list[int] = [0] * n if chat else []  # tokens the engine had made when the event was sent
    made = 0
    pending = [0] * n
    for step in range(max(lengths)):
        for s, length in enumerate(lengths):
            if step >= length:
                continue
            pending[s] += 1
            made += 1
            if step == 0 or step == length - 1 or pending[s] >= interval:
                timeline.append(pending[s])
                made_by.append(made)
                pending[s] = 0
    timeline += [0] * (int(usage) + 1)
    made_by += [made] * (int(usage) + 1)
    seen = data.draw(st.integers(1, len(timeline)))
    floor = tokens_streamed(seen, interval, n)
    assert floor <= sum(timeline[:seen])
    before_next = made_by[seen] - n if seen < len(made_by) else made
    assert before_next <= floor + n * stream_lead(seen, interval, n, opening=n if chat else 0)
