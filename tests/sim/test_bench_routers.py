"""The pure parts of loadtests/bench_routers.py: prompts, the nginx config, the issue's checks, the tables."""

from __future__ import annotations

from pathlib import Path

from loadtests.bench_routers import (
    ARMS,
    base_text,
    calls_per_request,
    checks,
    checks_table,
    control_note,
    detail_table,
    make_prompt,
    nginx_conf,
    summary_table,
)


def _row(p50: float, cpu: float, upstream: float, p99: float | None = None) -> dict[str, float]:
    return {
        "p50_ms": p50,
        "p99_ms": p99 if p99 is not None else p50 * 2,
        "cpu_ms": cpu,
        "upstream_ms": upstream,
        "requests": 2000,
        "errors": 0,
    }


def _rows() -> dict[tuple[str, str, int], dict[str, float]]:
    rows = {}
    for mode in ("json", "stream"):
        for c in (1, 32):
            rows[("direct", mode, c)] = _row(1.0, 0.0, 0.20)
            rows[("vllm-router", mode, c)] = _row(1.2, 0.30, 0.21)
            rows[("kvgate-heuristic", mode, c)] = _row(1.4, 0.25, 0.219)  # passes everything
            rows[("kvgate-llama3", mode, c)] = _row(1.6, 0.31, 0.23)  # fails everything
    return rows


def test_base_text_is_deterministic_and_exact_length() -> None:
    text = base_text(4000)
    assert len(text) == 4000
    assert text == base_text(4000)
    assert text != base_text(4000, seed=1)
    assert len(set(text.split())) > 50  # varied words, not one repeated token


def test_every_prompt_is_unique_and_near_the_size_asked() -> None:
    text = base_text(4000)
    prompts = {make_prompt(i, text) for i in range(1000)}
    assert len(prompts) == 1000
    assert all(4000 < len(p) < 4100 for p in prompts)


def test_nginx_conf_keeps_upstream_connections_alive_and_streams_unbuffered(tmp_path: Path) -> None:
    conf = nginx_conf(8123, "http://127.0.0.1:9000/", tmp_path, workers=2)
    assert "daemon off;" in conf
    assert "worker_processes 2;" in conf
    assert "listen 127.0.0.1:8123;" in conf
    assert "server 127.0.0.1:9000;" in conf
    assert "keepalive 128;" in conf
    assert "proxy_http_version 1.1;" in conf
    assert 'proxy_set_header Connection "";' in conf
    assert "proxy_buffering off;" in conf
    assert "access_log off;" in conf
    assert f"pid {tmp_path}/nginx.pid;" in conf
    assert conf.count("{") == conf.count("}")


def test_checks_pass_and_fail_against_the_issue_limits() -> None:
    result = dict(checks(_rows(), ["kvgate-heuristic", "kvgate-llama3"]))
    assert len(result) == 10
    for name, cells in result.items():
        assert cells["kvgate-heuristic"].endswith("PASS"), name
        assert cells["kvgate-llama3"].endswith("**FAIL**"), name
    assert result["CPU ms/req <= vllm-router's, json c=1"]["kvgate-heuristic"] == "0.250 vs 0.300 PASS"
    assert result["added p50 <= 0.5 ms, stream c=1"]["kvgate-llama3"] == "+0.60 ms **FAIL**"
    assert result["upstream CPU <= 1.10x direct, json c=32"]["kvgate-llama3"] == "1.15x **FAIL**"


def test_checks_name_an_arm_that_did_not_run() -> None:
    rows = {k: v for k, v in _rows().items() if k[0] != "vllm-router"}
    result = dict(checks(rows, ["kvgate-heuristic", "kvgate-auto"]))
    assert result["CPU ms/req <= vllm-router's, json c=1"]["kvgate-heuristic"] == "not judged: vllm-router not run"
    assert result["added p50 <= 0.5 ms, json c=1"]["kvgate-auto"] == "not run"


def test_tables_have_one_line_per_arm_and_cell() -> None:
    rows = _rows()
    arms = [a for a in ARMS if any(k[0] == a for k in rows)]
    summary = summary_table(rows, arms).strip().splitlines()
    assert len(summary) == 2 + len(arms)
    assert summary[2].startswith("| direct | - | - | - | - | - | 0.200 |")
    assert "| +0.40 | 0.250 | 0.250 | 0.250 | 0.250 | 0.219 |" in summary_table(rows, arms)
    detail = detail_table(rows, arms).strip().splitlines()
    assert len(detail) == 2 + len(rows)
    assert len(checks_table(rows).splitlines()) == 2 + 10


def test_calls_per_request_leaves_out_background_scrapes() -> None:
    seen = [["POST", "/v1/completions", ""]] * 50 + [["POST", "/tokenize", ""]] * 50
    seen += [["GET", "/metrics", ""]] * 7 + [["GET", "/health?x=1", ""]]
    assert calls_per_request(seen, 50) == {"/tokenize": 1.0, "/v1/completions": 1.0}
    assert calls_per_request([], 50) == {}


def test_control_note_gives_the_paused_direct_ratio() -> None:
    rows = {k: v for k, v in _rows().items() if k[0] != "vllm-router"}
    assert control_note(rows, 0.5) == ""
    rows[("direct-pause", "json", 1)] = _row(1.0, 0.0, 0.25)
    note = control_note(rows, 0.5)
    assert "1.25x (json)" in note
    assert "waits 0.5 ms" in note
    assert "nginx" not in note
    rows[("nginx", "json", 1)] = _row(1.1, 0.1, 0.22)
    for mode, c in (("json", 32), ("stream", 1), ("stream", 32)):
        rows[("nginx", mode, c)] = _row(1.1, 0.1, 0.20)
    assert "nginx 1.10x / 1.00x / 1.00x / 1.00x" in control_note(rows, 0.5)
