"""Hot reload fails closed in a real gateway process: an emptied config file keeps the running policy."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.procs import Proc, start_gateway
from tests.support.promtext import scrape
from tests.support.tenant_http import Reply, completion, post

pytestmark = pytest.mark.e2e


def statuses(url: str, keys: list[str | None]) -> list[int]:
    async def go() -> list[Reply]:
        return [await post(url, completion(40, 1), key) for key in keys]

    return [r.status for r in asyncio.run(go())]


def settle(seconds: float = 0.5) -> None:
    time.sleep(seconds)  # ten polls of 0.05 s: a change is read after two


def test_an_emptied_config_keeps_the_policy(mini_vllm: Callable[..., str], procs: list[Proc], tmp_path: Path) -> None:
    config = {
        "tokenizer": "heuristic",
        "reload": {"interval_s": 0.05},
        "auth": {"require_api_key": True},
        "tenants": [{"name": "t", "api_keys": ["kt"]}],
    }
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    procs.append(start_gateway(mini_vllm(), path))
    gw = procs[-1]
    assert statuses(gw.url, [None, "kt"]) == [401, 200]

    path.write_text("")  # truncated, as by a writer that has not written yet (or a broken ConfigMap)
    settle()
    path.write_text("# kvgate\n")
    settle()
    assert statuses(gw.url, [None, "kt"]) == [401, 200]  # still the old policy: keys required, tenant known
    m = scrape(gw.url)
    assert m.get("kvgate_policy_reloads_total{result=applied}", 0) == 0
    assert m["kvgate_policy_reloads_total{result=rejected}"] == 2
    assert httpx.get(gw.url + "/readyz").json()["policy_version"] == 1
    assert "has no settings" in gw.log()

    config["tenants"] = [{"name": "t", "api_keys": ["kt2"]}]
    (tmp_path / "next.yaml").write_text(yaml.safe_dump(config))
    os.replace(tmp_path / "next.yaml", path)  # a valid one is still applied
    settle()
    assert statuses(gw.url, [None, "kt", "kt2"]) == [401, 401, 200]
    assert scrape(gw.url)["kvgate_policy_reloads_total{result=applied}"] == 1


def test_a_reload_revokes_an_admin_key_and_closes_a_route(
    mini_vllm: Callable[..., str], procs: list[Proc], tmp_path: Path
) -> None:
    """``passthrough`` is part of the reloaded policy: a leaked admin key taken out of the ConfigMap, or a
    route taken off the allow-list, stops working without a restart (it kept working until one)."""
    config: dict[str, object] = {
        "tokenizer": "heuristic",
        "reload": {"interval_s": 0.05},
        "tenants": [{"name": "t", "api_keys": ["kt"]}],
        "passthrough": {"allow": ["/reset_prefix_cache", "/sleep"], "admin_api_keys": ["leaked", "new"]},
    }
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    procs.append(start_gateway(mini_vllm(), path))
    gw = procs[-1]

    def status(route: str, key: str) -> int:
        return httpx.post(gw.url + route, headers={"authorization": f"Bearer {key}"}).status_code

    assert [status("/reset_prefix_cache", "leaked"), status("/sleep", "new")] == [200, 200]
    config["passthrough"] = {"allow": ["/reset_prefix_cache"], "admin_api_keys": ["new"]}
    (tmp_path / "next.yaml").write_text(yaml.safe_dump(config))
    os.replace(tmp_path / "next.yaml", path)
    for _ in range(1200):  # until the new policy is in (a few polls of 0.05 s)
        if httpx.get(gw.url + "/readyz").json()["policy_version"] >= 2:
            break
        time.sleep(0.05)
    # revoked, the leaked key is nobody's: 401, as for any stranger (403 is for a tenant's key)
    assert [status("/reset_prefix_cache", "leaked"), status("/reset_prefix_cache", "new")] == [401, 200]
    assert status("/reset_prefix_cache", "kt") == 403
    assert status("/sleep", "new") == 404
    assert "take effect only after a restart" not in gw.log()


def test_sighup_reloads_at_once_and_does_not_end_kvgate(
    mini_vllm: Callable[..., str], procs: list[Proc], tmp_path: Path
) -> None:
    """Operators (and systemd's ExecReload) send SIGHUP to mean "reload": by default it ended kvgate on the spot,
    streams and all. It reads the file now instead, however long the poll interval."""
    config = {
        "tokenizer": "heuristic",
        "reload": {"interval_s": 3600},  # the poll would not see the edit during this test: only SIGHUP can
        "auth": {"require_api_key": True},
        "tenants": [{"name": "t", "api_keys": ["kt"]}],
        "admission": {"queue_max_wait_s": 120},
    }
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    procs.append(start_gateway(mini_vllm(), path))
    gw = procs[-1]
    assert statuses(gw.url, ["kt", "kt2"]) == [200, 401]
    config["tenants"] = [{"name": "t", "api_keys": ["kt2"]}]
    config["admission"] = {"queue_max_wait_s": 5}  # not reloadable: the running budget stays, and a warning says so
    path.write_text(yaml.safe_dump(config))
    os.kill(gw.pid, signal.SIGHUP)
    for _ in range(1200):  # until the reload is in; a gateway that died of the signal fails below
        if not gw.running() or httpx.get(gw.url + "/readyz").json()["policy_version"] >= 2:
            break
        time.sleep(0.05)
    assert gw.running(), gw.log()
    assert statuses(gw.url, ["kt", "kt2"]) == [401, 200]
    assert "SIGHUP: reading" in gw.log() and "changes to admission take effect only after a restart" in gw.log()
