"""/readyz: a sidecar's follows its engine's metrics; a tier of gateways (``listen.readiness: gateway``) stays
ready through an engine's restart, but only once it has sampled the engines (not from the config alone)."""

from __future__ import annotations

from gateway.admission.engine import UsageSample
from gateway.config import GatewayConfig
from gateway.server.app import Gateway
from gateway.tokens.cost import KvGeometry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_tier_gateway_is_ready_through_stale_metrics_once_it_has_sampled_the_engine() -> None:
    configured = {"model": {"block_size": 16, "num_gpu_blocks": 1000}, "admission": {"stale_after_s": 1.0}}
    for readiness, ready_when_stale in (("engine", False), ("gateway", True)):
        clock = Clock()
        gw = Gateway(GatewayConfig.model_validate({**configured, "listen": {"readiness": readiness}}), clock=clock)
        try:
            await gw.pool.start()  # its one engine, at 127.0.0.1:8000: nothing answers there
            assert gw.controller.geometry == KvGeometry(16, 1000)  # known from the config alone
            assert gw.is_ready()[0] is False  # never sampled: not ready either way
            ((url, engine),) = gw.pool.engines.items()
            engine.scraper.last_success = clock.now
            gw.controller.begin_sample(url)
            gw.controller.apply_sample(UsageSample(0.0, clock.now), url)
            assert gw.is_ready() == (True, "ok")
            clock.now += 5.0  # the engine restarts: its metrics go stale
            ready, reason = gw.is_ready()
            assert ready is ready_when_stale and "stale" in reason
            await gw.pool.remove(url)  # discovery finds no engine any more (scaled to zero)
            ready, reason = gw.is_ready()
            assert ready is ready_when_stale and "no engine in the pool" in reason
        finally:
            await gw.shutdown()


async def test_a_tenant_removed_by_a_reload_leaves_the_queue_depth_gauge() -> None:
    """A tenant's queue-depth series stays at 0 between its waits, as long as the policy has the tenant."""
    tenants = [{"name": "alpha", "api_keys": ["ka"]}, {"name": "beta", "api_keys": ["kb"]}]
    config = GatewayConfig.model_validate({"tenants": tenants})
    gw = Gateway(config)
    try:
        gw._tenants_seen |= {"alpha", "beta"}  # both have waited in the queue before

        def depths() -> set[str]:
            return {labels[0] for name, labels, _ in gw._gauge_readings() if name == "kvgate_tenant_queue_depth"}

        assert depths() == {"alpha", "beta"}
        gw.apply_policy(GatewayConfig.model_validate({"tenants": tenants[:1]}))
        assert depths() == {"alpha"}
    finally:
        await gw.shutdown()


async def test_after_a_rollout_to_engines_not_sampled_yet_the_metrics_are_as_old_as_the_last_sample_seen() -> None:
    """Not unknown: the age alerts (and a tier gateway's readiness) go on from the last sample of an engine that
    left, rather than falling silent as at a first start."""
    clock = Clock()
    gw = Gateway(GatewayConfig.model_validate({"admission": {"stale_after_s": 1.0}}), clock=clock)
    try:
        await gw.pool.start()
        ((url, engine),) = gw.pool.engines.items()
        engine.scraper.clock = clock
        assert gw.pool.age() == float("inf")  # never sampled
        engine.scraper.last_success = clock.now
        clock.now += 3.0
        await gw.pool.remove(url)  # discovery: the old pod left
        gw.pool.add("http://127.0.0.1:9")  # the new one, not sampled yet
        assert gw.pool.age() == 3.0
        readings = {name: value for name, _, value in gw._gauge_readings()}
        assert readings["kvgate_upstream_metrics_age_seconds"] == 3.0
    finally:
        await gw.shutdown()
