"""Prefix affinity: the chunk-hash chain of a prompt's leading bytes, the bounded map of which engine took which
prefix, and placement that prefers the affine engine only within its headroom bound."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.affinity import PrefixMap, prefix_chain
from gateway.admission.controller import AdmissionController, Admitted
from gateway.config import AdmissionConfig, OutputEstimateConfig, PrefixAffinityConfig
from gateway.protocol.prompt_prefix import leading_bytes
from gateway.protocol.requests import InferenceRequest
from tests.unit.test_pool import req, sample

CHUNK = 16


def pool(max_headroom_cost: float = 0.05) -> AdmissionController:
    config = AdmissionConfig(
        output_estimate=OutputEstimateConfig(enabled=False),
        exclusive_upstream=False,
        prefix_affinity=PrefixAffinityConfig(max_headroom_cost=max_headroom_cost),
    )
    c = AdmissionController(config, engines=())
    for name in ("e0", "e1"):
        c.add_engine(name)
        sample(c, name, 0.0, 0.0, 100)
    return c


@given(st.binary(max_size=200), st.binary(max_size=200), st.integers(1, 8))
def test_chains_agree_exactly_on_the_whole_chunks_two_prompts_share(a: bytes, b: bytes, max_chunks: int) -> None:
    ca, cb = prefix_chain(a, CHUNK, max_chunks), prefix_chain(b, CHUNK, max_chunks)
    assert len(ca) == min(len(a) // CHUNK, max_chunks)  # whole chunks only, at most max_chunks
    shared = 0
    while (
        shared < min(len(ca), len(cb))
        and a[shared * CHUNK : (shared + 1) * CHUNK] == b[shared * CHUNK : (shared + 1) * CHUNK]
    ):
        shared += 1
    assert ca[:shared] == cb[:shared]
    assert all(x != y for x, y in zip(ca[shared:], cb[shared:], strict=False))  # a chain never meets again


def test_the_longest_known_prefix_names_the_engine() -> None:
    m = PrefixMap(100)
    system = b"s" * 32
    m.record(prefix_chain(system + b"a" * 32, CHUNK, 8), "e0")
    m.record(prefix_chain(system + b"b" * 32, CHUNK, 8), "e1")
    assert m.lookup(prefix_chain(system + b"a" * 48, CHUNK, 8)) == ("e0", 4)  # the same conversation, one turn on
    assert m.lookup(prefix_chain(system + b"b" * 16, CHUNK, 8)) == ("e1", 3)
    assert m.lookup(prefix_chain(b"x" * 64, CHUNK, 8)) is None


def test_a_prefix_on_several_engines_prefers_none_but_what_follows_it_does() -> None:
    m = PrefixMap(100)
    system = b"s" * 32
    m.record(prefix_chain(system + b"a" * 32, CHUNK, 8), "e0")
    assert m.lookup(prefix_chain(system + b"new" * 20, CHUNK, 8)) == ("e0", 2)  # only e0 has seen it so far
    m.record(prefix_chain(system + b"b" * 32, CHUNK, 8), "e1")
    assert m.lookup(prefix_chain(system + b"new" * 20, CHUNK, 8)) is None  # both hold it: headroom decides
    assert m.lookup(prefix_chain(system + b"a" * 48, CHUNK, 8)) == ("e0", 4)  # conversation a is e0's
    assert m.lookup(prefix_chain(system + b"b" * 48, CHUNK, 8)) == ("e1", 4)


def test_the_map_forgets_the_least_recently_used_first() -> None:
    m = PrefixMap(4)
    old, new = prefix_chain(b"o" * 32, CHUNK, 8), prefix_chain(b"n" * 48, CHUNK, 8)
    m.record(old, "e0")
    m.record(new, "e1")
    assert len(m) == 4
    # the oldest hash went; a chain's deeper hash stands for its whole prefix on its own, so it still answers
    assert m.lookup(old[:1]) is None and m.lookup(old) == ("e0", 2) and m.lookup(new) == ("e1", 3)
    m.record(new, "e1")  # used again: now old's last hash is the least recent
    m.record(prefix_chain(b"z" * 16, CHUNK, 8), "e0")
    assert m.lookup(old) is None and len(m) == 4


def test_leading_bytes_of_chats_and_prompts() -> None:
    def request(
        messages: list[dict[str, object]] | None = None, prompts: list[object] | None = None
    ) -> InferenceRequest:
        return InferenceRequest("chat" if messages else "completions", "m", 1, None, messages, prompts or [], None)  # type: ignore[arg-type]

    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    one, two = leading_bytes(request(turn1), 1000), leading_bytes(request(turn2), 1000)
    assert two.startswith(one) and len(two) > len(one)  # a conversation's next turn extends its prefix
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}]}]
    assert leading_bytes(request(parts), 1000) == leading_bytes(request([{"role": "user", "content": "Hi"}]), 1000)
    assert leading_bytes(request(prompts=["é" * 100]), 9) == ("é" * 100).encode()[:9]
    assert len(leading_bytes(request(prompts=[list(range(100))]), 80)) == 80  # ten token ids
    assert leading_bytes(request(prompts=[[2**64 - 1, 1]]), 80).startswith(b"[18446744073709551615")  # no 500
    assert leading_bytes(request(turn2), 10) == two[:10]


def placed_on(c: AdmissionController, blocks: int, now: float, chain: tuple[int, ...] = ()) -> str:
    """Submit a request of ``blocks`` with this prefix; the engine it was admitted to (it must be admitted)."""
    d = c.submit(req(blocks), "t", now, prefix=chain)
    assert isinstance(d, Admitted)
    c.placed(d.reservation)  # what the admitter does once the admission takes effect
    return d.reservation.engine


def test_a_prefix_goes_back_to_its_engine_while_that_costs_little_headroom() -> None:
    c = pool(max_headroom_cost=0.05)
    chain = prefix_chain(b"conversation" * 10, CHUNK, 8)
    home = placed_on(c, 2, 0.1, chain)
    # without affinity every next one would alternate to the engine with more room; with it they stay home
    # until home is more than 0.05 fuller than the other after the request
    placed = [placed_on(c, 2, 0.1, chain) for _ in range(5)]
    assert placed[:2] == [home, home] and c.affinity_placements >= 2
    home_blocks = sum(r.blocks for r in c.engines[home].ledger.live())
    other = "e1" if home == "e0" else "e0"
    other_blocks = sum(r.blocks for r in c.engines[other].ledger.live())
    assert (home_blocks - other_blocks) / 100 <= 0.05 + 2 / 100  # never more than the bound (plus one request)
    assert other in placed  # the bound held: past it, the request went where the room is


def test_a_stale_or_ejected_home_is_not_preferred() -> None:
    c = pool(max_headroom_cost=1.0)
    chain = prefix_chain(b"q" * 64, CHUNK, 8)
    home = placed_on(c, 2, 0.1, chain)
    other = "e1" if home == "e0" else "e0"
    sample(c, other, 0.0, 5.0, 100)  # at t=5 only the other engine has a fresh sample: home is stale
    assert placed_on(c, 2, 5.0, chain) == other
    sample(c, home, 0.0, 5.0, 100)
    c.engines[home].ejected_until = 100.0  # ejected (refused connections): nothing is placed there
    assert placed_on(c, 2, 5.0, chain) == other


def test_no_affinity_without_a_prefix_or_without_room_at_home() -> None:
    c = pool(max_headroom_cost=1.0)  # affinity at any cost in balance, but never past the watermark
    chain = prefix_chain(b"p" * 64, CHUNK, 8)
    home = placed_on(c, 2, 0.1, chain)
    other = "e1" if home == "e0" else "e0"
    assert placed_on(c, 1, 0.1) == other  # no prefix: the most headroom, though home would cost nothing here
    assert placed_on(c, 1, 0.1, chain) == home  # the same request with the prefix goes home
    while (engine := placed_on(c, 10, 0.1, chain)) == home:
        pass
    assert engine == other  # home is full to the watermark: elsewhere
    assert sum(r.blocks for r in c.engines[home].ledger.live()) <= 90


def test_tenants_with_caches_apart_do_not_share_chunk_hashes() -> None:
    """With ``auth.isolate_prefix_cache`` another tenant's same prompt is no hit on the engine that has it:
    seeded by the tenant, the chains differ from the first chunk on, and the same tenant's agree."""
    data = b"the same system prompt " * 8
    a, b = prefix_chain(data, CHUNK, 8, seed="a"), prefix_chain(data, CHUNK, 8, seed="b")
    assert a == prefix_chain(data, CHUNK, 8, seed="a") and len(a) == len(b) > 0
    assert not set(a) & set(b) and not set(a) & set(prefix_chain(data, CHUNK, 8))
