"""The Dockerfile is lint-clean and would build: with no Docker engine here, check what a build depends on.

hadolint lints it; the rest checks the things a build or a ``docker run`` would find out late: a COPY source
that is missing or excluded by .dockerignore, a command line kvgate does not accept, a HEALTHCHECK that
passes on a failing server, or a root user.
"""

from __future__ import annotations

import fnmatch
import http.server
import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_support import REPO, require_tool

DOCKERFILE = REPO / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        result.append((keyword.upper(), args.strip()))
    return result


def final_stage(steps: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    return steps[last_from:]


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides; '!' re-includes."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        regex_pats = [pat]
        if pat.startswith("**/"):
            regex_pats.append(pat[3:])
        for cand in candidates:
            if any(_match(p, cand) for p in regex_pats):
                excluded = not negate
                break
    return excluded


def _match(pattern: str, path: str) -> bool:
    # fnmatch's '*' crosses '/', Docker's does not (except '**'): compare segment by segment.
    if "**" in pattern:
        return fnmatch.fnmatchcase(path, pattern.replace("**/", "*"))
    p_parts, parts = pattern.split("/"), path.split("/")
    return len(p_parts) == len(parts) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, p_parts, strict=True))


def ignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def test_hadolint_is_clean() -> None:
    hadolint = require_tool("hadolint")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    """hadolint really lints: an unpinned base, apt without pins and a root user are reported."""
    hadolint = require_tool("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y curl\nCMD python -m gateway\n")
    proc = subprocess.run([hadolint, str(bad)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert "DL3006" in proc.stdout and "DL3008" in proc.stdout


def test_dockerignore_semantics() -> None:
    patterns = ["*", "!gateway/", "!README.md", "**/__pycache__"]
    assert not dockerignore_excludes(patterns, "gateway/cli.py")
    assert dockerignore_excludes(patterns, "gateway/__pycache__/cli.cpython-311.pyc")
    assert dockerignore_excludes(patterns, "tests/deploy/conftest.py")
    assert not dockerignore_excludes(patterns, "README.md")


def test_copy_sources_exist_and_are_in_the_build_context() -> None:
    steps = instructions(DOCKERFILE.read_text())
    patterns = ignore_patterns()
    copies = [args for k, args in steps if k == "COPY" and "--from=" not in args]
    assert copies
    for args in copies:
        *sources, _dest = shlex.split(args)
        for src in sources:
            path = REPO / src
            assert path.exists(), f"COPY {src}: not in the repository"
            files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
            assert files, f"COPY {src}: nothing to copy"
            for f in files:
                rel = f.relative_to(REPO).as_posix()
                if "__pycache__" not in rel:
                    assert not dockerignore_excludes(patterns, rel), f"{rel} is excluded by .dockerignore"
    # The context stays small: tests, git history and virtualenvs never go to the daemon.
    for rel in ("tests/deploy/conftest.py", ".git/HEAD", ".venv/bin/python", "loadtests/x.py"):
        assert dockerignore_excludes(patterns, rel), rel


def test_runtime_stage_is_non_root_multi_stage_and_runs_kvgate_serve() -> None:
    steps = instructions(DOCKERFILE.read_text())
    assert sum(k == "FROM" for k, _ in steps) >= 2, "multi-stage: build tools stay out of the runtime image"
    final = final_stage(steps)
    bases = [a for k, a in steps if k == "FROM"]
    assert all("slim" in b or "${" in b for b in bases)
    assert "slim" in next(a for k, a in steps if k == "ARG" and a.startswith("PYTHON_IMAGE="))
    users = [a for k, a in final if k == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    assert not any(k == "RUN" and ("[test]" in a or "pip install" in a) for k, a in final)
    entrypoint = json.loads(next(a for k, a in final if k == "ENTRYPOINT"))
    cmd = json.loads(next(a for k, a in final if k == "CMD"))
    assert entrypoint[:2] == ["/bin/sh", "-c"] and entrypoint[2].startswith("exec kvgate serve ")
    assert cmd == ["--config", "/etc/kvgate/kvgate.yaml"]


def run_entrypoint(tmp_path: Path, env: dict[str, str], args: list[str]) -> tuple[list[str], int, int]:
    """Run the image's ENTRYPOINT shell line with a stand-in `kvgate` that reports its argv and pid."""
    final = final_stage(instructions(DOCKERFILE.read_text()))
    entrypoint = json.loads(next(a for k, a in final if k == "ENTRYPOINT"))
    fake = tmp_path / "kvgate"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps([sys.argv[1:], os.getpid()]))\n")
    fake.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    proc = subprocess.Popen(
        ["sh", *entrypoint[1:], *args],
        env={**clean, **env, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = proc.communicate(timeout=30)
    argv, pid = json.loads(out)
    return argv, pid, proc.pid


def test_entrypoint_maps_environment_to_flags(tmp_path: Path) -> None:
    """File < KVGATE_* variables < docker run flags; values keep their spaces; kvgate replaces the shell."""
    cmd = ["--config", "/etc/kvgate/kvgate.yaml"]
    argv, pid, shell_pid = run_entrypoint(tmp_path, {}, cmd)
    assert argv == ["serve", *cmd]
    assert pid == shell_pid, "sh must exec kvgate, or SIGTERM would stop at the shell"
    env = {
        "KVGATE_UPSTREAM": "http://vllm:8000",
        "KVGATE_PORT": "9000",
        "KVGATE_CONTROL_PORT": "9090",
        "KVGATE_TOKENIZER": "heuristic:3.5",
        "KVGATE_LOG_LEVEL": "debug",
    }
    argv, _, _ = run_entrypoint(tmp_path, env, [*cmd, "--upstream", "http://other host:1"])
    cli = pytest.importorskip("gateway.cli")
    serve = pytest.importorskip("gateway.server.serve")
    parsed = cli.build_parser().parse_args(argv)
    assert parsed.command == "serve" and parsed.config == "/etc/kvgate/kvgate.yaml"
    assert (parsed.port, parsed.tokenizer, parsed.log_level) == (9000, "heuristic:3.5", "debug")
    # KVGATE_UPSTREAM is kvgate's own to read (--upstream repeats into a pool, so a mapped flag could not be
    # replaced by a later one): a flag beats it, and without a flag it is the upstream, or a pool of them
    parsed.config = None  # the file is the image's; its absence changes nothing here
    assert serve.build_config(parsed).listen.control_port == 9090
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        m.setenv("KVGATE_UPSTREAM", "http://vllm:8000")
        assert serve.build_config(parsed).upstream.static_urls() == ["http://other host:1"]
        parsed.upstream = None
        assert serve.build_config(parsed).upstream.static_urls() == ["http://vllm:8000"]
        m.setenv("KVGATE_UPSTREAM", "http://a:8000, http://b:8000")
        assert serve.build_config(parsed).upstream.static_urls() == ["http://a:8000", "http://b:8000"]


def healthcheck_argv() -> list[str]:
    final = final_stage(instructions(DOCKERFILE.read_text()))
    args = next(a for k, a in final if k == "HEALTHCHECK")
    argv: list[str] = json.loads(args[args.index("CMD") + 3 :].strip())
    assert argv[0] == "python" and "/healthz" in argv[-1]
    return [sys.executable, *argv[1:]]


class _Handler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_healthcheck(port: int, control_port: int | None = None) -> int:
    env = {**os.environ, "KVGATE_PORT": str(port)}
    if control_port is not None:
        env["KVGATE_CONTROL_PORT"] = str(control_port)
    return subprocess.run(healthcheck_argv(), env=env, capture_output=True, timeout=30, check=False).returncode


def test_healthcheck_passes_on_200_and_fails_otherwise(health_server: http.server.HTTPServer) -> None:
    port = health_server.server_address[1]
    _Handler.status = 200
    assert run_healthcheck(port) == 0
    # with a control port, /healthz is there (and 404 on the client port): the check asks the control port
    assert run_healthcheck(free_port(), control_port=port) == 0
    assert run_healthcheck(port, control_port=free_port()) != 0
    _Handler.status = 503
    assert run_healthcheck(port) != 0
    health_server.shutdown()
    health_server.server_close()
    assert run_healthcheck(port) != 0, "nothing listening must fail the check"
