"""Tenants: who sends a request and what they may send.

Owns: :mod:`.auth` (API key -> tenant), :mod:`.policy` (one immutable snapshot per config, resolved per tenant
and model), :mod:`.ratelimit` (token buckets, pure), :mod:`.slots` (concurrency slots, pure),
:mod:`.redis_store` (the same counters in Redis), :mod:`.counters` (which of the two counts, with fallback),
:mod:`.reload` (watch the config file, apply or reject). May import: :mod:`gateway.admission` (queue classes),
:mod:`gateway.protocol`, :mod:`gateway.config`, :mod:`gateway.metrics`.
"""
