"""kvgate as the only public door: routing by allow-list on the canonical path, auth on every route, and
nothing reaching the engine that kvgate did not check. Through the real HTTP stack: raw sockets to a real
``kvgate serve``, and a recording engine (the mini vLLM logs every target it receives, with its request id)."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.protocol.routes import GENERATION, READ_ONLY
from tests.support.procs import Proc, free_port
from tests.support.promtext import scrape

pytestmark = pytest.mark.e2e

KEY = "sk-tenant"
ADMIN = "sk-admin"
CONFIG = {
    "tokenizer": "heuristic",
    "auth": {"require_api_key": True},
    "tenants": [{"name": "t", "api_keys": [KEY]}],
    "upstream": {"api_key": "engine-secret"},
}


def raw_request(url: str, method: str, target: str, *, key: str | None = KEY, rid: str, body: bytes = b"") -> int:
    """One request written byte for byte (no client library normalises the target); returns the status."""
    parts = urlsplit(url)
    head = f"{method} {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nx-request-id: {rid}\r\nConnection: close\r\n"
    if key is not None:
        head += f"Authorization: Bearer {key}\r\n"
    if body or method == "POST":
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


def reached(upstream: str, rid: str) -> list[tuple[str, str]]:
    """What the engine received for the client's request id ``rid`` (the engine's id is ``rid-<suffix>``):
    (method, target as it arrived)."""
    return [(m, t) for m, t, r in httpx.get(upstream + "/debug/requests").json() if r.rpartition("-")[0] == rid]


COMPLETION = b'{"model":"mini","prompt":"hello","max_tokens":4}'
ATTACKS = [
    # admin and debug routes, unknown routes, the engine's own metrics
    ("POST", "/reset_prefix_cache", 404),
    ("POST", "/sleep", 404),
    ("POST", "/wake_up", 404),
    ("POST", "/collective_rpc", 404),
    ("POST", "/v1/load_lora_adapter", 404),
    ("POST", "/scale_elastic_ep", 404),
    ("POST", "/pause", 404),
    ("POST", "/start_profile", 404),
    ("GET", "/is_sleeping", 404),
    ("GET", "/./metrics", 400),
    ("GET", "/metrics%3F", 400),
    # the inference routes, bent so they would miss an exact match and be normalised later
    ("POST", "/v1/chat/completions%3F", 400),
    ("POST", "/v1/./chat/completions", 400),
    ("POST", "/v1/x/../chat/completions", 400),
    ("POST", "/v1/chat/completions%23x", 400),
    ("POST", "/v1/chat/completions/", 400),
    ("POST", "//v1/completions", 400),
    ("POST", "/v1%2Fcompletions", 400),
    ("POST", "/V1/completions", 404),
    ("GET", "/v1/completions", 405),
    ("DELETE", "/v1/models", 405),
]


def test_only_known_routes_on_canonical_paths_reach_the_engine(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    upstream = mini_vllm()
    gw = gateway(upstream, CONFIG)
    for i, (method, target, status) in enumerate(ATTACKS):
        rid = f"attack-{i}"
        assert raw_request(gw, method, target, rid=rid, body=COMPLETION) == status, target
        # a caller without a key learns nothing of which paths exist, nor of what form they take
        assert raw_request(gw, method, target, key=None, rid=rid, body=COMPLETION) == 401, target
        assert raw_request(gw, method, target, key="sk-guess", rid=rid, body=COMPLETION) == 401, target
        assert reached(upstream, rid) == [], f"{method} {target} reached the engine"
    assert scrape(gw).get("kvgate_requests_admitted_total", 0) == 0
    # the canonical route works, is admitted, and reaches the engine with its target as sent
    assert raw_request(gw, "POST", "/v1/completions?trace=%2F..", rid="ok", body=COMPLETION) == 200
    assert reached(upstream, "ok") == [("POST", "/v1/completions?trace=%2F..")]
    assert scrape(gw)["kvgate_requests_admitted_total"] == 1


def test_every_route_needs_a_key_and_admin_routes_open_only_when_listed(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    upstream = mini_vllm()
    config = {**CONFIG, "passthrough": {"allow": ["/reset_prefix_cache"], "admin_api_keys": [ADMIN]}}
    gw = gateway(upstream, config)
    assert raw_request(gw, "GET", "/v1/models", key=None, rid="anon-models") == 401
    assert raw_request(gw, "POST", "/tokenize", key="wrong", rid="bad-key", body=b'{"prompt":"x"}') == 401
    assert reached(upstream, "anon-models") == reached(upstream, "bad-key") == []
    assert raw_request(gw, "GET", "/v1/models", rid="models") == 200
    assert reached(upstream, "models") == [("GET", "/v1/models")]
    # an allow-listed admin route: only with the admin key
    assert raw_request(gw, "POST", "/reset_prefix_cache", rid="tenant-reset") == 403
    # a stranger cannot tell an open admin route from a path that is not there
    for key in (None, "sk-guess"):
        assert raw_request(gw, "POST", "/reset_prefix_cache", key=key, rid="stranger-reset") == 401
        assert raw_request(gw, "POST", "/sleep", key=key, rid="stranger-sleep") == 401
    assert raw_request(gw, "POST", "/reset_prefix_cache", key=ADMIN, rid="admin-reset") == 200
    assert reached(upstream, "tenant-reset") == []
    assert reached(upstream, "admin-reset") == [("POST", "/reset_prefix_cache")]
    assert raw_request(gw, "POST", "/sleep", key=ADMIN, rid="admin-sleep") == 404  # not listed
    # kvgate's own endpoints stay open (probes and Prometheus)
    assert httpx.get(gw + "/healthz").status_code == 200 and httpx.get(gw + "/metrics").status_code == 200


def test_without_admin_keys_an_allowed_admin_route_still_needs_a_tenant_key(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """Anonymous traffic is allowed on the generation routes (``require_api_key`` off), but an engine admin
    route opened by ``passthrough.allow`` answers only to a key."""
    upstream = mini_vllm()
    config = {
        "tokenizer": "heuristic",
        "tenants": [{"name": "t", "api_keys": [KEY]}],
        "passthrough": {"allow": ["/reset_prefix_cache"]},
    }
    gw = gateway(upstream, config)
    assert raw_request(gw, "POST", "/v1/completions", key=None, rid="anon-gen", body=COMPLETION) == 200
    assert raw_request(gw, "POST", "/reset_prefix_cache", key=None, rid="anon-reset") == 401
    assert raw_request(gw, "POST", "/reset_prefix_cache", key="wrong", rid="wrong-reset") == 401
    assert reached(upstream, "anon-reset") == reached(upstream, "wrong-reset") == []
    assert raw_request(gw, "POST", "/reset_prefix_cache", rid="tenant-reset") == 200
    assert reached(upstream, "tenant-reset") == [("POST", "/reset_prefix_cache")]
    # an anonymous caller may generate, but is told nothing of the paths that are not open to it either
    for target, status in (("/sleep", 404), ("/v1/./completions", 400), ("/reset_prefix_cache/", 400)):
        assert raw_request(gw, "POST", target, key=None, rid="anon-probe") == 401, target
        assert raw_request(gw, "POST", target, rid="tenant-probe") == status, target


def test_other_generation_routes_go_through_admission(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    upstream = mini_vllm()
    gw = gateway(upstream, CONFIG)
    bodies = {
        "/v1/embeddings": b'{"model":"mini","input":["a","b"]}',
        "/v1/responses": b'{"model":"mini","input":"hi","max_output_tokens":8}',
        "/invocations": b'{"model":"mini","prompt":"hi","max_tokens":4}',
        "/rerank": b'{"model":"mini","query":"q","documents":["a","b"]}',
        "/v1/messages": b'{"model":"mini","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}',
    }
    for i, (path, body) in enumerate(bodies.items()):
        assert raw_request(gw, "POST", path, rid=f"gen-{i}", body=body) == 200, path
        assert reached(upstream, f"gen-{i}") == [("POST", path)]
    metrics = scrape(gw)
    assert metrics["kvgate_requests_admitted_total"] == len(bodies)
    # the engine's usage is read in the Responses and Anthropic shapes too (input_tokens / output_tokens):
    # what those two answered (8 tokens each) is billed and learned, not taken for zero
    assert metrics["kvgate_completion_tokens_total"] == 8 + 8
    assert raw_request(gw, "POST", "/v1/embeddings", rid="bad", body=b'{"input":""}') == 400
    assert reached(upstream, "bad") == []
    # a 400 without an error code is counted too, under its status
    assert scrape(gw)["kvgate_requests_rejected_total{reason=http_400}"] == 1


# --- the property: whatever the target, only allowed canonical paths reach the engine ------------------

CANONICAL = set(GENERATION) | set(READ_ONLY)
BASES = [*sorted(CANONICAL), "/metrics", "/sleep", "/reset_prefix_cache", "/v1/load_lora_adapter", "/"]


def _bend(path: str, op: str, i: int) -> str:
    """One way of writing a path that a normalising server would still route to the same place."""
    i %= len(path) + 1
    c = path[i : i + 1]
    return {
        "encode": path[:i] + "".join(f"%{ord(ch):02X}" for ch in c) + path[i + 1 :],
        "encode_lower": path[:i] + "".join(f"%{ord(ch):02x}" for ch in c) + path[i + 1 :],
        "dot": path[:i] + "/." + path[i:],
        "dotdot": path[:i] + "/x/.." + path[i:],
        "double_slash": path[:i] + "/" + path[i:],
        "trailing_slash": path + "/",
        "upper": path[:i] + c.upper() + path[i + 1 :],
        "encoded_dot": path[:i] + "/%2e" + path[i:],
        "double_encode": path[:i] + "%252F" + path[i:],
    }[op]


@st.composite
def targets(draw: st.DrawFn) -> str:
    path = draw(st.sampled_from(BASES))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["encode", "encode_lower", "dot", "dotdot", "double_slash", "trailing_slash",
                                   "upper", "encoded_dot", "double_encode"]))  # fmt: skip
        path = _bend(path, op, draw(st.integers(0, 64)))
    return path + draw(st.sampled_from(["", "?a=1", "?x=%2F..", "?"]))


TARGETS = targets()
EXAMPLES = itertools.count()


@pytest.fixture(scope="module")
def target_rig() -> Iterator[tuple[str, str]]:
    """One engine and one gateway for all the examples (hypothesis runs many; starting each is slow)."""
    from tests.support.procs import start_gateway, start_mini_vllm

    engine = start_mini_vllm()
    gw = start_gateway(engine.url, CONFIG)
    yield engine.url, gw.url
    gw.stop()
    engine.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["GET", "POST"]), target=TARGETS)
def test_generated_targets_never_reach_the_engine_off_the_allow_list(
    target_rig: tuple[str, str], method: str, target: str
) -> None:
    upstream, gw = target_rig
    before = scrape(gw).get("kvgate_requests_admitted_total", 0)
    rid = f"prop-{next(EXAMPLES)}"  # hypothesis may draw the same target twice: one id per request
    raw_request(gw, method, target, rid=rid, body=COMPLETION if method == "POST" else b"")
    arrived = reached(upstream, rid)
    admitted = scrape(gw).get("kvgate_requests_admitted_total", 0) - before
    for _, got in arrived:
        path = got.split("?", 1)[0]
        sent_as = target.removesuffix("?")  # an empty query string is no query string
        assert path in CANONICAL and got == sent_as, f"{method} {target} reached the engine as {got}"
        if path in GENERATION:
            assert admitted == 1, f"{target} reached the engine without admission"
    assert len(arrived) <= 1  # and never twice


def start_with_control_port(procs: list[Proc], tmp_path: Path, listen: dict[str, object]) -> tuple[str, str, str]:
    """mini vLLM and a gateway with ``listen.control_port``: (upstream, client URL, control URL)."""
    import yaml

    from tests.support.procs import free_port, gateway_argv, start_mini_vllm

    procs.append(start_mini_vllm())
    upstream = procs[-1].url
    port, control = free_port(), free_port()
    config = tmp_path / "kvgate.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "listen": {**listen, "control_port": control}}))
    argv = gateway_argv(upstream, port, config)
    procs.append(Proc("kvgate", argv, url=f"http://127.0.0.1:{control}").start().wait_ready("/readyz", 60))
    return upstream, f"http://127.0.0.1:{port}", procs[-1].url


def test_a_control_port_takes_readiness_and_metrics_off_the_client_port(procs: list[Proc], tmp_path: Path) -> None:
    """``listen.control_port``: /readyz and /metrics answer there and nowhere else (the client port says 404,
    as for any route it does not know, or 401 to a caller without a key, and tells nothing of the engines or
    tenants); /healthz, which tells
    nothing, answers on both. The control port proxies nothing. Generations go through the client port."""
    upstream, client, control_url = start_with_control_port(procs, tmp_path, {})

    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(control_url + path).status_code == 200
    assert httpx.get(client + "/healthz").json() == {"status": "alive"}
    for path in ("/readyz", "/metrics"):
        for key, status in ((None, 401), (KEY, 404)):  # not even a tenant's key reaches them on the client port
            answer = httpx.get(client + path, headers={"authorization": f"Bearer {key}"} if key else {})
            assert answer.status_code == status and upstream.rpartition(":")[2] not in answer.text
    assert "kvgate_requests_admitted_total" in httpx.get(control_url + "/metrics").text

    rid = "control-port"
    assert raw_request(control_url, "POST", "/v1/completions", rid=rid, body=COMPLETION) == 404
    assert raw_request(control_url, "GET", "/v1/models", rid=rid) == 404
    assert reached(upstream, rid) == []
    assert raw_request(client, "POST", "/v1/completions", rid="client-port", body=COMPLETION) == 200
    assert reached(upstream, "client-port") == [("POST", "/v1/completions")]
    assert scrape(control_url)["kvgate_requests_admitted_total"] == 1


def test_clients_at_the_connection_limit_do_not_fail_the_probes(procs: list[Proc], tmp_path: Path) -> None:
    """``max_connections`` held by idle client connections: the client port answers 503, the control port
    still answers its probes (a failed liveness probe restarts the pod)."""
    _, client, control_url = start_with_control_port(procs, tmp_path, {"max_connections": 2})
    parts = urlsplit(client)
    held = [socket.create_connection((parts.hostname, parts.port), timeout=30) for _ in range(2)]
    try:
        assert raw_request(client, "POST", "/v1/completions", rid="over-the-limit", body=COMPLETION) == 503
        for path in ("/healthz", "/readyz", "/metrics"):
            assert httpx.get(control_url + path).status_code == 200
    finally:
        for sock in held:
            sock.close()


def test_an_allowed_admin_call_reaches_every_engine_of_a_pool(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """``/v1/load_lora_adapter`` sent to one engine of a pool would leave the adapter missing on the others
    (their requests for it a 404): each engine gets the call, and the client hears the answer they agreed on,
    or a 502 that says which engine answered what (never where it is) when one of them could not be reached."""
    first, second = mini_vllm(), mini_vllm()
    allow = {"allow": ["/v1/load_lora_adapter"], "admin_api_keys": [ADMIN]}
    config = {**CONFIG, "passthrough": allow}
    gw = gateway(first, config, extra_args=["--upstream", second])
    body = b'{"lora_name": "a", "lora_path": "/adapters/a"}'
    admin = {"authorization": f"Bearer {ADMIN}", "x-request-id": "load"}
    resp = httpx.post(gw + "/v1/load_lora_adapter", content=body, headers=admin)
    assert resp.status_code == 200 and resp.headers["x-kvgate-engines"] == "2"
    assert reached(first, "load") == reached(second, "load") == [("POST", "/v1/load_lora_adapter")]
    assert raw_request(gw, "GET", "/v1/models", rid="models") == 200  # a read-only route: one engine
    assert len(reached(first, "models") + reached(second, "models")) == 1

    dead = f"http://127.0.0.1:{free_port()}"
    gw = gateway(first, config, extra_args=["--upstream", dead], ready=False)
    resp = httpx.post(gw + "/v1/load_lora_adapter", content=body, headers=admin)
    error = resp.json()["error"]
    assert resp.status_code == 502 and error["code"] == "engines_disagree"
    assert "engine 1: 200, engine 2: 503" in error["message"] and "127.0.0.1" not in error["message"]
