"""Hot reload fails closed: a file with no settings, or one a writer has not finished, never replaces the policy."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import pytest

from gateway.config import GatewayConfig, has_no_settings, read_config_file
from gateway.metrics import GatewayMetrics
from gateway.tenants.reload import ConfigWatcher

STRICT = """\
auth:
  require_api_key: true
tenants:
  - name: a
    api_keys: [ka]
    requests_per_minute: 5
  - name: b
    api_keys: [kb]
    max_concurrent: 2
  - name: c
    api_keys: [kc]
"""


def reloads(metrics: GatewayMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    out = {}
    for result in ("applied", "rejected"):
        line = next(
            (x for x in text.splitlines() if x.startswith(f'kvgate_policy_reloads_total{{result="{result}"}}')), None
        )
        out[result] = float(line.split()[-1]) if line else 0.0
    return out


def watch(path: Path, metrics: GatewayMetrics) -> tuple[ConfigWatcher, list[GatewayConfig]]:
    applied: list[GatewayConfig] = []
    return ConfigWatcher(str(path), 1.0, applied.append, metrics), applied


@pytest.mark.parametrize("text", ["", "\n   \n\t\n", "# kvgate config\n# (rendered by helm)\n", "---\n", "null\n"])
async def test_a_file_with_no_settings_is_rejected_and_the_policy_kept(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Empty, blank or comment-only: what a truncated file or a broken ConfigMap looks like. Applying it would
    turn require_api_key off and drop every tenant; it is rejected and counted, and an explicit {} is not."""
    path = tmp_path / "kvgate.yaml"
    path.write_text(STRICT)
    metrics = GatewayMetrics()
    watcher, applied = watch(path, metrics)
    path.write_text(text)
    with caplog.at_level(logging.ERROR, logger="kvgate.reload"):
        assert await watcher.check() is None  # seen, not yet settled
        assert await watcher.check() is False
        assert await watcher.check() is None  # not re-reported
    assert applied == [] and reloads(metrics) == {"applied": 0.0, "rejected": 1.0}
    assert "has no settings" in caplog.text and "keeping the current policy" in caplog.text
    path.write_text("{}\n")  # all defaults, said explicitly
    assert await watcher.check() is None
    assert await watcher.check() is True and len(applied) == 1 and not applied[0].auth.require_api_key


def test_has_no_settings() -> None:
    assert has_no_settings("") and has_no_settings("  # x\n\n# y") and has_no_settings("--- # doc\n")
    assert not has_no_settings("{}") and not has_no_settings("tenants: []") and not has_no_settings("a: [")


async def test_a_file_being_written_is_read_only_once_it_has_settled(tmp_path: Path) -> None:
    """A writer that truncates the file and writes it in pieces: each poll sees a new signature, so nothing is
    read until two polls in a row see the same one, and then it is the whole file that is applied."""
    path = tmp_path / "kvgate.yaml"
    path.write_text(STRICT)
    metrics = GatewayMetrics()
    watcher, applied = watch(path, metrics)
    new = STRICT.replace("requests_per_minute: 5", "requests_per_minute: 50")
    cut = new.index("  - name: b")  # the first piece alone is a valid config: tenant a only
    with path.open("w") as f:  # truncates
        assert await watcher.check() is None  # empty for now
        f.write(new[:cut])
        f.flush()
        assert await watcher.check() is None  # half of it, valid YAML: not to be taken as the new policy
        f.write(new[cut:])
        f.flush()
        assert await watcher.check() is None  # complete, but not yet seen twice
    assert applied == []
    assert await watcher.check() is True
    assert [t.name for t in applied[0].tenants] == ["a", "b", "c"] and applied[0].auth.require_api_key
    assert applied[0].tenants[0].requests_per_minute == 50
    assert reloads(metrics) == {"applied": 1.0, "rejected": 0.0}


async def test_a_schema_invalid_file_is_still_rejected(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(STRICT)
    metrics = GatewayMetrics()
    watcher, applied = watch(path, metrics)
    path.write_text(STRICT.replace("max_concurrent: 2", "max_concurrent: 0"))
    assert await watcher.check() is None
    assert await watcher.check() is False and applied == []
    assert reloads(metrics) == {"applied": 0.0, "rejected": 1.0}


def test_startup_refuses_a_file_with_no_settings(tmp_path: Path) -> None:
    """``kvgate serve --config`` / ``kvgate validate`` on an empty file: an error with its location, not the
    all-open defaults; ``{}`` still means every default."""
    from gateway.config import ConfigError, load_config, validate_file

    empty = tmp_path / "empty.yaml"
    empty.write_text("# rendered from nothing\n")
    with pytest.raises(ConfigError, match="no settings"):
        load_config(empty)
    assert validate_file(str(empty)) == 1
    braces = tmp_path / "defaults.yaml"
    braces.write_text("{}\n")
    assert load_config(braces).auth.require_api_key is False


async def test_a_file_that_is_not_utf8_is_rejected_and_the_next_edit_still_applied(tmp_path: Path) -> None:
    """A Latin-1 comment once raised out of the watcher's task: nothing logged or counted, and no later edit
    (a revoked key) was ever applied."""
    path = tmp_path / "kvgate.yaml"
    path.write_text(STRICT)
    metrics = GatewayMetrics()
    watcher, applied = watch(path, metrics)
    path.write_bytes(b"# owner: Ren\xe9\n" + STRICT.encode())
    assert await watcher.check() is None
    assert await watcher.check() is False and reloads(metrics) == {"applied": 0.0, "rejected": 1.0}
    path.write_text(STRICT.replace("kc", "kc2"))
    assert await watcher.check() is None
    assert await watcher.check() is True and applied[-1].tenants[2].api_keys == ["kc2"]


async def test_an_edit_made_while_kvgate_was_starting_is_applied(tmp_path: Path) -> None:
    """The watcher starts from the file as it was read at start-up (its digest), not from the file as it is when
    the watcher begins, after the first scrape and Redis: an edit between the two is applied, not taken for the
    running policy."""
    path = tmp_path / "kvgate.yaml"
    path.write_text(STRICT)
    loaded = read_config_file(path)
    path.write_text(STRICT.replace("requests_per_minute: 5", "requests_per_minute: 6"))  # during start-up
    applied: list[GatewayConfig] = []
    watcher = ConfigWatcher(str(path), 1.0, applied.append, GatewayMetrics(), loaded)
    assert await watcher.check() is None
    assert await watcher.check() is True and applied[0].tenants[0].requests_per_minute == 6
    unchanged: list[GatewayConfig] = []
    quiet = ConfigWatcher(str(path), 1.0, unchanged.append, GatewayMetrics(), read_config_file(path))
    assert await quiet.check() is None and await quiet.check() is None and unchanged == []  # nothing new


async def test_the_watcher_survives_a_reload_that_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(STRICT)
    calls: asyncio.Queue[GatewayConfig] = asyncio.Queue()

    def apply(config: GatewayConfig) -> None:
        calls.put_nowait(config)
        if calls.qsize() == 1:
            raise RuntimeError("a bug in applying")

    watcher = ConfigWatcher(str(path), 0.01, apply, GatewayMetrics())
    task = asyncio.create_task(watcher.run())
    try:
        with caplog.at_level(logging.ERROR, logger="kvgate.reload"):
            path.write_text(STRICT.replace("kc", "kc2"))
            assert (await calls.get()).tenants[2].api_keys == ["kc2"]  # applying it raised
            path.write_text(STRICT.replace("kc", "kc3"))
            assert (await calls.get()).tenants[2].api_keys == ["kc3"]  # and the watcher still runs
        assert "config reload failed" in caplog.text
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
