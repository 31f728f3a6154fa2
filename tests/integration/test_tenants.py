"""Tenants through real gateway processes: auth, fair shares, priority and shedding, hot reload under load."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.procs import Proc, start_gateway
from tests.support.promtext import assert_ledger_empty, parse_metrics, scrape
from tests.support.tenant_http import Reply, completion, post

pytestmark = pytest.mark.e2e


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def test_auth_required_and_sha256_keys(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> None:
    import hashlib

    gw = gateway(
        mini_vllm(),
        {
            "tokenizer": "heuristic",
            "auth": {"require_api_key": True},
            "tenants": [{"name": "a", "api_keys": ["sha256:" + hashlib.sha256(b"sk-a").hexdigest()]}],
        },
    )

    async def go() -> list[Reply]:
        return [await post(gw, completion(40, 2), key) for key in (None, "sk-wrong", "sk-a")]

    missing, wrong, ok = asyncio.run(go())
    assert (missing.status, missing.json()["error"]["code"]) == (401, "missing_api_key")
    assert (wrong.status, wrong.json()["error"]["code"]) == (401, "invalid_api_key")
    assert ok.status == 200


def test_equal_weights_flooder_gets_half_the_tokens(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], procs: list[Proc]
) -> None:
    """A sends 10x as many requests as B (and each twice B's tokens). While both have requests waiting, each
    is admitted half of the tokens: measured on the gateway's own per-tenant queue depth and admitted-token
    counters, snapshot by snapshot."""
    upstream = mini_vllm(num_blocks=40, block_size=16, token_delay_ms=1)
    gw = gateway(
        upstream,
        {
            "tokenizer": "heuristic",
            "telemetry": {"scrape_interval_s": 0.05},
            "tenants": [
                {"name": "a", "api_keys": ["ka"]},
                {"name": "b", "api_keys": ["kb"]},
            ],
        },
    )
    a_body, b_body = completion(64, 48), completion(64, 16)  # 16 + 48 = 64 tokens, 16 + 16 = 32 tokens
    snapshots: list[dict[str, float]] = []
    stop = threading.Event()

    def watch() -> None:
        """Server-side truth: per-tenant queue depth and admitted tokens, read in one /metrics snapshot."""
        with httpx.Client() as client:
            while not stop.is_set():
                snapshots.append(parse_metrics(client.get(gw + "/metrics").text))
                time.sleep(0.01)

    async def go() -> list[Reply]:
        flood = [asyncio.create_task(post(gw, a_body, "ka", "a")) for _ in range(400)]
        await asyncio.sleep(0.3)  # the flood is queued; now B's 40 arrive and queue alongside it
        light = [asyncio.create_task(post(gw, b_body, "kb", "b")) for _ in range(40)]
        return list(await asyncio.gather(*flood, *light))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        replies = asyncio.run(go())
    finally:
        stop.set()
        watcher.join()
    assert {r.status for r in replies} == {200}, procs[-1].log_tail()
    # Sum what each tenant was admitted between consecutive snapshots in which both had requests waiting.
    depth = "kvgate_tenant_queue_depth{tenant=%s}"
    admitted = "kvgate_tenant_admitted_tokens_total{priority=standard,tenant=%s}"
    got = {"a": 0.0, "b": 0.0}
    for before, after in itertools.pairwise(snapshots):
        if all(snap.get(depth % t, 0) > 0 for snap in (before, after) for t in "ab"):
            for t in "ab":
                got[t] += after.get(admitted % t, 0) - before.get(admitted % t, 0)
    share_b = got["b"] / (got["a"] + got["b"])
    print(
        f"\n[fairness] while both had requests waiting: a={got['a']:.0f} tokens, b={got['b']:.0f} tokens: "
        f"share a={1 - share_b:.3f} b={share_b:.3f} ({len(snapshots)} snapshots)"
    )
    assert got["b"] >= 10 * 32, "B must have waited alongside A for a while for the share to mean anything"
    assert 0.45 <= share_b <= 0.55, got
    m = assert_ledger_empty(gw)
    assert m["kvgate_tenant_admitted_tokens_total{priority=standard,tenant=a}"] == 400 * 64


def test_critical_keeps_a_low_queue_wait_while_sheddable_is_shed(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    upstream = mini_vllm(num_blocks=40, block_size=16, token_delay_ms=2)
    gw = gateway(
        upstream,
        {
            "tokenizer": "heuristic",
            "telemetry": {"scrape_interval_s": 0.05},
            "admission": {"queue_max_length": 24},
            "tenants": [
                {"name": "crit", "api_keys": ["kc"], "priority": "critical"},
                {"name": "bulk", "api_keys": ["ks"], "priority": "sheddable"},
            ],
        },
    )
    body = completion(64, 32)

    async def go() -> list[Reply]:
        flood = [asyncio.create_task(post(gw, body, "ks", "bulk")) for _ in range(150)]
        crit = []
        for _ in range(40):  # critical traffic keeps arriving while the queue is full of sheddable work
            crit.append(asyncio.create_task(post(gw, body, "kc", "crit")))
            await asyncio.sleep(0.02)
        return list(await asyncio.gather(*flood, *crit))

    replies = asyncio.run(go())
    crit = [r for r in replies if r.tag == "crit"]
    bulk = [r for r in replies if r.tag == "bulk"]
    assert [r.status for r in crit] == [200] * 40
    shed = [r for r in bulk if r.status == 503 and r.json()["error"]["code"] == "shed"]
    refused = [r for r in bulk if r.status == 429 and r.json()["error"]["code"] == "queue_full"]
    served = [r for r in bulk if r.status == 200]
    assert len(shed) + len(refused) + len(served) == 150
    assert shed and refused and served
    for r in shed + refused:  # the body says where the request stood and when to come back
        err = r.json()["error"]
        assert "queue_position" in err and "queue_eta_s" in err and "retry-after" in r.headers
    crit_waits = [r.queue_wait_s for r in crit]
    queued_bulk = [r for r in served if "x-kvgate-queue-position" in r.headers]
    assert queued_bulk and all("x-kvgate-queue-wait-ms" in r.headers for r in queued_bulk)
    # Sheddable requests admitted at once, before the engine filled up, say nothing about priority: compare
    # critical traffic with the sheddable requests that had to queue.
    bulk_waits = [r.queue_wait_s for r in queued_bulk]
    print(
        f"\n[priority] critical: {len(crit)} sent, all admitted, queue wait p50 {p(crit_waits, 0.5) * 1000:.0f} ms "
        f"p99 {p(crit_waits, 0.99) * 1000:.0f} ms | sheddable: 150 sent, {len(served)} admitted, {len(queued_bulk)} "
        f"of them after queueing (wait p50 {p(bulk_waits, 0.5) * 1000:.0f} ms, p99 {p(bulk_waits, 0.99) * 1000:.0f} "
        f"ms), {len(shed)} shed from the queue, {len(refused)} refused at a full queue"
    )
    assert p(crit_waits, 0.99) < p(bulk_waits, 0.5)
    m = assert_ledger_empty(gw)
    assert m["kvgate_requests_shed_total{priority=sheddable}"] == len(shed)


def _configmap_version(root: Path, name: str, config: dict[str, object] | str) -> None:
    """Write a new version the way kubelet does: a new directory, then an atomic swap of ``..data``."""
    (root / name).mkdir()
    text = config if isinstance(config, str) else yaml.safe_dump(config)
    (root / name / "kvgate.yaml").write_text(text)
    os.symlink(name, root / "..data_tmp")
    os.replace(root / "..data_tmp", root / "..data")


def test_reload_under_load_loses_no_request(mini_vllm: Callable[..., str], procs: list[Proc], tmp_path: Path) -> None:
    upstream = mini_vllm(token_delay_ms=1)

    def config(rpm: int) -> dict[str, object]:
        return {
            "tokenizer": "heuristic",
            "reload": {"interval_s": 0.05},
            "auth": {"require_api_key": True},
            "tenants": [{"name": "t", "api_keys": ["kt"], "requests_per_minute": rpm}],
        }

    _configmap_version(tmp_path, "..v1", config(100_000))
    os.symlink("..data/kvgate.yaml", tmp_path / "kvgate.yaml")
    procs.append(start_gateway(upstream, tmp_path / "kvgate.yaml"))  # the ConfigMap-style symlink
    url = procs[-1].url

    async def go() -> list[Reply]:
        replies: list[Reply] = []
        stop = asyncio.Event()

        async def client() -> None:
            while not stop.is_set():
                replies.append(await post(url, completion(80, 8), "kt"))

        clients = [asyncio.create_task(client()) for _ in range(8)]
        for name, cfg in (
            ("..v2", config(200_000)),
            ("..v3", "tenants: [{name: t, requests_per_minute: -1}]\n"),
            ("..v4", config(300_000)),
        ):
            await asyncio.sleep(0.4)
            await asyncio.to_thread(_configmap_version, tmp_path, name, cfg)
        await asyncio.sleep(0.4)
        stop.set()
        await asyncio.gather(*clients)
        return replies

    started = time.monotonic()
    replies = asyncio.run(go())
    assert len(replies) > 50, len(replies)
    assert [r.status for r in replies] == [200] * len(replies)  # nothing lost, nothing refused
    limits = [r.headers["x-ratelimit-limit-requests"] for r in replies]
    assert set(limits) <= {"100000", "200000", "300000"}
    assert limits[-1] == "300000" and "100000" in limits
    m = scrape(url)
    assert m["kvgate_policy_reloads_total{result=applied}"] == 2
    assert m["kvgate_policy_reloads_total{result=rejected}"] == 1
    assert httpx.get(url + "/readyz").json()["policy_version"] == 3
    assert_ledger_empty(url)
    print(
        f"\n[reload] {len(replies)} requests in {time.monotonic() - started:.1f}s across 2 applied reloads "
        f"and 1 rejected one: all 200; limits seen {sorted(set(limits))}"
    )


def test_the_engine_schedules_by_the_tenants_class_never_by_the_clients_priority(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """With ``upstream.priority_scheduling`` each generation tells the engine its tenant's class as vLLM's
    priority (X-Vllm-Priority, read before the body's field); a client's own ``priority`` is a 400 that never
    reaches the engine, and neither does its own X-Vllm-Priority header. Through the OpenAI SDK."""
    import openai

    upstream = mini_vllm()
    tenants = [
        {"name": "urgent", "api_keys": ["sk-urgent"], "priority": "critical"},
        {"name": "plain", "api_keys": ["sk-plain"]},
        {"name": "batch", "api_keys": ["sk-batch"], "priority": "sheddable"},
    ]
    config = {"tokenizer": "heuristic", "tenants": tenants, "auth": {"require_api_key": True}}
    scheduled = gateway(upstream, {**config, "upstream": {"priority_scheduling": True}})
    fcfs = gateway(upstream, config)

    def complete(gw: str, key: str, rid: str, body: dict[str, object] | None = None) -> None:
        client = openai.OpenAI(base_url=gw + "/v1", api_key=key, max_retries=0)
        headers = {"x-request-id": rid, "x-vllm-priority": "-100"}  # the client's own header goes nowhere
        client.completions.create(
            model="mini", prompt="hello there", max_tokens=4, extra_headers=headers, extra_body=body
        )

    for tenant in ("urgent", "plain", "batch"):
        complete(scheduled, f"sk-{tenant}", f"scheduled-{tenant}")
        complete(fcfs, f"sk-{tenant}", f"fcfs-{tenant}")
    complete(fcfs, "sk-plain", "fcfs-zero", {"priority": 0})
    for gw in (scheduled, fcfs):
        with pytest.raises(openai.BadRequestError) as refused:
            complete(gw, "sk-batch", "jumps-the-queue", {"priority": -100})
        assert refused.value.status_code == 400 and refused.value.body["param"] == "priority"  # type: ignore[index]

    seen = {rid.rpartition("-")[0]: p for rid, p in httpx.get(upstream + "/debug/priorities").json().items()}
    assert seen == {
        "scheduled-urgent": -1,
        "scheduled-plain": 0,
        "scheduled-batch": 1,
        "fcfs-urgent": 0,
        "fcfs-plain": 0,
        "fcfs-batch": 0,
        "fcfs-zero": 0,
    }


def test_each_tenant_has_a_prefix_cache_of_its_own_when_isolated(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """With ``auth.isolate_prefix_cache`` every generation reaches the engine with its tenant's cache_salt:
    the same prompt from two tenants is salted apart, one tenant's requests share one salt (on every route), a
    client's own salt splits its tenant's cache further but never lands on another tenant's, and an empty one is
    a 400 as vLLM would answer. Without the option the body goes through as sent. Through the OpenAI SDK."""
    import openai

    upstream = mini_vllm()
    tenants = [{"name": "a", "api_keys": ["sk-a"]}, {"name": "b", "api_keys": ["sk-b"]}]
    config: dict[str, object] = {"tokenizer": "heuristic", "tenants": tenants}
    isolated = gateway(upstream, {**config, "auth": {"require_api_key": True, "isolate_prefix_cache": True}})
    shared = gateway(upstream, {**config, "auth": {"require_api_key": True}})

    def send(gw: str, key: str, rid: str, body: dict[str, object] | None = None, chat: bool = False) -> None:
        client = openai.OpenAI(base_url=gw + "/v1", api_key=key, max_retries=0)
        headers = {"x-request-id": rid}
        if chat:
            messages = [{"role": "user", "content": "the same long system prompt"}]
            client.chat.completions.create(
                model="mini",
                messages=messages,
                max_tokens=4,
                extra_headers=headers,
                extra_body=body,  # type: ignore[arg-type]
            )
        else:
            client.completions.create(
                model="mini", prompt="the same long system prompt", max_tokens=4, extra_headers=headers, extra_body=body
            )

    send(isolated, "sk-a", "a1")
    send(isolated, "sk-a", "a2", chat=True)
    send(isolated, "sk-b", "b1")
    send(isolated, "sk-b", "b-own", {"cache_salt": "mine"})
    send(isolated, "sk-a", "a-own", {"cache_salt": "mine"})
    send(shared, "sk-a", "plain", {"cache_salt": "mine"})
    send(shared, "sk-b", "none")
    with pytest.raises(openai.BadRequestError) as refused:
        send(isolated, "sk-a", "empty", {"cache_salt": ""})
    assert refused.value.body["param"] == "cache_salt"  # type: ignore[index]

    salts = {rid.rpartition("-")[0]: s for rid, s in httpx.get(upstream + "/debug/cache_salts").json().items()}
    assert "empty" not in salts
    assert salts["a1"] == salts["a2"] and salts["a1"] != salts["b1"]
    assert len({salts["a1"], salts["b1"], salts["a-own"], salts["b-own"]}) == 4
    assert salts["plain"] == "mine" and salts["none"] is None
