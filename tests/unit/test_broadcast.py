"""An admin call's answers from every engine of a pool: relayed when they agree, a 502 that names each status
(never an address) when they do not."""

from __future__ import annotations

import pytest

from gateway.protocol.errors import GatewayError
from gateway.upstream.broadcast import Reply, agreed

OK = Reply(200, [(b"content-type", b"application/json")], b'{"ok": true}')


def test_agreeing_engines_are_relayed_as_the_first_answered() -> None:
    assert agreed([OK, Reply(200, [], b"{}")]) is OK
    same_refusal = Reply(400, [], b"already loaded")
    assert agreed([same_refusal, Reply(400, [], b"already loaded")]) is same_refusal


@pytest.mark.parametrize(
    ("replies", "listed"),
    [
        ([OK, Reply(404, [], b"")], "engine 1: 200, engine 2: 404"),
        ([OK, GatewayError(503, "The inference engine is unreachable.")], "engine 1: 200, engine 2: 503"),
        ([GatewayError(504, "late"), Reply(504, [], b"")], "engine 1: 504, engine 2: 504"),
    ],
)
def test_engines_that_disagree_or_were_not_reached_are_a_502(replies: list[Reply | GatewayError], listed: str) -> None:
    with pytest.raises(GatewayError) as err:
        agreed(replies)
    assert (err.value.status, err.value.code) == (502, "engines_disagree") and listed in err.value.message


def test_a_pool_none_of_whose_engines_was_reached_says_why_as_one_engine_would() -> None:
    unreachable = GatewayError(503, "The inference engine is unreachable.", retry_after_s=1.0)
    with pytest.raises(GatewayError) as err:
        agreed([unreachable, GatewayError(503, "The inference engine is unreachable.")])
    assert err.value is unreachable
