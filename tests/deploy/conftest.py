"""Fixtures for the deployment tests: the overlays are rendered once per session."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_support import DEPLOY, OVERLAYS, Manifest, kustomize, require_tool


@pytest.fixture(scope="session")
def kubectl() -> str:
    return require_tool("kubectl")


@pytest.fixture(scope="session")
def rendered(kubectl: str) -> dict[str, list[Manifest]]:
    """Every overlay rendered once: rendering costs a process start, the tests only read the result."""
    return {name: kustomize(kubectl, path) for name, path in OVERLAYS.items()}


@pytest.fixture
def deploy_copy(tmp_path: Path) -> Iterator[Path]:
    """A scratch copy of deploy/ to break on purpose, proving a validator can fail."""
    target = tmp_path / "deploy"
    shutil.copytree(DEPLOY, target)
    yield target
