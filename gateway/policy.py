"""The tenant policy: one immutable snapshot of who may send what, swapped whole on reload.

A request reads ``gateway.policy`` once, at its start, and uses that snapshot to the end; a reload assigns a
new snapshot between two requests' steps. So no request ever sees half of an old policy and half of a new one.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.auth import TenantDirectory
from gateway.config import AuthConfig, TenantConfig, TenantLimits
from gateway.queue import QueueClass, priority_rank
from gateway.ratelimit import Limits


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """Everything the request path needs to know about one tenant sending to one model."""

    tenant: str
    key: str  # counter key: the tenant, or "tenant/model" when the model has overrides
    limits: Limits
    max_concurrent: int | None
    max_queue_wait_s: float | None
    qclass: QueueClass

    @property
    def priority_name(self) -> str:
        return ("critical", "standard", "sheddable")[self.qclass.priority]

    @property
    def shared(self) -> bool:
        """Whether anything about this tenant is counted (and so shared across replicas)."""
        return self.limits.any or self.max_concurrent is not None


class Policy:
    def __init__(self, auth: AuthConfig, tenants: list[TenantConfig], version: int = 1) -> None:
        self.version = version
        self.directory = TenantDirectory(auth, tenants)
        self.tenants = {t.name: t for t in tenants}
        self._cache: dict[tuple[str, str | None], TenantPolicy] = {}

    def authenticate(self, authorization: bytes | None) -> str:
        return self.directory.authenticate(authorization)

    def resolve(self, tenant: str, model: str | None) -> TenantPolicy:
        cached = self._cache.get((tenant, model))
        if cached is None:
            cached = self._cache[(tenant, model)] = self._resolve(tenant, model)
        return cached

    def _resolve(self, tenant: str, model: str | None) -> TenantPolicy:
        cfg = self.tenants.get(tenant) or TenantConfig(name=tenant)
        override = cfg.models.get(model) if model is not None else None
        key = tenant if override is None else f"{tenant}/{model}"
        merged = _merge(cfg, override)
        return TenantPolicy(
            tenant=tenant,
            key=key,
            limits=Limits(merged.requests_per_minute, merged.tokens_per_minute),
            max_concurrent=merged.max_concurrent,
            max_queue_wait_s=merged.max_queue_wait_s,
            qclass=QueueClass(priority_rank(merged.priority), merged.weight or 1.0, merged.max_queued),
        )


def _merge(base: TenantConfig, override: TenantLimits | None) -> TenantLimits:
    fields = TenantLimits.model_fields
    data = {name: getattr(base, name) for name in fields}
    if override is not None:
        data.update(override.model_dump(exclude_unset=True))
    return TenantLimits.model_validate(data)
