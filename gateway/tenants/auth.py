"""Authentication: which tenant sends this request, from its ``Authorization: Bearer`` key.

Keys may be written in the config in plain text or as ``sha256:<hex>``; incoming keys are hashed once and
looked up, so plain keys never need to be stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from gateway.config import AuthConfig, TenantConfig
from gateway.protocol.errors import GatewayError


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _digest_of(key: str) -> str:
    """A configured key, plain or ``sha256:<hex>``, as the digest incoming keys are compared with."""
    return key.removeprefix("sha256:").lower() if key.startswith("sha256:") else key_digest(key)


class AdminKeys:
    """The keys that may call allow-listed admin routes (``passthrough.admin_api_keys``); none configured means
    a tenant's key may (never an anonymous caller)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = frozenset(_digest_of(k) for k in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, authorization: bytes | None) -> bool:
        token = _bearer(authorization)
        return token is not None and key_digest(token) in self._digests

    def check(self, authorization: bytes | None) -> None:
        if not self.accepts(authorization):
            raise GatewayError(403, "This route needs an admin API key.", type="permission_error", code="forbidden")


class TenantDirectory:
    def __init__(self, auth: AuthConfig, tenants: Iterable[TenantConfig]) -> None:
        self.require_api_key = auth.require_api_key
        self.default_tenant = auth.default_tenant
        self._by_digest: dict[str, str] = {}
        for tenant in tenants:
            for key in tenant.api_keys:
                self._by_digest[_digest_of(key)] = tenant.name

    @property
    def has_keys(self) -> bool:
        return bool(self._by_digest)

    def authenticate(self, authorization: bytes | None, anonymous: bool = True) -> str:
        """The tenant's name; anonymous traffic goes to the default tenant unless keys are required (or
        ``anonymous`` is False: a route only a key may call)."""
        token = _bearer(authorization)
        if token is not None:
            tenant = self._by_digest.get(key_digest(token))
            if tenant is not None:
                return tenant
            if self.require_api_key or self._by_digest:
                raise GatewayError(401, "Incorrect API key provided.", code="invalid_api_key")
        if self.require_api_key or not anonymous:
            raise GatewayError(
                401, "You didn't provide an API key (Authorization: Bearer <key>).", code="missing_api_key"
            )
        return self.default_tenant


def _bearer(authorization: bytes | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
