"""A prefix cache of each tenant's own: vLLM shares cached prompt blocks between every request of an engine, so
one tenant could tell, from its time to first token (or ``usage.prompt_tokens_details.cached_tokens``), whether
another tenant's prompt starts the way it guesses. vLLM keeps requests with different ``cache_salt`` values
from sharing cached blocks (the salt is hashed into a prompt's first block), so with
``auth.isolate_prefix_cache`` every generation goes to the engine with a salt derived from its tenant.

The salt is a digest of the tenant's name and the client's own salt, if it sent one: a client still splits its
tenant's cache further as it likes, and cannot name another tenant's salt (the tenant is the one its key
authenticated). It is derived, not random, so every gateway replica in front of an engine gives one tenant the
same salt and the tenant's requests keep sharing their prefixes.
"""

from __future__ import annotations

import hashlib

import orjson

from gateway.protocol.errors import bad_request
from gateway.protocol.requests import json_object

_DOMAIN = b"kvgate cache_salt v1\0"


def tenant_salt(tenant: str, client_salt: str | None) -> str:
    """128 bits of a digest of the two, encoded as a JSON pair (no way to move a boundary between them)."""
    digest = hashlib.sha256(_DOMAIN + orjson.dumps([tenant, client_salt or ""]))
    return digest.hexdigest()[:32]


def salted(raw: bytes, tenant: str) -> bytes:
    """The JSON body with its ``cache_salt`` replaced by the tenant's (a 400 for a client salt vLLM would refuse:
    not a non-empty string)."""
    body = json_object(raw)
    client_salt = body.get("cache_salt")
    if client_salt is not None and (not isinstance(client_salt, str) or not client_salt):
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    body["cache_salt"] = tenant_salt(tenant, client_salt)
    return orjson.dumps(body)
