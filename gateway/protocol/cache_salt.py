"""A prefix cache of each tenant's own: vLLM shares cached prompt blocks between every request of an engine, so
one tenant could tell, from its time to first token (or ``usage.prompt_tokens_details.cached_tokens``), whether
another tenant's prompt starts the way it guesses. vLLM keeps requests with different ``cache_salt`` values
from sharing cached blocks (the salt is hashed into a prompt's first block), so with
``auth.isolate_prefix_cache`` every generation goes to the engine with a salt derived from its tenant.

The salt is a digest of the tenant's name and the client's own salt, if it sent one: a client still splits its
tenant's cache further as it likes, and cannot name another tenant's salt (the tenant is the one its key
authenticated). It is derived, not random, so every gateway replica in front of an engine gives one tenant the
same salt and the tenant's requests keep sharing their prefixes.

The body is not re-serialized when it cannot hold a salt of the client's (the common case: no ``cache_salt``
in it, nor a ``\\u`` escape that could spell one): the salt is appended as the object's last member, and every
other byte reaches the engine as the client sent it. Otherwise it is parsed and written again with the
client's salt replaced (an integer past 64 bits then becomes a float, as orjson reads it).
"""

from __future__ import annotations

import hashlib

import orjson

from gateway.protocol.errors import bad_request
from gateway.protocol.requests import json_object

_DOMAIN = b"kvgate cache_salt v1\0"
# vLLM's own checks of a salt (entrypoints/generate/base/protocol.py): a client's is refused as vLLM would
MAX_SALT_LENGTH = 128
FORBIDDEN_SALT_CHARS = frozenset("@/\\\x00")


def tenant_salt(tenant: str, client_salt: str | None) -> str:
    """128 bits of a digest of the two, encoded as a JSON pair (no way to move a boundary between them)."""
    digest = hashlib.sha256(_DOMAIN + orjson.dumps([tenant, client_salt or ""]))
    return digest.hexdigest()[:32]


def salted(raw: bytes, tenant: str) -> bytes:
    """``raw``, a JSON object, with the tenant's ``cache_salt``; a 400 for a client salt vLLM would refuse."""
    if b"cache_salt" not in raw and b"\\u" not in raw:
        head = raw.rstrip()[:-1].rstrip()  # without its closing brace
        member = b'"cache_salt":"' + tenant_salt(tenant, None).encode() + b'"'
        return head + (b"" if head.endswith(b"{") else b",") + member + b"}"
    body = json_object(raw)
    client_salt = body.get("cache_salt")
    if client_salt is not None and (
        not isinstance(client_salt, str)
        or not client_salt
        or len(client_salt) > MAX_SALT_LENGTH
        or not FORBIDDEN_SALT_CHARS.isdisjoint(client_salt)
    ):
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    return orjson.dumps({**body, "cache_salt": tenant_salt(tenant, client_salt)})
