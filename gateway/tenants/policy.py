"""The tenant policy: one immutable snapshot of who may send what, swapped whole on reload.

A request reads the current policy once, at its start, and uses that snapshot to the end; a reload assigns a
new snapshot between two requests' steps. So no request ever sees half of an old policy and half of a new one.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission.queue import QueueClass, priority_rank
from gateway.config import AuthConfig, PassthroughConfig, TenantConfig, TenantLimits
from gateway.tenants.auth import AdminKeys, TenantDirectory
from gateway.tenants.ratelimit import RateLimits

# The longest wait a client may ask for when its tenant sets no limit: the OpenAI SDKs' default read timeout.
MAX_CLIENT_WAIT_S = 600.0


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """Everything the request path needs to know about one tenant sending to one model."""

    tenant: str
    key: str  # counter key: the tenant, or "tenant/model" when the model has overrides
    rates: RateLimits
    max_concurrent: int | None
    wait_budget_s: float  # the tenant's max_queue_wait_s, else the config's queue_max_wait_s
    qclass: QueueClass
    wait_cap_s: float | None = None  # the tenant's own max_queue_wait_s, which no client may exceed

    def wait_budget(self, client_s: float | None) -> float:
        """How long a request may wait: the client's own budget when it says so (capped by the tenant's own
        limit), else the tenant's, else the config's."""
        if client_s is None:
            return self.wait_budget_s
        return min(client_s, self.wait_cap_s or MAX_CLIENT_WAIT_S)


class Policy:
    def __init__(
        self,
        auth: AuthConfig,
        tenants: list[TenantConfig],
        default_wait_s: float,
        version: int = 1,
        passthrough: PassthroughConfig | None = None,
    ) -> None:
        self.version = version
        self.default_wait_s = default_wait_s
        self.directory = TenantDirectory(auth, tenants)
        self.isolate_prefix_cache = auth.isolate_prefix_cache  # a cache_salt per tenant on every generation
        passthrough = passthrough or PassthroughConfig()
        self.allowed = frozenset(passthrough.allow)  # engine admin routes opened, and who may call them
        self.admin_keys = AdminKeys(passthrough.admin_api_keys)
        self.tenants = {t.name: t for t in tenants}
        # every tenant a request can be of: the configured ones and the one anonymous callers get
        self.tenant_names = frozenset([*self.tenants, self.directory.default_tenant])
        # Keyed by names from the config only (a tenant, and one of its overridden models or None), so its size
        # is bounded by the config, not by what clients send.
        self._cache: dict[tuple[str, str | None], TenantPolicy] = {}

    def authenticate(self, authorization: bytes | None, anonymous: bool = True) -> str:
        return self.directory.authenticate(authorization, anonymous)

    def holds_a_key(self, authorization: bytes | None) -> None:
        """401 unless the caller has a key (a tenant's or an admin's) of a gateway that has keys at all: what is
        refused where (an unknown path, an admin route) is told to key holders only, even when anonymous
        callers may generate; a gateway with no keys has no one to keep it from."""
        if (self.directory.has_keys or self.admin_keys) and not self.admin_keys.accepts(authorization):
            self.directory.authenticate(authorization, anonymous=False)

    def resolve(self, tenant: str, model: str | None, served: tuple[str, ...] = ()) -> TenantPolicy:
        """The tenant's limits for ``model``. ``served``: the names the engine's base model answers to; vLLM
        runs a request without a model (or under any of them) on that model, so its limits are found under
        whichever of them the tenant's ``models`` names: leaving out ``model`` does not leave its limits."""
        cfg = self.tenants.get(tenant)
        override_key = None
        if cfg is not None and cfg.models:
            names = served if not model else (model, *served) if model in served else (model,)
            override_key = next((name for name in names if name in cfg.models), None)
        cached = self._cache.get((tenant, override_key))
        if cached is None:
            cached = self._cache[(tenant, override_key)] = self._resolve(tenant, cfg, override_key)
        return cached

    def _resolve(self, tenant: str, cfg: TenantConfig | None, model: str | None) -> TenantPolicy:
        cfg = cfg or TenantConfig(name=tenant)
        override = cfg.models.get(model) if model is not None else None
        key = tenant if override is None else f"{tenant}/{model}"
        merged = _merge(cfg, override)
        return TenantPolicy(
            tenant=tenant,
            key=key,
            rates=RateLimits(merged.requests_per_minute, merged.tokens_per_minute),
            max_concurrent=merged.max_concurrent,
            wait_budget_s=merged.max_queue_wait_s or self.default_wait_s,
            qclass=QueueClass(priority_rank(merged.priority), merged.weight or 1.0, merged.max_queued),
            wait_cap_s=merged.max_queue_wait_s,
        )


def _merge(base: TenantConfig, override: TenantLimits | None) -> TenantLimits:
    fields = TenantLimits.model_fields
    data = {name: getattr(base, name) for name in fields}
    if override is not None:
        data.update(override.model_dump(exclude_unset=True))
    return TenantLimits.model_validate(data)
