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


class TenantDirectory:
    def __init__(self, auth: AuthConfig, tenants: Iterable[TenantConfig]) -> None:
        self.require_api_key = auth.require_api_key
        self.default_tenant = auth.default_tenant
        self._by_digest: dict[str, str] = {}
        for tenant in tenants:
            for key in tenant.api_keys:
                digest = key.removeprefix("sha256:").lower() if key.startswith("sha256:") else key_digest(key)
                self._by_digest[digest] = tenant.name

    def authenticate(self, authorization: bytes | None) -> str:
        """The tenant's name; anonymous traffic goes to the default tenant unless keys are required."""
        token = _bearer(authorization)
        if token is not None:
            tenant = self._by_digest.get(key_digest(token))
            if tenant is not None:
                return tenant
            if self.require_api_key or self._by_digest:
                raise GatewayError(401, "Incorrect API key provided.", code="invalid_api_key")
        if self.require_api_key:
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
