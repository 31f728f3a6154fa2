"""Admission: whether a request may go to the engine now, later, or not at all, by its KV-block cost.

Owns the pure core: :mod:`.gate` (90/80 hysteresis), :mod:`.ledger` (reservations in flight, released exactly
once), :mod:`.queue` (priority classes, fair sharing between tenants), :mod:`.controller` (the decision, time
passed in as ``now``); and its asyncio shell :mod:`.admitter` (parks queued requests, wakes them, fails them at
their deadline). May import: :mod:`gateway.tokens`, :mod:`gateway.protocol`, :mod:`gateway.config`,
:mod:`gateway.metrics`.
"""
