"""The access log: one line per request in the logs' own shape, written in batches (a write per request through
the logging module cost a fifth of kvgate's CPU per request)."""

from __future__ import annotations

import asyncio
import io
import logging

import orjson

from gateway.logs import ACCESS_LOGGER, AccessLog


async def test_lines_are_written_together_a_moment_later_or_once_enough_are_waiting() -> None:
    out = io.BytesIO()
    access = AccessLog(out)
    for i in range(3):
        access.write(f"r{i}", "POST /v1/completions 200", {"status": 200, "tenant": "t"})
    assert out.getvalue() == b""  # not one write per request
    await asyncio.sleep(AccessLog.FLUSH_S * 3)
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert [line["request_id"] for line in lines] == ["r0", "r1", "r2"]
    first = lines[0]
    assert (first["logger"], first["level"], first["msg"], first["status"]) == (
        ACCESS_LOGGER,
        "info",
        "POST /v1/completions 200",
        200,
    )
    assert first["ts"].endswith("Z") and len(first["ts"]) == len("2026-11-25T16:00:00.000Z")
    out.seek(0)
    out.truncate()
    for i in range(AccessLog.MAX_LINES):  # a burst: written as soon as the batch is full
        access.write(f"b{i}", "GET /v1/models 200", {})
    assert len(out.getvalue().splitlines()) == AccessLog.MAX_LINES
    access.write("last", "GET /v1/models 200", {})
    access.flush()  # at shutdown: nothing left behind
    assert out.getvalue().splitlines()[-1].startswith(b'{"ts"') and b'"last"' in out.getvalue()


def test_it_is_enabled_as_the_kvgate_access_logger_is_for_info() -> None:
    access = AccessLog(io.BytesIO())
    logger = logging.getLogger(ACCESS_LOGGER)
    level = logger.level
    try:
        logger.setLevel(logging.WARNING)
        assert not access.enabled
        logger.setLevel(logging.INFO)
        assert access.enabled
    finally:
        logger.setLevel(level)
