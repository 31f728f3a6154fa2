"""How long an answer takes once admitted, and what that leaves a client that reads its answer in one piece
under a read timeout (the OpenAI SDKs) for waiting in the queue."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.admission.controller import AdmissionController, Admitted, Rejected, UsageSample
from gateway.admission.output_lengths import BEYOND, OutputLengths
from gateway.admission.service_time import MIN_SAMPLES, MIN_TOKENS, ServicePace
from gateway.config import AdmissionConfig
from gateway.protocol.bodies import parse_body
from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import parse_request
from gateway.server.hints import client_hints
from gateway.tokens.cost import KvGeometry, RequestCost

GEO = KvGeometry(block_size=16, num_blocks=10_000)
KEY = ("m", "completions", "t")


def test_the_pace_is_unknown_until_enough_answers_long_enough_to_tell_have_ended() -> None:
    pace = ServicePace()
    for _ in range(20):
        pace.observe(MIN_TOKENS - 1, 5.0)  # mostly prefill: says nothing of decoding
    pace.observe(100, 0.0)  # no time at all: a clock that did not move
    assert len(pace) == 0 and pace.seconds_per_token() is None and pace.answer_s(500) == 0.0
    for _ in range(MIN_SAMPLES - 1):
        pace.observe(100, 2.0)
    assert pace.answer_s(500) == 0.0
    pace.observe(200, 4.0)
    assert pace.seconds_per_token() == 0.02 and pace.answer_s(500) == 10.0


def test_the_pace_errs_short_and_follows_the_engine_as_it_slows() -> None:
    """A tenant of long prompts and short answers (each one's prefill adds to its seconds per token) does not
    set everyone's pace: it is the lower quartile of the latest answers'."""
    pace = ServicePace(window=16, min_samples=4)
    for seconds in (1.0, 1.0, 1.0, 1.0, 1.0, 100.0, 100.0, 100.0):
        pace.observe(100, seconds)
    assert pace.seconds_per_token() == 0.01
    for _ in range(16):  # the engine got busier: only the latest 16 answers count
        pace.observe(100, 5.0)
    assert pace.seconds_per_token() == 0.05


def test_refusing_an_answer_outright_rests_on_the_pace_of_answers_about_as_long() -> None:
    """Short answers' prefill weighs on their seconds per token: 16 tokens after 1 s of prefill read as 75 ms a
    token, which would say a 1,000-token answer takes 75 s where it takes ~13.5 s."""
    pace = ServicePace()
    for _ in range(MIN_SAMPLES):
        pace.observe(16, 1.0 + 16 * 0.0125)
    assert pace.answer_s(1000) == pytest.approx(75.0)  # what the wait budget errs with, cutting short
    assert pace.answer_s_like(1000) == 0.0  # no answer a quarter as long: no pace to refuse on
    assert pace.answer_s_like(64) == pytest.approx(64 * 0.075)  # 16 tokens are a quarter of 64
    for _ in range(MIN_SAMPLES):
        pace.observe(800, 800 * 0.0125 + 1.0)
    assert pace.answer_s_like(1000) == pytest.approx(1000 * (0.0125 + 1 / 800))


def test_a_streams_first_event_wait_is_learned_from_the_latest_streams_and_errs_short() -> None:
    """A stream's response head waits for its first event (the engine's prefill, its own queue): under a read
    timeout, that much of it is not for waiting in kvgate's queue. Unknown (0) until enough streams began."""
    c = AdmissionController(AdmissionConfig(), GEO)
    c.begin_sample()
    c.apply_sample(UsageSample(0.0, 0.0))
    firsts = (0.5, 0.5, 2.0, 3.0, 3.0, 4.0, 4.0, 4.0)
    for i, first in enumerate(firsts):
        decision = c.submit(RequestCost((100,), 1, 10, 8), "t", 10.0 * i)
        assert isinstance(decision, Admitted)
        c.progress(decision.reservation, 1, 10.0 * i + first)
        c.progress(decision.reservation, 2, 10.0 * i + first + 1.0)  # later events teach nothing
        assert c.first_event.seconds() == (0.0 if i < MIN_SAMPLES - 1 else 0.5)
    for i in range(8):  # the engine slowed: the latest streams' lower quartile
        decision = c.submit(RequestCost((100,), 1, 10, 8), "t", 100.0 + i)
        assert isinstance(decision, Admitted)
        c.progress(decision.reservation, 1, 100.0 + i + 3.0)
    assert c.first_event.seconds() == 3.0


@given(st.lists(st.tuples(st.integers(0, 5000), st.floats(0.0, 1e4)), max_size=200), st.integers(0, 100_000))
def test_an_answer_time_is_never_negative_and_grows_with_its_length(
    answers: list[tuple[int, float]], tokens: int
) -> None:
    pace = ServicePace(window=32, min_samples=4)
    for n, seconds in answers:
        pace.observe(n, seconds)
    assert 0.0 <= pace.answer_s(tokens) <= pace.answer_s(tokens + 1)


def learned(c: AdmissionController, answers: int, tokens: int, seconds: float, budget: int = 1000) -> None:
    """``answers`` requests of KEY admitted at 0 that each answered ``tokens`` tokens whole, ending at
    ``seconds``."""
    for _ in range(answers):
        d = c.submit(RequestCost((16,), 1, budget, 70), "t", 0.0, key=KEY)
        assert isinstance(d, Admitted)
        c.learn(d.reservation, tokens, now=seconds)
        c.release(d.reservation, seconds)


def controller() -> AdmissionController:
    c = AdmissionController(AdmissionConfig(), GEO)
    c.begin_sample()
    c.apply_sample(UsageSample(0.0, 0.0))
    return c


def test_an_answer_takes_its_keys_median_length_at_the_latest_pace_within_its_own_budget() -> None:
    c = controller()
    assert c.answer_s(RequestCost((16,), 1, 1000, 70), KEY) == 0.0  # nothing known: no time taken off anyone
    learned(c, 40, 200, 10.0)  # 200 tokens in 10 s: 0.05 s per token
    assert c.answer_s(RequestCost((16,), 1, 1000, 70), KEY) == 10.0
    assert c.answer_s(RequestCost((16,), 1, 50, 5), KEY) == 2.5  # max_tokens 50: it stops there
    ignore_eos = RequestCost((16,), 1, 400, 30, min_output=2**31 - 1)  # runs to its budget, exactly
    assert c.answer_s(ignore_eos, KEY) == 20.0
    assert c.answer_s(RequestCost((16,), 2, 1000, 140), KEY) == 0.0  # n=2: its longest sequence is unknown


def test_a_key_whose_answers_run_to_their_budget_takes_at_least_what_they_produced() -> None:
    """Most answers of the key ran into their budget: where they would have ended is unknown, but not that they
    produced that much. The time its answer takes is that length's (less than the truth, never more), not
    nothing (a client of max_tokens that its answers always reach would be queued into its read timeout and
    send its request again), nor its whole budget (the rest of a context, for a chat without max_tokens)."""
    c = controller()
    for cap, answers in ((100, 14), (200, 13), (300, 13)):  # each stopped by its max_tokens: longer than that
        learned(c, answers, cap, cap * 0.05, budget=cap)  # 0.05 s per token
    assert len(c.pace) == 40
    assert c.lengths.quantile(KEY, 0.5) == BEYOND
    assert c.answer_s(RequestCost((16,), 1, 30_000, 1900), KEY) == 10.0  # no cap: the median, 200, at least
    assert c.answer_s(RequestCost((16,), 1, 200, 70), KEY) == 10.0
    assert c.answer_s(RequestCost((16,), 1, 50, 5), KEY) == 2.5  # a smaller cap still ends it sooner
    learned(c, 50, 20, 10.0, budget=1000)  # then most ended on their own, short: the median is theirs again
    assert c.lengths.quantile(KEY, 0.5) == 20


@given(
    st.lists(st.tuples(st.integers(0, 3000), st.booleans()), min_size=32, max_size=300),
    st.floats(0.01, 0.99),
)
@example([(n, True) for n in range(1, 35)] + [(3000, False)], 29 / 35)  # q * n lands a hair above 29
def test_what_a_key_produced_errs_short_of_its_lengths(observed: list[tuple[int, bool]], q: float) -> None:
    """The stand-in for a quantile past every length seen to end is the quantile of the same lengths with every
    stopped one ended where it stopped (the least it could be): never above the censored estimate."""
    lengths = OutputLengths(min_samples=32)
    for tokens, ended in observed:
        lengths.observe(KEY, tokens, ended=ended)
    everything_ended = OutputLengths(min_samples=32)
    for tokens, _ in observed:
        everything_ended.observe(KEY, tokens)
    short = lengths.at_least(KEY, q)
    assert short == everything_ended.quantile(KEY, q)
    assert short is None or short <= max(tokens for tokens, _ in observed)
    censored = lengths.quantile(KEY, q)  # Kaplan-Meier: the stopped ones only known to end later
    assert short is None or censored is None or short <= censored


def test_a_stopped_answer_teaches_no_pace() -> None:
    c = controller()
    for _ in range(40):
        d = c.submit(RequestCost((16,), 1, 1000, 70), "t", 0.0, key=KEY)
        assert isinstance(d, Admitted)
        c.learn(d.reservation, 200, ended=False, now=1000.0)  # its client left: the time says nothing
        c.release(d.reservation, 1000.0)
    assert len(c.pace) == 0


def test_only_the_sdks_read_timeout_bounds_the_whole_answer() -> None:
    """The SDK's read timeout fires when no byte has come for that long: for an answer sent in one piece, that
    is the whole generation. kvgate's own header is a queue budget and nothing else."""
    assert client_hints([(b"x-stainless-read-timeout", b"60")]).read_timeout is True
    assert client_hints([(b"x-kvgate-max-wait-s", b"60")]).read_timeout is False
    both = client_hints([(b"x-kvgate-max-wait-s", b"30"), (b"x-stainless-read-timeout", b"60")])
    assert both.wait_s == 30.0 and both.read_timeout is False


def test_a_budget_without_room_for_the_answer_is_refused_at_once_rather_than_queued_to_time_out() -> None:
    """The controller's side of a wait budget cut by the answer's time (the exchange passes what is left): with
    nothing left, a request that fits now is admitted, and one that would have to wait is refused at once,
    with a Retry-After."""
    c = controller()
    learned(c, 40, 200, 10.0)
    for i in range(10):
        c.drain.record(20.0 + i)  # one finish a second
    c.begin_sample()
    c.apply_sample(UsageSample(0.0, 30.0))  # fresh: the engine is empty
    assert isinstance(c.submit(RequestCost((16,), 1, 1000, 70), "t", 30.0, max_wait_s=0.0, key=KEY), Admitted)
    # ignore_eos: runs to its whole budget, which takes the rest of the pool
    blocker = c.submit(RequestCost((16,), 1, 143_664, 8_980, min_output=2**31 - 1), "x", 30.0)
    assert isinstance(blocker, Admitted)
    refused = c.submit(RequestCost((16,), 1, 1000, 70), "t", 30.0, max_wait_s=0.0, key=KEY)
    assert isinstance(refused, Rejected) and refused.retry_after_s >= 1.0


def test_a_request_knows_whether_its_answer_comes_in_one_piece() -> None:
    assert parse_request("completions", b'{"prompt": "x"}').whole_answer is True
    assert (
        parse_request("chat", b'{"messages": [{"role": "user", "content": "x"}], "stream": true}').whole_answer is False
    )
    assert parse_body("responses", b'{"input": "x", "stream": true}').whole_answer is False
    assert parse_body("responses", b'{"input": "x"}').whole_answer is True
    with pytest.raises(GatewayError):  # as on chat and completions: a boolean, not something like one
        parse_body("messages", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": 1}')
    assert parse_body("pooling", b'{"input": "x"}').whole_answer is True
    assert parse_body("audio", b"--multipart--").whole_answer is False  # unread: it may stream


async def test_only_a_whole_answer_under_a_read_timeout_has_its_answer_time_kept_out_of_its_wait() -> None:
    """The exchange's wait budget: the SDK's read timeout, less the answer's expected time, for an answer sent
    whole; a stream, or a budget said in kvgate's own header, is not cut; a refusal says the time it kept."""
    from gateway.admission.admitter import Admitter
    from gateway.metrics import GatewayMetrics
    from gateway.server.hints import ClientHints
    from tests.unit.test_admitter import exchange, tenant

    clock = [30.0]
    admitter = Admitter(controller(), GatewayMetrics(), lambda: clock[0])
    learned(admitter.controller, 40, 200, 10.0)  # 200 tokens in 10 s
    cost = RequestCost((16,), 1, 1000, 70)
    cases = [
        (ClientHints(59.0, read_timeout=True), True, 49.0),
        (ClientHints(59.0, read_timeout=True), False, 59.0),  # a stream: its read timeout runs between events
        (ClientHints(59.0), True, 59.0),  # x-kvgate-max-wait-s: a queue budget
        (ClientHints(5.0, read_timeout=True), True, 0.0),
    ]
    for hints, whole, budget in cases:
        ex = exchange(admitter)
        ex.client, ex.whole_answer = hints, whole
        await ex.charge_rate_limits(tenant(admitter), cost, KEY)
        assert ex.wait_budget_s == budget, (hints, whole)
