"""The kustomize overlays render, validate against Kubernetes schemas, and wire up the way the docs say.

Schema validation catches what ``kubectl apply`` would reject; the wiring checks catch what it would accept
but run wrongly (a Service selecting no pod, vLLM reachable around the gateway, a ConfigMap update that never
reaches the hot reload).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from crd_schemas import SCHEMAS
from deploy_support import OVERLAYS, REPO, Manifest, containers, dashboard, find, kustomize, one

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate missing; install: python3 -m pip install kubernetes-validate"
)

# The oldest Kubernetes release the manifests promise to work on, and the newest the validator knows.
K8S_VERSIONS = ["1.29", kubernetes_validate.latest_version()]


def validation_errors(docs: list[Manifest], version: str) -> list[str]:
    """Every schema error in a rendered overlay; an unknown kind is an error too, never a silent pass."""
    errors = []
    for doc in docs:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        crd_schema = SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
        if crd_schema is not None:
            errors += [f"{where}: {e.message}" for e in jsonschema.Draft7Validator(crd_schema).iter_errors(doc)]
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{where}: {exc.message} at {'.'.join(str(p) for p in exc.path)}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{where}: no schema for {doc.get('apiVersion')} {doc.get('kind')}")
    return errors


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_manifests_validate(rendered: dict[str, list[Manifest]], overlay: str, version: str) -> None:
    docs = rendered[overlay]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule"} <= kinds
    assert validation_errors(docs, version) == []


def test_validator_rejects_broken_manifests(kubectl: str, deploy_copy: Path) -> None:
    """Break a tmp copy in three ways (misspelled field, wrong type, bad CRD duration): each is reported."""
    deployment = deploy_copy / "base" / "deployment.yaml"
    deployment.write_text(deployment.read_text().replace("readinessProbe:", "readynessProbe:", 1))
    service = deploy_copy / "base" / "service.yaml"
    service.write_text(service.read_text().replace("port: 8080", 'port: "eighty"', 1))
    monitor = deploy_copy / "components" / "monitoring" / "servicemonitor.yaml"
    monitor.write_text(monitor.read_text().replace("interval: 15s", "interval: 15 seconds"))
    errors = "\n".join(validation_errors(kustomize(kubectl, deploy_copy / "overlays" / "sidecar"), K8S_VERSIONS[-1]))
    assert "readynessProbe" in errors
    assert "'eighty' is not of type 'integer'" in errors
    assert "ServiceMonitor/kvgate" in errors and "15 seconds" in errors


# ---- wiring -----------------------------------------------------------------------------------------------


def pod_templates(docs: list[Manifest]) -> list[Manifest]:
    return [d for d in docs if d["kind"] in {"Deployment", "StatefulSet", "DaemonSet"}]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pods_selected(docs: list[Manifest], selector: dict[str, str]) -> list[Manifest]:
    return [w for w in pod_templates(docs) if selects(selector, w["spec"]["template"]["metadata"]["labels"])]


def container_port(workload: Manifest, port: int | str) -> int | None:
    """Resolve a Service targetPort (number or name) against a workload's containers."""
    for c in containers(workload).values():
        for p in c.get("ports", []):
            if port in (p["containerPort"], p.get("name")):
                return int(p["containerPort"])
    return None


def policy(docs: list[Manifest]) -> dict[str, Any]:
    """The kvgate policy the pods mount, found through the volume, not by guessing the hashed name."""
    (workload,) = [w for w in pod_templates(docs) if "kvgate" in containers(w)]
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "kvgate-config"]
    cm = one(docs, "ConfigMap", volume["configMap"]["name"])
    result: dict[str, Any] = yaml.safe_load(cm["data"]["kvgate.yaml"])
    return result


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_selector_matches_a_pod(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    docs = rendered[overlay]
    for svc in find(docs, "Service"):
        targets = pods_selected(docs, svc["spec"]["selector"])
        assert targets, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            assert all(container_port(w, port["targetPort"]) for w in targets), (svc["metadata"]["name"], port)
    for pdb in find(docs, "PodDisruptionBudget"):
        assert pods_selected(docs, pdb["spec"]["selector"]["matchLabels"]), pdb["metadata"]["name"]
    for w in pod_templates(docs):
        assert selects(w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
    for sm in find(docs, "ServiceMonitor"):
        services = [
            s
            for s in find(docs, "Service")
            if selects(sm["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))
        ]
        assert services, f"ServiceMonitor {sm['metadata']['name']} selects no Service"
        port_names = {p["name"] for s in services for p in s["spec"]["ports"]}
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= port_names


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_workloads_are_bounded_and_kvgate_is_locked_down(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    for w in pod_templates(rendered[overlay]):
        for c in containers(w).values():
            res = c.get("resources", {})
            assert res.get("requests") and res.get("limits"), f"{w['metadata']['name']}/{c['name']} unbounded"
            assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]
        gate = containers(w).get("kvgate")
        if gate is None:
            continue
        sc = gate["securityContext"]
        assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert gate["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert gate["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert gate["lifecycle"]["preStop"], "kvgate needs a preStop so endpoints drop before SIGTERM"
        mount = next(m for m in gate["volumeMounts"] if m["name"] == "kvgate-config")
        # A subPath mount never sees ConfigMap updates, which would silently defeat the hot reload.
        assert "subPath" not in mount
        args = gate["args"]
        assert args[args.index("--config") + 1] == f"{mount['mountPath']}/kvgate.yaml"
        port = policy(rendered[overlay])["listen"]["port"]
        assert container_port(w, "http") == port
        # The image turns KVGATE_PORT into --port (and its HEALTHCHECK reads it): it must agree too.
        env = {e["name"]: e.get("value") for e in gate.get("env", [])}
        assert int(env["KVGATE_PORT"]) == port
        # probes and Prometheus on the control port, which the client port does not answer for
        control = policy(rendered[overlay])["listen"]["control_port"]
        assert container_port(w, "control") == control == int(env["KVGATE_CONTROL_PORT"])
        for probe in ("readinessProbe", "livenessProbe"):
            assert gate[probe]["httpGet"]["port"] == "control"


def test_sidecar_engine_is_reachable_only_through_kvgate(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["sidecar"]
    pod = one(docs, "Deployment", "vllm")
    vllm, gate = containers(pod)["vllm"], containers(pod)["kvgate"]
    args = vllm["args"]
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert "ports" not in vllm, "a declared engine port invites a Service that bypasses the gateway"
    upstream = urlsplit(policy(docs)["upstream"]["url"])
    assert (upstream.hostname, upstream.port) == ("127.0.0.1", int(args[args.index("--port") + 1]))
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # clients' Service reaches kvgate's client port only; the control port has a Service of its own
    svc, control = one(docs, "Service", "kvgate"), one(docs, "Service", "kvgate-control")
    assert [container_port(pod, p["targetPort"]) for p in svc["spec"]["ports"]] == [container_port(pod, "http")]
    assert [container_port(pod, p["targetPort"]) for p in control["spec"]["ports"]] == [container_port(pod, "control")]
    assert len(find(docs, "Service")) == 2
    assert "http" in {p["name"] for p in gate["ports"]}


def engine_prestop(docs: list[Manifest]) -> str:
    vllm = containers(one(docs, "Deployment", "vllm"))["vllm"]
    script: str = vllm["lifecycle"]["preStop"]["exec"]["command"][-1]
    return script


# After the drain, uvicorn still gives open connections this long (timeout_graceful_shutdown in serve.py).
UVICORN_CLOSE_S = 5


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_shutdown_budget_covers_the_drain(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    """preStop + --drain-timeout + uvicorn's close fit in kvgate's grace period, and vLLM outlives it."""
    cli = pytest.importorskip("gateway.cli")
    docs = rendered[overlay]
    drains = []
    for w in pod_templates(docs):
        gate = containers(w).get("kvgate")
        if gate is None:
            continue
        grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        sleep = int(gate["lifecycle"]["preStop"]["exec"]["command"][-1])
        drain = cli.build_parser().parse_args(["serve", *gate["args"]]).drain_timeout
        drains.append(sleep + drain + UVICORN_CLOSE_S)
        assert drains[-1] < grace, f"{w['metadata']['name']}: {drains[-1]} s of shutdown in a {grace} s grace"
    engine = one(docs, "Deployment", "vllm")["spec"]["template"]["spec"]
    max_wait = re.search(r'"PRESTOP_MAX_WAIT_S", "(\d+)"', engine_prestop(docs))
    assert max_wait and max(drains) < int(max_wait.group(1)) < engine["terminationGracePeriodSeconds"]


def _free_listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _start_prestop(script: str, gateway: int, engine: int, max_wait: float) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PRESTOP_GATEWAY_PORT": str(gateway),
        "PRESTOP_ENGINE_PORT": str(engine),
        "PRESTOP_MIN_WAIT_S": "0",
        "PRESTOP_MAX_WAIT_S": str(max_wait),
    }
    return subprocess.Popen([sys.executable, "-c", script], env=env)


def _still_running(proc: subprocess.Popen[bytes], seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return True
    return False


class FakeEngineMetrics:
    """An engine's /metrics on a free port, holding ``running`` requests (changed by the test)."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.running = 0
        metrics = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                body = (
                    "# HELP vllm:num_requests_running Running\n"
                    f'vllm:num_requests_running{{engine="0",model_name="m"}} {float(metrics.running)}\n'
                    'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
                ).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_engine_prestop_waits_for_the_gateway_and_the_engines_requests(rendered: dict[str, list[Manifest]]) -> None:
    """Run vLLM's real preStop script: it holds while the gateway listens, then while the engine still holds
    requests (a stream being drained), and returns once both are done; a connection merely left open (the
    keep-alive of a Prometheus or gateway scraper) does not hold it."""
    script = engine_prestop(rendered["sidecar"])
    compile(script, "preStop", "exec")
    gateway, engine = _free_listener(), FakeEngineMetrics()
    idle = socket.create_connection(("127.0.0.1", engine.port))  # a scraper's keep-alive, open throughout
    engine.running = 1
    proc = _start_prestop(script, gateway.getsockname()[1], engine.port, max_wait=30)
    try:
        assert _still_running(proc, 1.0), "returned while the gateway was still listening"
        gateway.close()
        assert _still_running(proc, 1.5), "returned while the engine still held a request"
        engine.running = 0
        assert proc.wait(timeout=5) == 0
    finally:
        proc.kill()
        idle.close()
        gateway.close()
        engine.close()


def test_engine_prestop_gives_up_at_its_deadline(rendered: dict[str, list[Manifest]]) -> None:
    gateway = _free_listener()
    try:
        proc = _start_prestop(engine_prestop(rendered["sidecar"]), gateway.getsockname()[1], 1, max_wait=1)
        assert proc.wait(timeout=10) == 0
    finally:
        gateway.close()


def test_standalone_gateways_share_redis_and_fence_the_engine(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["standalone"]
    gw = one(docs, "Deployment", "kvgate")
    assert gw["spec"]["replicas"] >= 2
    engine = one(docs, "Deployment", "vllm")
    assert set(containers(engine)) == {"vllm"}, "the standalone engine pod carries no sidecar"
    cfg = policy(docs)
    # The replicas are the fenced engine's only clients and share their claims: their ledgers bound it together.
    assert cfg["admission"]["exclusive_upstream"] is True
    assert cfg["redis"].get("share_engine_reservations", True) is True, "one replica's ledger alone bounds nothing"
    for url, default_port in ((cfg["upstream"]["url"], 80), (cfg["redis"]["url"], 6379)):
        parts = urlsplit(url)
        svc = one(docs, "Service", str(parts.hostname))
        assert (parts.port or default_port) in {p["port"] for p in svc["spec"]["ports"]}, url
    # Degraded (Redis down) limits are divided by this count: it must be the real replica count.
    assert cfg["redis"]["replicas"] == gw["spec"]["replicas"]
    vllm_args = containers(engine)["vllm"]["args"]
    assert vllm_args[vllm_args.index("--host") + 1] == "0.0.0.0"
    policies = {p["metadata"]["name"]: p for p in find(docs, "NetworkPolicy")}
    fence = policies["vllm-from-kvgate-only"]["spec"]
    assert selects(fence["podSelector"]["matchLabels"], engine["spec"]["template"]["metadata"]["labels"])
    assert fenced_sources(fence) == [{"app.kubernetes.io/name": "kvgate"}]
    assert one(docs, "Service", "kvgate")["spec"]["selector"] == {"app.kubernetes.io/name": "kvgate"}


def fenced_sources(fence: dict[str, Any]) -> list[dict[str, str]]:
    """The pods of kvgate's own namespace the engine fence lets in (their labels). Every other source must be
    the Prometheus pods of a monitoring namespace, both selectors together: a namespace alone would let any of
    its pods send the engine generations kvgate never admitted. No ipBlock around kvgate."""
    local = []
    for source in (src for rule in fence["ingress"] for src in rule["from"]):
        assert set(source) <= {"podSelector", "namespaceSelector"}, "no ipBlock around kvgate"
        if "namespaceSelector" in source:
            assert source.get("podSelector", {}).get("matchLabels") == {"app.kubernetes.io/name": "prometheus"}
        else:
            local.append(source["podSelector"]["matchLabels"])
    return local


# CoreDNS's kubernetes plugin answers with a 5 s TTL by default: a pod that left the endpoints may still be
# in a cached answer that long.
DNS_TTL_S = 5


def test_pool_discovers_the_engines_through_a_headless_service(rendered: dict[str, list[Manifest]]) -> None:
    """kvgate's discovery name is the headless engine Service's FQDN in the overlay's namespace, and the port
    it dials on each pod address is the engine container's; no load-balanced Service spreads around it."""
    docs = rendered["pool"]
    engine = one(docs, "Deployment", "vllm")
    gw = one(docs, "Deployment", "kvgate")
    assert engine["spec"]["replicas"] >= 2 and gw["spec"]["replicas"] >= 2
    assert set(containers(engine)) == {"vllm"}, "the pool's engine pods carry no sidecar"
    discovery = policy(docs)["upstream"]["discovery"]
    name, namespace, svc_domain, cluster_domain = discovery["dns"].split(".", 3)
    assert (svc_domain, cluster_domain) == ("svc", "cluster.local")
    svc = one(docs, "Service", name)
    assert svc["metadata"]["namespace"] == namespace, "the discovery name points into another namespace"
    assert {d["metadata"].get("namespace") for d in docs} == {namespace}
    spec = svc["spec"]
    assert spec["clusterIP"] == "None", "a ClusterIP Service resolves to one virtual IP: one engine to kvgate"
    assert spec.get("publishNotReadyAddresses", False) is False, "engines that are not ready must not resolve"
    assert pods_selected(docs, spec["selector"]) == [engine]
    # DNS gives pod addresses, so kvgate dials the container port; the Service port is kept equal for clarity.
    (port,) = spec["ports"]
    assert discovery["port"] == container_port(engine, port["targetPort"]) == port["port"]
    assert discovery["scheme"] == "http"
    # Only ready pods resolve: the engine needs a readiness probe on its own health route.
    vllm = containers(engine)["vllm"]
    assert vllm["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    args = vllm["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert int(args[args.index("--port") + 1]) == discovery["port"]
    for other in find(docs, "Service"):
        if pods_selected(docs, other["spec"]["selector"]) == [engine]:
            assert other["spec"].get("clusterIP") == "None", f"Service {other['metadata']['name']} load-balances"
    # A pod that leaves the endpoints keeps serving until every gateway's discovery has seen it go.
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert float(env["PRESTOP_MIN_WAIT_S"]) >= discovery["interval_s"] + DNS_TTL_S
    # The gateways' Redis and the fence around the engines, as in the standalone layout.
    cfg = policy(docs)
    assert cfg["admission"]["exclusive_upstream"] is True
    assert cfg["redis"].get("share_engine_reservations", True) is True
    redis = urlsplit(cfg["redis"]["url"])
    assert (redis.port or 6379) in {p["port"] for p in one(docs, "Service", str(redis.hostname))["spec"]["ports"]}
    assert cfg["redis"]["replicas"] == gw["spec"]["replicas"]
    fence = {p["metadata"]["name"]: p for p in find(docs, "NetworkPolicy")}["vllm-from-kvgate-only"]["spec"]
    assert selects(fence["podSelector"]["matchLabels"], engine["spec"]["template"]["metadata"]["labels"])
    assert fenced_sources(fence) == [{"app.kubernetes.io/name": "kvgate"}]
    assert pods_selected(docs, one(docs, "Service", "kvgate")["spec"]["selector"]) == [gw]


def test_pool_policy_loads_with_the_config_loader(rendered: dict[str, list[Manifest]], tmp_path: Path) -> None:
    """The ConfigMap's file, as kvgate reads it from its mount: load_config and ``kvgate validate`` accept it,
    and the loaded policy discovers engines instead of using upstream.url."""
    config = pytest.importorskip("gateway.config")
    from gateway.cli import main
    from gateway.upstream.pool import engine_url

    (workload,) = [w for w in pod_templates(rendered["pool"]) if "kvgate" in containers(w)]
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "kvgate-config"]
    path = tmp_path / "kvgate.yaml"
    path.write_text(one(rendered["pool"], "ConfigMap", volume["configMap"]["name"])["data"]["kvgate.yaml"])
    cfg = config.load_config(path)
    assert cfg.upstream.discovery is not None
    assert cfg.upstream.discovery.dns == "vllm-engines.llm.svc.cluster.local"
    assert engine_url(cfg.upstream.discovery.scheme, "10.0.0.7", cfg.upstream.discovery.port) == "http://10.0.0.7:8000"
    assert cfg.admission.high_watermark < config.AdmissionConfig().high_watermark, "the pool keeps a margin"
    assert main(["validate", str(path)]) == 0
    path.write_text(path.read_text().replace("interval_s: 5", "interval_s: 0"))
    assert main(["validate", str(path)]) == 1


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_kvgate_accepts_the_shipped_policy_and_args(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    """The policy in each ConfigMap loads with the gateway's own config model, and the args parse."""
    config = pytest.importorskip("gateway.config")
    from gateway.cli import build_parser

    cfg = policy(rendered[overlay])
    if "redis" in cfg and "redis" not in config.GatewayConfig.model_fields:
        pytest.skip("the policy sets redis.url, which gateway.config does not model yet (issue 5)")
    config.parse_config(yaml.safe_dump(cfg), f"{overlay}/kvgate.yaml")
    for w in pod_templates(rendered[overlay]):
        if "kvgate" in containers(w):
            args = build_parser().parse_args(["serve", *containers(w)["kvgate"]["args"]])
            assert args.config == "/etc/kvgate/kvgate.yaml"


def test_policy_loader_rejects_a_bad_policy() -> None:
    """The check above can fail: a watermark inversion is refused with its location."""
    config = pytest.importorskip("gateway.config")
    bad = "admission:\n  high_watermark: 0.5\n  low_watermark: 0.8\n"
    with pytest.raises(config.ConfigError):
        config.parse_config(bad, "bad.yaml")


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_dashboard_configmap_is_loadable(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    docs = rendered[overlay]
    cm = one(docs, "ConfigMap", "kvgate-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = dashboard(docs)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"]
    for p in board["panels"]:
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
    # Panels must not overlap on Grafana's 24-column grid.
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        new = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & new, f"panel {p['title']} overlaps another"
        cells |= new


def test_docs_commands_name_real_paths() -> None:
    """Every deploy/ path and kubectl -k target in docs/deploy.md exists, so copy-paste works."""
    doc = (REPO / "docs" / "deploy.md").read_text()
    paths = set(re.findall(r"(?<![\w/.])(deploy/[\w./-]+[\w])", doc))
    assert {"deploy/overlays/sidecar", "deploy/overlays/standalone"} <= paths
    missing = [p for p in sorted(paths) if not (REPO / p).exists()]
    assert missing == []
    targets = [shlex.split(line)[-1] for line in doc.splitlines() if line.startswith("kubectl") and " -k " in line]
    assert targets
    for target in targets:
        assert target == "my-llm" or (REPO / target / "kustomization.yaml").exists(), target


def test_pool_doc_names_real_paths_and_settings() -> None:
    """docs/pool.md's paths and kubectl -k targets exist, and the settings it quotes are the overlay's."""
    doc = (REPO / "docs" / "pool.md").read_text()
    paths = set(re.findall(r"(?<![\w/.])(deploy/[\w./-]+[\w])", doc))
    assert {"deploy/overlays/pool", "deploy/overlays/sidecar"} <= paths
    assert [p for p in sorted(paths) if not (REPO / p).exists()] == []
    targets = [shlex.split(line)[-1] for line in doc.splitlines() if line.startswith("kubectl") and " -k " in line]
    assert targets and all((REPO / t / "kustomization.yaml").exists() for t in targets)
    cfg = yaml.safe_load((REPO / "deploy" / "overlays" / "pool" / "kvgate.yaml").read_text())
    for quoted in (
        f"dns: {cfg['upstream']['discovery']['dns']}",
        f"high_watermark: {cfg['admission']['high_watermark']}",
        f"scrape_interval_s: {cfg['telemetry']['scrape_interval_s']}",
    ):
        assert quoted in doc, quoted


def test_docs_custom_overlay_example_renders(kubectl: str, deploy_copy: Path) -> None:
    """The "your model" overlay in docs/deploy.md renders and changes what it says it changes."""
    doc = (REPO / "docs" / "deploy.md").read_text()
    m = re.search(r"cat > my-llm/kustomization.yaml <<'EOF'\n(.*?)\nEOF\n", doc, re.S)
    assert m, "the example overlay is missing from docs/deploy.md"
    overlay = deploy_copy.parent / "my-llm"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(m.group(1))
    docs = kustomize(kubectl, overlay)
    engine = one(docs, "Deployment", "vllm")
    assert engine["spec"]["replicas"] == 2
    env = {e["name"]: e.get("value") for e in containers(engine)["vllm"]["env"]}
    assert env["MODEL"] == "meta-llama/Llama-3.1-8B-Instruct" and "HF_TOKEN" in env
    assert containers(engine)["kvgate"]["image"] == "registry.example.com/kvgate:0.1.0"
    assert validation_errors(docs, K8S_VERSIONS[-1]) == []


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_a_policy_edit_restarts_no_engine_and_a_rollout_outlasts_the_engines_start(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    """The policy's ConfigMap name carries a content hash only where no engine pod mounts it (a new name would
    restart every engine: weights loaded again); the engine's rollout deadline outlasts its startup probe (the
    default 10 minutes would fail `rollout status` on a first start that is still downloading weights); no pod
    mounts a Kubernetes API token it never uses."""
    docs = rendered[overlay]
    engine = one(docs, "Deployment", "vllm")
    (workload,) = [w for w in pod_templates(docs) if "kvgate" in containers(w)]
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "kvgate-config"]
    hashed = volume["configMap"]["name"] != "kvgate-config"
    assert hashed == (workload is not engine), volume["configMap"]["name"]
    probe = containers(engine)["vllm"]["startupProbe"]
    startup_s = probe["periodSeconds"] * probe["failureThreshold"] + probe.get("initialDelaySeconds", 0)
    assert engine["spec"]["progressDeadlineSeconds"] > startup_s
    for w in pod_templates(docs):
        assert w["spec"]["template"]["spec"].get("automountServiceAccountToken") is False, w["metadata"]["name"]


def test_the_sidecar_looks_for_the_tokenizer_in_the_engines_hugging_face_cache(
    rendered: dict[str, list[Manifest]],
) -> None:
    """tokenizer auto looks up the served model's files in HF_HOME: the sidecar's must be vLLM's, on the model
    volume both mount at the same path, or every request pays a /tokenize round trip to the engine."""
    pod = one(rendered["sidecar"], "Deployment", "vllm")
    env = {c: {e["name"]: e.get("value") for e in containers(pod)[c].get("env", [])} for c in ("vllm", "kvgate")}
    assert env["kvgate"]["HF_HOME"] == env["vllm"]["HF_HOME"]
    mounts = {c: {m["name"]: m["mountPath"] for m in containers(pod)[c]["volumeMounts"]} for c in ("vllm", "kvgate")}
    assert mounts["kvgate"]["model-cache"] == mounts["vllm"]["model-cache"]
    assert env["kvgate"]["HF_HOME"].startswith(mounts["kvgate"]["model-cache"] + "/")
