"""Per-tenant cache salts: derived (every replica gives a tenant the same), apart between tenants, the client's
own refused where vLLM would refuse it, and the rest of the body as the client sent it."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.cache_salt import salted, tenant_salt
from gateway.protocol.errors import GatewayError

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=12), _JSON, max_size=6), st.text(min_size=1, max_size=12), st.booleans())
def test_only_the_salt_changes(body: dict[str, object], tenant: str, ascii_only: bool) -> None:
    """Whatever the body (integers past 64 bits, non-ASCII text, escaped or not, whitespace): as vLLM reads it
    (``json.loads``: the last of a repeated key wins), it is the client's with the tenant's salt added."""
    body.pop("cache_salt", None)
    raw = json.dumps(body, ensure_ascii=ascii_only, indent=2 if ascii_only else None).encode() + b"\n"
    out = json.loads(salted(raw, tenant))
    assert out.pop("cache_salt") == tenant_salt(tenant, None)
    if b"\\u" not in raw and b"cache_salt" not in raw:
        assert out == body  # untouched bytes: even integers past 64 bits


def test_a_clients_own_salt_is_replaced_by_the_tenants_with_it() -> None:
    assert tenant_salt("a", None) == tenant_salt("a", None) == tenant_salt("a", "")
    assert len({tenant_salt("a", None), tenant_salt("b", None), tenant_salt("a", "x"), tenant_salt("b", "x")}) == 4
    assert tenant_salt("a\0b", None) != tenant_salt("a", "b") != tenant_salt("a\0", "b\0")  # no boundary to move
    assert orjson.loads(salted(b'{"prompt": "p", "cache_salt": "x"}', "a")) == {
        "prompt": "p",
        "cache_salt": tenant_salt("a", "x"),
    }
    escaped = b'{"prompt": "p", "\\u0063ache_salt": "x"}'  # the same key, spelled with an escape
    assert json.loads(salted(escaped, "a"))["cache_salt"] == tenant_salt("a", "x")
    assert json.loads(salted(b"{}", "a")) == {"cache_salt": tenant_salt("a", None)}


@pytest.mark.parametrize("bad", ["", 7, ["x"], {"a": 1}, "x" * 129, "a@b", "a/b", "a\\b", "a\x00b"])
def test_a_salt_vllm_would_refuse_is_400(bad: object) -> None:
    with pytest.raises(GatewayError) as err:
        salted(orjson.dumps({"prompt": "p", "cache_salt": bad}), "a")
    assert (err.value.status, err.value.param) == (400, "cache_salt")
