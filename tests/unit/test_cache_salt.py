"""Per-tenant cache salts: derived (every replica gives a tenant the same), apart between tenants, and the rest of
the body as the client sent it."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.cache_salt import salted, tenant_salt
from gateway.protocol.errors import GatewayError

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=12), _JSON, max_size=6), st.text(min_size=1, max_size=12))
def test_only_the_salt_changes(body: dict[str, object], tenant: str) -> None:
    body.pop("cache_salt", None)
    out = orjson.loads(salted(orjson.dumps(body), tenant))
    assert out.pop("cache_salt") == tenant_salt(tenant, None)
    assert out == body


def test_salts_are_the_tenants_and_the_clients_together() -> None:
    assert tenant_salt("a", None) == tenant_salt("a", None) == tenant_salt("a", "")
    assert len({tenant_salt("a", None), tenant_salt("b", None), tenant_salt("a", "x"), tenant_salt("b", "x")}) == 4
    assert tenant_salt("a\0b", None) != tenant_salt("a", "b") != tenant_salt("a\0", "b\0")  # no boundary to move
    body = orjson.loads(salted(b'{"prompt": "p", "cache_salt": "x"}', "a"))
    assert body == {"prompt": "p", "cache_salt": tenant_salt("a", "x")}


@pytest.mark.parametrize("bad", ["", 7, ["x"], {"a": 1}])
def test_a_salt_vllm_would_refuse_is_400(bad: object) -> None:
    with pytest.raises(GatewayError) as err:
        salted(orjson.dumps({"prompt": "p", "cache_salt": bad}), "a")
    assert (err.value.status, err.value.param) == (400, "cache_salt")
