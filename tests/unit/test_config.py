import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, GatewayConfig, parse_config


def test_defaults_match_the_design() -> None:
    cfg = GatewayConfig()
    assert (cfg.admission.high_watermark, cfg.admission.low_watermark) == (0.90, 0.80)
    assert cfg.telemetry.scrape_interval_s <= 0.25


def test_errors_carry_yaml_locations() -> None:
    text = "upstream:\n  url: http://x\nadmission:\n  high_watermark: 1.5\n  queue_max_wait_s: soon\nbogus: 1\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, "kv.yaml")
    assert err.value.errors == [
        "kv.yaml:4:3: admission.high_watermark: Input should be less than or equal to 1",
        "kv.yaml:5:3: admission.queue_max_wait_s: Input should be a valid number, unable to parse string as a number",
        "kv.yaml:6:1: bogus: Extra inputs are not permitted",
    ]


def test_watermarks_must_be_ordered() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config("admission:\n  high_watermark: 0.7\n  low_watermark: 0.8\n", "kv.yaml")
    assert "low_watermark must be below high_watermark" in err.value.errors[0]
    assert err.value.errors[0].startswith("kv.yaml:2:3: admission:")


def test_the_control_port_is_a_port_of_its_own() -> None:
    assert parse_config("listen:\n  control_port: 9090\n").listen.control_port == 9090
    assert parse_config("listen: {}\n").listen.control_port is None  # default: on the client port
    with pytest.raises(ConfigError) as err:
        parse_config("listen:\n  port: 9000\n  control_port: 9000\n", "kv.yaml")
    assert "control_port: 9000 is the client port too" in err.value.errors[0]
    with pytest.raises(ConfigError):  # a --port flag that lands on it is refused as well
        parse_config("listen:\n  control_port: 9000\n").with_overrides(port=9000)


def test_yaml_syntax_error_has_a_location() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config("admission:\n  high_watermark: [1\n", "kv.yaml")
    assert err.value.errors[0].startswith("kv.yaml:3:1: YAML syntax error")


def test_flags_override_the_file() -> None:
    cfg = parse_config("upstream:\n  url: http://a:1\nlisten:\n  port: 9000\n").with_overrides(
        upstream="http://b:2", port=None, tokenizer="heuristic:3"
    )
    assert (cfg.upstream.url, cfg.listen.port, cfg.tokenizer) == ("http://b:2", 9000, "heuristic:3")


def test_engines_named_on_the_command_line_replace_the_files_discovery() -> None:
    """--upstream (or KVGATE_UPSTREAM) over a file with ``discovery``: the flag's engines, as flags override the
    file (the file's discovery used to win, silently); both --upstream and --upstream-dns: which one is meant?"""
    file = "upstream:\n  discovery:\n    dns: vllm.default.svc.cluster.local\n"
    cfg = parse_config(file).with_overrides(upstream=["http://b:2", "http://c:3"])
    assert cfg.upstream.discovery is None and cfg.upstream.urls == ["http://b:2", "http://c:3"]
    assert parse_config(file).with_overrides(upstream=None).upstream.discovery is not None
    with pytest.raises(ConfigError, match="two ways"):
        parse_config("{}").with_overrides(upstream=["http://b:2"], upstream_dns="vllm:8000")


def test_validate_command(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("admission:\n  queue_max_length: 10\n")
    bad.write_text("admission:\n  queue_max_length: -1\n")
    ok = subprocess.run([sys.executable, "-m", "gateway", "validate", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0 and "OK" in ok.stdout
    no = subprocess.run([sys.executable, "-m", "gateway", "validate", str(bad)], capture_output=True, text=True)
    assert no.returncode == 1
    assert f"{bad}:2:3: admission.queue_max_length: Input should be greater than or equal to 0" in no.stderr


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/reset_prefix_cache/", "not a canonical path"),
        ("/café", "not a canonical path"),
        ("/a//b", "not a canonical path"),
        ("/metrics", "kvgate's own endpoint"),
        ("/healthz", "kvgate's own endpoint"),
        ("/v1/chat/completions", "a route kvgate serves itself"),  # admitted: never passed through unadmitted
        ("/v1/models", "a route kvgate serves itself"),
    ],
)
def test_allowed_paths_that_could_never_match_are_refused(path: str, why: str) -> None:
    """An allow-list entry routing can never reach (a request path is matched as sent, and kvgate's own
    endpoints are answered first) is a mistake the operator hears of at start-up, not a silently dead entry."""
    text = f"passthrough:\n  allow: ['{path}']\n  admin_api_keys: [k]\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, "kv.yaml")
    assert why in err.value.errors[0]


def test_allowed_paths_need_a_key_to_call_them() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config("passthrough:\n  allow: [/reset_prefix_cache]\n", "kv.yaml")
    assert "only a key may call" in err.value.errors[0]
    with_tenant_keys = "passthrough:\n  allow: [/reset_prefix_cache]\ntenants:\n  - {name: t, api_keys: [k]}\n"
    assert parse_config(with_tenant_keys, "kv.yaml").passthrough.allow == ["/reset_prefix_cache"]


def test_command_line_flags_keep_a_per_model_override_to_what_it_sets() -> None:
    """``kvgate serve`` applies its flags to the file (with_overrides): a per-model override must still change only
    the fields it sets, as after a reload; a full dump once made every field "set", and its Nones replaced the
    tenant's own limits for that model (requests_per_minute unlimited, the weight and priority reset)."""
    from gateway.tenants.policy import Policy

    file = (
        "tenants:\n  - name: team-a\n    api_keys: [sk-a]\n    priority: critical\n    weight: 2\n"
        "    requests_per_minute: 600\n    max_queued: 64\n    max_queue_wait_s: 10\n"
        "    models: {llama-70b: {tokens_per_minute: 50000, max_concurrent: 4}}\n"
    )
    as_read = parse_config(file)
    as_served = as_read.with_overrides(upstream=["http://b:2"], port=9000, tokenizer=None)

    def policy(cfg: GatewayConfig) -> Policy:
        return Policy(cfg.auth, cfg.tenants, cfg.admission.queue_max_wait_s)

    for cfg in (as_read, as_served):
        limits = policy(cfg).resolve("team-a", "llama-70b")
        assert limits.rates.requests_per_minute == 600 and limits.rates.tokens_per_minute == 50000
        assert limits.max_concurrent == 4 and limits.wait_budget_s == 10
        assert (limits.qclass.weight, limits.qclass.max_queued) == (2.0, 64)
    assert as_served.model_dump() == as_read.with_overrides(upstream=["http://b:2"], port=9000).model_dump()
    assert (as_served.upstream.url, as_served.listen.port) == ("http://b:2", 9000)


@pytest.mark.parametrize(
    ("text", "where", "why"),
    [
        (
            "admission:\n  high_watermark: 0.8\n  low_watermark: 0.7\nadmission:\n  queue_max_length: 5\n",
            "4:1",
            "admission: given twice (also on line 1)",
        ),
        (
            "tenants:\n  - name: a\n    max_concurrent: 4\n    max_concurrent: 400\n",
            "4:5",
            "tenants.0.max_concurrent: given twice",
        ),
    ],
)
def test_a_key_given_twice_is_refused_where_it_is(text: str, where: str, why: str) -> None:
    """YAML keeps the last of two equal keys silently: a second ``admission:`` put the first's watermarks back to
    their defaults, and ``kvgate validate`` said OK."""
    with pytest.raises(ConfigError) as err:
        parse_config(text, "kv.yaml")
    assert err.value.errors[0].startswith(f"kv.yaml:{where}: {why}")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("log_level: verbose\n", "log_level"),
        ("upstream:\n  url: 127.0.0.1:8000\n", "is not an engine URL"),
        ("upstream:\n  urls: [http://a:1, 'vllm:8000']\n", "is not an engine URL"),
        ("tokenizer: heuristic:nan\n", "characters per token must be a positive number"),
        ("tokenizer: heuristic:inf\n", "characters per token must be a positive number"),
        ("tokenizer: heuristic:0\n", "characters per token must be a positive number"),
        ("passthrough:\n  admin_api_keys: ['sha256:0123']\n", "64 hex digits"),
        ("tenants:\n  - name: a\n    api_keys: [' sk-pad ']\n", "without whitespace at either end"),
        ('tenants:\n  - name: a\n    api_keys: ["sk-\\x07"]\n', "must be printable"),
        (
            "admission:\n  stale_after_s: 0.5\ntelemetry:\n  scrape_interval_s: 3\n",
            "must exceed telemetry.scrape_interval_s",
        ),
        ("admission:\n  stale_ledger_cap: 1.0\n", "stale_ledger_cap must be at most high_watermark"),
        (
            "redis: {url: 'redis://r:6379/0'}\ntelemetry: {scrape_interval_s: 5}\nadmission: {stale_after_s: 8}\n",
            "must exceed twice telemetry.scrape_interval_s + scrape_timeout_s (6)",
        ),
    ],
)
def test_what_could_never_work_is_refused_by_validate_not_at_start_up(tmp_path: Path, text: str, why: str) -> None:
    """Each of these passed ``kvgate validate`` and then stopped ``kvgate serve`` (a log level, an engine URL
    without a scheme), broke every request (heuristic:nan: a 500 each), or could never match a caller (a key
    with a space or an accent, a sha256 admin key too short, require_api_key with no key at all)."""
    path = tmp_path / "kv.yaml"
    path.write_text(text, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "gateway", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 1 and why in proc.stderr, proc.stderr


def test_log_level_in_any_case_and_a_config_file_that_is_not_utf8() -> None:
    assert parse_config("log_level: DEBUG\n").log_level == "debug"
    assert parse_config("log_level: WARN\n").log_level == "warning"  # Python's names, as logging took them
    assert parse_config("log_level: fatal\n").log_level == "critical"
    from gateway.config import parse_config_bytes

    with pytest.raises(ConfigError, match=r"kv.yaml: not UTF-8 text \(byte 12"):
        parse_config_bytes(b"# owner: Ren\xe9\n{}\n", "kv.yaml")


def test_what_an_operator_may_legitimately_write_is_still_accepted() -> None:
    """Lowering the watermarks alone (docs/pool.md suggests it as replicas grow) lowers the stale ledger's cap
    with them; every key revoked under require_api_key is a lock-down, which a reload must be able to apply; a
    key with a non-ASCII letter matches a client that sends it in Latin-1."""
    # a slow scrape without shared engine books, or with a lease to match it
    slow = "telemetry: {scrape_interval_s: 5}\nadmission: {stale_after_s: 8}\n"
    parse_config("redis: {url: 'redis://r:6379/0', share_engine_reservations: false}\n" + slow)
    parse_config("redis: {url: 'redis://r:6379/0', reservation_lease_s: 13}\n" + slow)
    lowered = parse_config("admission:\n  high_watermark: 0.7\n  low_watermark: 0.6\n")
    assert lowered.admission.stale_ledger_cap == 0.75  # applied as min(cap, high_watermark)
    locked = parse_config("auth:\n  require_api_key: true\ntenants:\n  - name: t\n    api_keys: []\n")
    assert locked.auth.require_api_key and locked.tenants[0].api_keys == []
    assert parse_config("tenants:\n  - name: a\n    api_keys: ['schl\u00fcssel-1']\n").tenants[0].api_keys
