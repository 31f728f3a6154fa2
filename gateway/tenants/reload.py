"""Hot reload: watch the config file and apply a valid new policy; reject an invalid one and keep the old.

Kubernetes updates a mounted ConfigMap by writing a new timestamped directory and swapping the ``..data``
symlink, so the file's own inode and mtime may not change where it is opened through the symlink chain. The
watcher therefore compares the fully resolved path *and* the target's identity (inode, mtime, size), and
then the content itself, so both a plain rewrite and a symlink swap are seen. Polling (default every
second) needs no inotify and works on every volume type.

A reload fails closed. A changed file is read only once its signature has stayed the same for two consecutive
polls, so a file that a writer truncated and is still filling in is not taken for the new policy (a reload
takes effect one poll later than it is seen). A file with no settings at all (empty, blanks or comments only)
is rejected like a schema-invalid one: it is what a truncated file or a broken ConfigMap looks like, and
applying it would drop every tenant and turn ``require_api_key`` off. An explicit ``{}`` still means "all
defaults".
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, ConfigFile, GatewayConfig, parse_config_bytes
from gateway.metrics import GatewayMetrics

log = logging.getLogger("kvgate.reload")

# What a reload applies; every other section needs a restart (``reload`` too: the watcher runs as it started).
RELOADABLE = frozenset({"auth", "tenants", "passthrough"})

Signature = tuple[str, int, int, int]


def file_signature(path: str) -> Signature | None:
    """The resolved target and its identity; None while the file is missing (mid-swap)."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return (real, st.st_ino, st.st_mtime_ns, st.st_size)


class ConfigWatcher:
    def __init__(
        self,
        path: str,
        interval_s: float,
        apply: Callable[[GatewayConfig], None],
        metrics: GatewayMetrics,
        loaded: ConfigFile | None = None,
    ) -> None:
        """``loaded``: the file as the running config was read from it. The watcher starts from it, so an edit
        made while kvgate was starting (after the file was read, before the watcher began) is applied at the
        first polls; without it, from the file as it is now."""
        self.path = path
        self.interval_s = interval_s
        self.apply = apply
        self.metrics = metrics
        self._pending: Signature | None = None  # a new signature seen on the previous poll, not yet read
        self._lock = asyncio.Lock()  # one check at a time: the poll and a SIGHUP's share what they have seen
        if loaded is not None:
            self._signature: Signature | None = None  # of the file last read: unknown, so the next poll reads it
            self._digest: str | None = loaded.digest
            self._current: GatewayConfig | None = loaded.config
        else:
            self._signature = file_signature(path)
            self._digest = _digest(path)
            self._current = _try_load(path)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await _logging_failures(self.check())

    async def reload_now(self) -> None:
        """SIGHUP: read the file at once (whoever sent it says it is written), without waiting for a second
        poll to find it settled; a failure is logged, as the poll's are."""
        await _logging_failures(self.check_now())

    async def check_now(self) -> bool | None:
        async with self._lock:  # a poll half-way through would reset what this one has seen
            self._pending = await asyncio.to_thread(file_signature, self.path)
            return await self._check()

    async def check(self) -> bool | None:
        """Reload if the file changed and has settled: True applied, False rejected, None nothing to do (yet).

        A new signature is only noted; it is read when the next poll sees the same signature again."""
        async with self._lock:
            return await self._check()

    async def _check(self) -> bool | None:
        signature = await asyncio.to_thread(file_signature, self.path)
        if signature is None or signature == self._signature:
            self._pending = None
            return None
        if signature != self._pending:
            self._pending = signature  # changed since the last poll: it may still be being written
            return None
        try:
            raw = await asyncio.to_thread(Path(self.path).read_bytes)
        except OSError as exc:
            log.warning("config %s changed but cannot be read: %s", self.path, exc)
            return None
        if await asyncio.to_thread(file_signature, self.path) != signature:
            self._pending = None  # written to while we read it: wait for it to settle again
            return None
        self._signature, self._pending = signature, None
        digest = hashlib.sha256(raw).hexdigest()
        if digest == self._digest:
            return None
        self._digest = digest
        try:
            new = parse_config_bytes(raw, self.path)  # refuses a file with no settings, or not UTF-8
        except ConfigError as exc:
            return self._reject(exc.errors)
        if self._current is not None:
            restart = sorted(
                name
                for name in GatewayConfig.model_fields
                if name not in RELOADABLE and getattr(new, name) != getattr(self._current, name)
            )
            if restart:
                log.warning("config reload: changes to %s take effect only after a restart", ", ".join(restart))
        self._current = new
        self.apply(new)
        self.metrics.policy_reloads.labels("applied").inc()
        log.info("config reloaded from %s: %d tenant(s)", self.path, len(new.tenants))
        return True

    def _reject(self, errors: list[str]) -> bool:
        self.metrics.policy_reloads.labels("rejected").inc()
        log.error("config reload rejected, keeping the current policy:\n%s", "\n".join(errors))
        return False


async def _logging_failures(check: Coroutine[Any, Any, bool | None]) -> None:
    """A reload that went wrong must not end reloading: the next edit is still seen."""
    try:
        await check
    except Exception:
        log.exception("config reload failed, keeping the current policy")


def _digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _try_load(path: str) -> GatewayConfig | None:
    try:
        return parse_config_bytes(Path(path).read_bytes(), path)
    except (OSError, ConfigError):
        return None
