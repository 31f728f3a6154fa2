"""``kvgate sim``: a vLLM stand-in that behaves like the engine under KV-cache pressure.

The engine (block pool, scheduler, step timing, OOM check) is plain synchronous code in
:mod:`gateway.sim.engine`; :mod:`gateway.sim.server` is the thin asyncio/HTTP shell that steps it.
"""
