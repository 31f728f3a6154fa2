"""CostEstimator's fast path: text checked at its learned band's high end decides as an exact count would,
skips the tokenizer far from the limits and counts near them, and reserves a quantile of the learned ratio,
whose sum over many prompts stays at or above their exact total. A real (tiny) BPE tokenizer with a chat
template is the exact counter and the "engine" that teaches the estimator."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import InferenceRequest, parse_request
from gateway.tokens.conversations import ConversationCounts
from gateway.tokens.cost import KvGeometry, RequestCost
from gateway.tokens.counting import TokenCounter
from gateway.tokens.estimator import CostEstimator
from gateway.tokens.media import MediaTokens
from gateway.tokens.prompt_estimate import PromptLengths
from gateway.tokens.tokenizers import HeuristicTokenizer, HFTokenizer, LocalTokenizer
from tests.support.bpe import build_bpe_dir

MAX_MODEL_LEN = 400
GEO = KvGeometry(block_size=16, num_blocks=60)  # at most 54 blocks (864 tokens) in use at the 0.9 watermark
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCABULARY = (
    "the quick brown fox jumps over lazy dog admission queue tokens blocks engine cache gateway prompt "
    "request budget tenant reservation usage context length never fits watermark 42 1999 3.14 ok? yes! "
    "naïve café über straße 東京 数据 ✓ -> {} [] () ; : , ."
)
WORDS = VOCABULARY.split()


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    rng = random.Random(1)
    corpus = [" ".join(rng.choices(WORDS, k=50)) for _ in range(300)]
    directory = build_bpe_dir(tmp_path_factory.mktemp("bpe"), corpus, 500, TEMPLATE)
    loaded = HFTokenizer.load(str(directory))
    assert loaded.has_chat_template
    return loaded


class SpyCounter(TokenCounter):
    """Counts how often the tokenizer (or /tokenize) was asked."""

    calls = 0

    async def count(self, request: InferenceRequest) -> tuple[int, ...]:
        self.calls += 1
        return await super().count(request)


TEXT_PRICE = RequestCost((0,), 1, 0, 0)  # what a text request was priced at: learning reads it only for media


def estimator(
    counter: TokenCounter, *, fast_path: bool = True, min_samples: int = 100, max_error_share: float = 1.0
) -> CostEstimator:
    """``max_error_share`` 1: this pool is tiny (960 tokens), so any band would be wide against the default 1%."""
    return CostEstimator(
        counter,
        geometry=lambda: GEO,
        max_model_len=lambda: MAX_MODEL_LEN,
        fast_path=fast_path,
        max_error_share=max_error_share,
        lengths=PromptLengths(min_samples=min_samples),
    )


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words))


def random_request(rng: random.Random, *, batches: bool = False) -> InferenceRequest:
    """Prompts from a few tokens to twice the context; max_tokens absent or up to the context; n up to 3."""
    body: dict[str, Any] = {"model": "m", "n": rng.randint(1, 3)}
    if rng.random() < 0.7:
        body["max_tokens"] = rng.randint(1, MAX_MODEL_LEN)
    words = int(rng.choice([rng.uniform(1, 40), rng.uniform(40, 400)]))
    if rng.random() < 0.5:
        turns = rng.randint(1, 4)
        body["messages"] = [
            {"role": rng.choice(["system", "user", "assistant"]), "content": text(rng, max(1, words // turns))}
            for _ in range(turns)
        ]
        return parse_request("chat", orjson.dumps(body))
    prompts = [text(rng, words) for _ in range(rng.randint(2, 3) if batches and rng.random() < 0.3 else 1)]
    body["prompt"] = prompts if len(prompts) > 1 else prompts[0]
    return parse_request("completions", orjson.dumps(body))


async def teach(costs: CostEstimator, local: LocalTokenizer, requests: int, seed: int = 0) -> None:
    """The engine's usage.prompt_tokens for served requests: here, the exact count."""
    rng = random.Random(seed)
    exact = TokenCounter(local)
    for _ in range(requests):
        request = random_request(rng)
        costs.learn(request, TEXT_PRICE, sum(await exact.count(request)))


async def priced(costs: CostEstimator, request: InferenceRequest) -> RequestCost | str:
    try:
        return await costs.estimate(request)
    except GatewayError as err:
        assert err.status == 400
        return str(err.code)


async def test_the_fast_path_decides_as_exact_counting_and_reserves_at_least_the_total(hf: HFTokenizer) -> None:
    """Random requests near and far from the context length (400) and the never-fits ceiling (54 blocks): the
    fast path accepts what exact counting accepts and refuses what it refuses, with the exact count's own
    error; what it reserves for the prompts it accepts sums to at least their exact total (1.02x here)."""
    fast, exact = estimator(SpyCounter(hf)), estimator(TokenCounter(hf), fast_path=False)
    await teach(fast, hf, 400)
    assert fast.lengths.learned(("m", "chat")) and fast.lengths.learned(("m", "completions"))
    rng = random.Random(99)
    refusals: set[str] = set()
    reserved = exact_tokens = 0
    for _ in range(600):
        request = random_request(rng, batches=True)
        by_fast, by_count = await priced(fast, request), await priced(exact, request)
        if isinstance(by_count, str):
            assert by_fast == by_count
            refusals.add(by_count)
            continue
        assert isinstance(by_fast, RequestCost), f"the fast path refused what fits: {by_fast}"
        assert by_fast.num_sequences == by_count.num_sequences  # (without max_tokens the budget is the context's rest)
        assert by_fast.charge_tokens >= by_count.total_tokens  # a tenant's token charge never falls short
        reserved += sum(by_fast.prompt_tokens)
        exact_tokens += sum(by_count.prompt_tokens)
    print(f"\n[fast path] prompts priced by estimate reserve {reserved / exact_tokens:.3f}x their exact total")
    assert exact_tokens <= reserved <= 1.15 * exact_tokens, (reserved, exact_tokens)
    tally = fast.tally
    assert refusals == {"context_length_exceeded", "kv_cache_capacity_exceeded"}  # both limits were reached
    assert tally.by_estimate > 150 and tally.near_limit > 50  # both far (skipped) and near (counted)
    assert tally.by_estimate + tally.by_tokenizer == 600
    assert isinstance(fast.counter, SpyCounter) and fast.counter.calls == tally.by_tokenizer


async def test_a_prompt_far_past_the_context_is_refused_with_its_exact_count(hf: HFTokenizer) -> None:
    costs = estimator(TokenCounter(hf), min_samples=50)
    await teach(costs, hf, 200)
    request = parse_request("completions", orjson.dumps({"model": "m", "prompt": text(random.Random(5), 2000)}))
    exact = (await TokenCounter(hf).count(request))[0]
    with pytest.raises(GatewayError) as err:
        await costs.estimate(request)
    assert err.value.code == "context_length_exceeded" and f"contains {exact} input tokens" in err.value.message
    assert costs.tally.near_limit == 1 and costs.tally.by_tokenizer == 1


async def test_nothing_is_estimated_before_the_key_has_learned(hf: HFTokenizer) -> None:
    costs = estimator(SpyCounter(hf), min_samples=50)
    await teach(costs, hf, 20)
    request = parse_request("chat", orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    await costs.estimate(request)
    assert (costs.tally.by_estimate, costs.tally.by_tokenizer) == (0, 1)
    other = parse_request("chat", orjson.dumps({"model": "other", "messages": [{"role": "user", "content": "hi"}]}))
    await teach(costs, hf, 100)
    await costs.estimate(request)
    await costs.estimate(other)  # another model has learned nothing
    assert (costs.tally.by_estimate, costs.tally.by_tokenizer) == (1, 2)


async def test_switched_off_forced_or_heuristic_always_counts(hf: HFTokenizer) -> None:
    request = parse_request("chat", orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    switched_off = estimator(TokenCounter(hf), fast_path=False, min_samples=50)
    heuristic = estimator(TokenCounter(HeuristicTokenizer()), min_samples=50)
    for costs in (switched_off, heuristic):
        await teach(costs, hf, 150)
        await costs.estimate(request)
        assert (costs.tally.by_estimate, costs.tally.by_tokenizer) == (0, 1)
    assert switched_off.lengths.learned(("m", "chat"))  # it learns (and measures) all the same
    assert len(heuristic.lengths) == 0  # its count is an estimate already: nothing would use what it learned
    costs = estimator(TokenCounter(hf), min_samples=50)
    await teach(costs, hf, 150)
    await costs.estimate(request, exact=True)
    await costs.estimate(request)
    assert (costs.tally.by_estimate, costs.tally.by_tokenizer) == (1, 1)


async def test_token_ids_are_counted_and_teach_nothing(hf: HFTokenizer) -> None:
    costs = estimator(TokenCounter(hf), min_samples=1)
    request = parse_request("completions", orjson.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}))
    costs.learn(request, TEXT_PRICE, 3)
    assert len(costs.lengths) == 0
    assert (await costs.estimate(request)).prompt_tokens == (3,)
    assert (costs.tally.by_token_ids, costs.tally.by_tokenizer, costs.tally.by_estimate) == (1, 0, 0)


async def test_batches_and_images_teach_no_tokens_per_byte(hf: HFTokenizer) -> None:
    costs = estimator(TokenCounter(hf), min_samples=1)
    costs.learn(parse_request("completions", orjson.dumps({"prompt": ["a", "b"]})), TEXT_PRICE, 2)
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    with_image = parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": [image]}]}))
    costs.learn(with_image, await costs.estimate(with_image), 600)
    costs.learn(parse_request("completions", orjson.dumps({"prompt": "a"})), TEXT_PRICE, 0)
    assert len(costs.lengths) == 0


async def test_an_image_is_priced_at_what_the_engine_said_images_take(hf: HFTokenizer) -> None:
    """A local tokenizer renders an image as the template's placeholder; the engine's processor expands it to
    hundreds of tokens. Each image is priced at the prior, then at what served requests' usage showed (their
    count less the text kvgate counted), per model; the engine's /tokenize counts images itself."""
    context = {"len": 32_000}
    costs = CostEstimator(
        TokenCounter(hf),
        geometry=lambda: KvGeometry(16, 10_000),
        max_model_len=lambda: context["len"],
        media=MediaTokens(prior=1000, min_samples=3, quantile=0.9),
    )
    image = {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}
    two = parse_request(
        "chat", orjson.dumps({"model": "m", "messages": [{"role": "user", "content": ["hi", image, image]}]})
    )
    text = (await TokenCounter(hf).count(two))[0]
    first = await costs.estimate(two)
    assert first.prompt_tokens == (text + 2000,) and first.media_tokens == 2000
    for per_image in (500, 600, 700):  # the engine counted the text and this many per image
        costs.learn(two, first, text + 2 * per_image)
    learned = await costs.estimate(two)
    assert learned.prompt_tokens == (text + 1400,) and learned.media_tokens == 1400
    costs.learn(two, learned, text + 2 * 400)  # priced with the learned allowance: still the text taken out
    assert costs.media.per_item(("m", "image")) == 700
    video = {"type": "video_url", "video_url": {"url": "https://x/cat.mp4"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [image, video]}]}
    both = parse_request("chat", orjson.dumps(body))
    mixed = await costs.estimate(both)
    assert mixed.media_tokens == 700 + 1000  # the video at the prior: it is not an image
    costs.learn(both, mixed, 5000)  # two modalities: which took what cannot be told, nothing is learned
    assert costs.media.per_item(("m", "video")) == 1000 and costs.media.per_item(("m", "image")) == 700
    near = parse_request(
        "chat", orjson.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [image]}]})
    )
    context["len"] = 100
    capped = await costs.estimate(near)  # an allowance never refuses: it is cut to what the context leaves
    near_text = (await TokenCounter(hf).count(near))[0]
    assert capped.prompt_tokens == (99,) and capped.max_output == 1 and capped.media_tokens == 99 - near_text
    async with aiohttp.ClientSession() as session:
        remote = estimator(TokenCounter(None, session=session, upstream="http://127.0.0.1:9"))
        assert remote._media_allowance(two) == 0


async def test_learn_measures_the_estimate_once_learned(hf: HFTokenizer) -> None:
    costs = estimator(TokenCounter(hf), min_samples=10)
    request = parse_request("completions", orjson.dumps({"model": "m", "prompt": "x" * 392}))  # 400 bytes
    for _ in range(10):
        costs.learn(request, TEXT_PRICE, 100)  # nothing measured while the prior answers
    assert costs.tally.errors.count == 0
    costs.learn(request, TEXT_PRICE, 100)
    costs.learn(request, TEXT_PRICE, 300)  # three times what was learned: past the band's high end
    errors = costs.tally.errors
    assert errors.count == 2 and errors.above_high == 1 and dict(errors.cumulative())[1.0] == 1


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_far_from_the_limits_there_is_no_tokenize_round_trip(
    hf: HFTokenizer, session: aiohttp.ClientSession
) -> None:
    """With the engine's /tokenize (here unreachable), a learned key prices short requests without asking."""
    costs = estimator(
        TokenCounter(None, session=session, upstream="http://127.0.0.1:9", tokenize_timeout_s=0.5), min_samples=50
    )
    await teach(costs, hf, 150)
    short = parse_request("chat", orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    assert (await costs.estimate(short)).prompt_tokens[0] > 0
    long = parse_request("completions", orjson.dumps({"model": "m", "prompt": text(random.Random(3), 300)}))
    with pytest.raises(GatewayError) as err:
        await costs.estimate(long)  # near the context: only /tokenize can say
    assert err.value.status == 503 and costs.tally.by_estimate == 1


async def test_a_prompt_whose_band_is_wide_against_the_pool_is_counted(hf: HFTokenizer) -> None:
    """Its error alone could eat the watermark's margin: exact, however far from the limits."""
    request = parse_request("chat", orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    costs = estimator(SpyCounter(hf), min_samples=50, max_error_share=0.0)
    await teach(costs, hf, 150)
    await costs.estimate(request)
    assert (costs.tally.by_estimate, costs.tally.by_tokenizer, costs.tally.near_limit) == (0, 1, 1)


# --- multi-turn conversations: an earlier turn's count narrows the band ------------------------------------

LONG_CONTEXT = 3000


def long_context_estimator(counter: TokenCounter, *, remember: bool = True) -> CostEstimator:
    """A context of 3,000 tokens and a pool far larger: only the context limit is near."""
    return CostEstimator(
        counter,
        geometry=lambda: KvGeometry(block_size=16, num_blocks=100_000),
        max_model_len=lambda: LONG_CONTEXT,
        lengths=PromptLengths(min_samples=100),
        conversations=ConversationCounts(min_bytes=0 if remember else 1 << 40),
    )


def chat(messages: list[dict[str, str]], max_tokens: int) -> InferenceRequest:
    return parse_request("chat", orjson.dumps({"model": "m", "messages": messages, "max_tokens": max_tokens}))


async def converse(costs: CostEstimator, hf: HFTokenizer, seed: int) -> tuple[int, int]:
    """A conversation that grows a turn at a time until the context refuses it. Every turn: the decision is
    the exact count's, the high end it was checked at is at least the exact count, and what the engine served
    teaches the estimator (its usage). Returns (turns priced by an earlier turn, turns counted)."""
    rng = random.Random(seed)
    exact = TokenCounter(hf)
    messages = [{"role": "user", "content": text(rng, 200)}]
    by_conversation = counted = 0
    for _ in range(200):
        request = chat(messages, max_tokens=rng.randint(50, 300))
        truth = (await exact.count(request))[0]
        before = (costs.tally.by_conversation, costs.tally.by_tokenizer)
        try:
            cost = await costs.estimate(request)
        except GatewayError as err:
            assert truth >= LONG_CONTEXT, "refused what fits"  # vLLM clamps max_tokens: only the prompt counts
            assert err.code == "context_length_exceeded"
            break
        assert truth < LONG_CONTEXT, "admitted what does not fit"
        assert (cost.prompt_high or cost.prompt_tokens)[0] >= truth
        by_conversation += costs.tally.by_conversation - before[0]
        counted += costs.tally.by_tokenizer - before[1]
        costs.learn(request, TEXT_PRICE, truth)
        messages += [
            {"role": "assistant", "content": text(rng, rng.randint(10, 60))},
            {"role": "user", "content": text(rng, rng.randint(1, 20))},
        ]
    else:
        raise AssertionError("the conversation never reached the context limit")
    return by_conversation, counted


@pytest.mark.parametrize("seed", range(4))
async def test_a_long_conversation_is_decided_by_its_earlier_turns_count_not_counted_again(
    hf: HFTokenizer, seed: int
) -> None:
    """Near the context limit the learned band (a few percent of the prompt) straddles it turn after turn and
    each turn is counted; with the previous turn's count known, the band is the new messages' alone."""
    remembering = long_context_estimator(SpyCounter(hf))
    forgetting = long_context_estimator(SpyCounter(hf), remember=False)
    for costs in (remembering, forgetting):
        await teach(costs, hf, 150)
    remembered = await converse(remembering, hf, seed)
    forgot = await converse(forgetting, hf, seed)
    # this tiny BPE's band is wide: from half the context on, the plain band straddles it (30 of ~35 turns
    # counted); an earlier turn's count, with the new turn at one token per byte, leaves 4-5 counted
    assert forgot[0] == 0 and forgot[1] >= 10
    assert remembered[0] >= 10 and remembered[1] <= forgot[1] // 4


async def test_a_conversation_counted_before_is_priced_at_its_count(hf: HFTokenizer) -> None:
    costs = long_context_estimator(SpyCounter(hf))
    rng = random.Random(5)
    request = chat([{"role": "user", "content": text(rng, 900)}], max_tokens=10)  # near 3,000: counted
    first = await costs.estimate(request)
    assert costs.tally.by_tokenizer == 1
    again = await costs.estimate(request)
    assert again.prompt_tokens == first.prompt_tokens and costs.tally.by_conversation == 1
    assert costs.tally.by_tokenizer == 1


async def test_a_dense_new_turn_is_no_draw_from_the_learned_band(hf: HFTokenizer) -> None:
    """Learned on prose, then a turn of characters the tokenizer has no merges for (one token each): checked at
    the learned ratio it would pass the context limit unseen; at one token per byte it is counted, and refused
    exactly as the count refuses it."""
    costs = long_context_estimator(SpyCounter(hf))
    await teach(costs, hf, 400)  # ~200 chats: the chat key has learned (100 needed)
    assert costs.lengths.learned(("m", "chat"))
    rng = random.Random(7)
    exact = TokenCounter(hf)
    messages = [{"role": "user", "content": text(rng, 2150)}]  # ~2,400 tokens
    first = chat(messages, max_tokens=10)
    costs.learn(first, TEXT_PRICE, (await exact.count(first))[0])
    dense = "".join(rng.choices("#$%&*+/<=>@^_`|~", k=900))
    later = chat([*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": dense}], 10)
    truth = (await exact.count(later))[0]
    known = (await exact.count(first))[0]
    assert known < LONG_CONTEXT <= truth  # the premise: the prefix fits, the dense turn takes it past the limit
    with pytest.raises(GatewayError) as err:
        await costs.estimate(later)
    assert err.value.code == "context_length_exceeded" and costs.tally.by_conversation == 0


def test_a_reserve_above_the_checked_high_end_is_priced_at_the_high_end(hf: HFTokenizer) -> None:
    """On a large window the byte-weighted reserve can pass the rank-based high end the limits were checked
    at; priced at it, a prompt inside every limit at its high end could be refused (here: past the context)."""
    costs = estimator(TokenCounter(hf))
    request = InferenceRequest("completions", "m", 1, 8, None, [[]], None)
    cost = costs._decided(request, highs=(380,), reserved=(395,), geometry=GEO)
    assert cost is not None and cost.prompt_tokens == (380,)
