"""Where a tokenizer comes from: a bare directory, a hub id in the Hugging Face cache, a download (only when
allowed), and the order ``auto`` tries them in. Tiny tokenizers built here; the "hub" is a local server."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.config import GatewayConfig
from gateway.protocol.requests import parse_request
from gateway.server.app import Gateway
from gateway.tokens import hub
from gateway.tokens.counting import TokenCounter
from gateway.tokens.resolve import build_counter, load_explicit
from gateway.tokens.tokenizers import HeuristicTokenizer, TokenizerUnavailable, load_tokenizer, open_tokenizer
from tests.support.procs import free_port
from tests.support.promtext import parse_metrics

REPO = "tiny-org/tiny-model"
COMMIT = "a" * 40
OLD_COMMIT = "b" * 40
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def tokenizer_json() -> bytes:
    """A word-level tokenizer: 'hello world' is 2 tokens, unknown words are [UNK] (1 each)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str().encode()


def model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_bytes(tokenizer_json())
    return path


def snapshot(cache: Path, repo: str, commit: str, *, main: bool = True, mtime: float | None = None) -> Path:
    """One snapshot in the HF cache layout, its files symlinks into blobs/ as huggingface_hub writes them."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    files = {"tokenizer.json": tokenizer_json(), "tokenizer_config.json": orjson.dumps({"chat_template": TEMPLATE})}
    for name, body in files.items():
        blob = root / "blobs" / hashlib.sha256(body).hexdigest()
        blob.write_bytes(body)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    if main:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / "main").write_text(commit)
    if mtime is not None:
        os.utime(snap, (mtime, mtime))
    return snap


def _contents(directory: Path) -> list[Path]:
    return list(directory.iterdir())


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF cache, and no real hub: HF_ENDPOINT points at a closed port unless a test serves one."""
    path = tmp_path / "hf" / "hub"
    path.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(path))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return path


# --- the cache ----------------------------------------------------------------------------------------


def test_cache_dir_follows_huggingface_hub(tmp_path: Path) -> None:
    assert hub.cache_dir({"HF_HUB_CACHE": "/c", "HF_HOME": "/h"}) == Path("/c")
    assert hub.cache_dir({"HF_HOME": "/h"}) == Path("/h/hub")
    assert hub.cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert hub.cache_dir({}) == Path.home() / ".cache" / "huggingface" / "hub"
    # as huggingface_hub (and so vLLM): the legacy name, and variables inside the value
    assert hub.cache_dir({"HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HOME": "/h"}) == Path("/legacy")
    assert hub.cache_dir({"HF_HUB_CACHE": "/c", "HUGGINGFACE_HUB_CACHE": "/legacy"}) == Path("/c")
    assert hub.cache_dir({"HF_HOME": "$DATA/hf", "DATA": "/data"}) == Path("/data/hf/hub")
    assert hub.cache_dir({"HF_HUB_CACHE": "${DATA}/hub", "DATA": "/d"}) == Path("/d/hub")
    assert hub.cache_dir({"HF_HOME": "$UNSET/hf"}) == Path("$UNSET/hf/hub")


def test_snapshot_named_by_refs_main_wins(cache: Path) -> None:
    main = snapshot(cache, REPO, OLD_COMMIT, mtime=1_000)
    snapshot(cache, REPO, COMMIT, main=False, mtime=2_000)  # newer, but not what main names
    assert hub.cached_snapshot(REPO) == main
    assert (main / "tokenizer.json").is_symlink()


def test_else_the_newest_snapshot_with_a_tokenizer(cache: Path) -> None:
    snapshot(cache, REPO, OLD_COMMIT, main=False, mtime=1_000)
    newest = snapshot(cache, REPO, COMMIT, main=False, mtime=2_000)
    weights_only = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / ("c" * 40)
    weights_only.mkdir()
    os.utime(weights_only, (3_000, 3_000))
    (cache / f"models--{REPO.replace('/', '--')}" / "refs").mkdir()
    (cache / f"models--{REPO.replace('/', '--')}" / "refs" / "main").write_text("c" * 40)  # no tokenizer there
    assert hub.cached_snapshot(REPO) == newest
    assert hub.cached_snapshot("tiny-org/absent") is None
    assert hub.cached_snapshot("../escape") is None


# --- explicit specs -----------------------------------------------------------------------------------


def test_a_bare_directory_or_file_is_a_hf_tokenizer(tmp_path: Path, cache: Path) -> None:
    d = model_dir(tmp_path / "model")
    for spec in (str(d), str(d / "tokenizer.json"), f"hf:{d}"):
        tok, source = open_tokenizer(spec)
        assert source == "path" and tok.name == f"hf:{d / 'tokenizer.json'}"
        assert tok.count("hello world hello") == 3 and tok.exact


def test_a_hub_id_is_found_in_the_cache(cache: Path) -> None:
    snap = snapshot(cache, REPO, COMMIT)
    for spec in (REPO, f"hf:{REPO}"):
        tok, source = open_tokenizer(spec)
        assert source == "hf_cache" and str(snap) in tok.name
        assert tok.count_messages([{"role": "user", "content": "hello there"}]) == 2  # the cached template


def test_an_unresolvable_spec_says_what_to_do(cache: Path) -> None:
    with pytest.raises(TokenizerUnavailable) as err:
        load_tokenizer(REPO)
    assert str(cache) in str(err.value) and "tokenizer_download" in str(err.value)
    for path in ("./no/such/dir", "/no/such/dir", "hf:no-such-dir-or-repo/../x"):
        with pytest.raises(TokenizerUnavailable, match="no Hugging Face tokenizer"):
            load_tokenizer(path)
    with pytest.raises(TokenizerUnavailable, match="unknown tokenizer spec"):
        load_tokenizer("nonsense:spec")


# --- a local hub ----------------------------------------------------------------------------------------


class FakeHub:
    """Serves ``/{repo}/resolve/{revision}/{filename}`` as the hub does: X-Repo-Commit and ETag on every file;
    tokenizer.json redirected to a "CDN" with X-Linked-Etag (an LFS file); chat_template.jinja missing."""

    def __init__(self, *, status: int = 200, commit: str | None = COMMIT) -> None:
        self.status = status
        self.commit = commit
        self.seen: list[tuple[str, str | None]] = []  # (path, authorization)
        self.files = {
            "tokenizer.json": tokenizer_json(),
            "tokenizer_config.json": orjson.dumps({"chat_template": TEMPLATE}),
            "config.json": orjson.dumps({"vocab_size": 64}),
        }

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/{org}/{name}/resolve/{revision}/{filename}", self.resolve)
        app.router.add_get("/cdn/{sha}", self.cdn)
        return app

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.path, request.headers.get("authorization")))
        info = request.match_info
        body = self.files.get(info["filename"])
        if f"{info['org']}/{info['name']}" != REPO or info["revision"] not in ("main", COMMIT) or body is None:
            return web.Response(status=404)
        if self.status != 200:
            return web.Response(status=self.status)
        headers = {"x-repo-commit": self.commit} if self.commit else {}
        sha256 = hashlib.sha256(body).hexdigest()
        if info["filename"] == "tokenizer.json":
            headers |= {"x-linked-etag": f'"{sha256}"', "location": f"/cdn/{sha256}"}
            return web.Response(status=302, headers=headers)
        return web.Response(body=body, headers=headers | {"etag": f'"{hashlib.sha1(body).hexdigest()}"'})

    async def cdn(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.path, request.headers.get("authorization")))
        return web.Response(body=self.files["tokenizer.json"], headers={"etag": '"cdn-etag"'})


Serve = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def _tokenize(request: web.Request) -> web.StreamResponse:
    return web.json_response({"count": 5})


async def engine_with_tokenize(serve: Serve) -> str:
    app = web.Application()
    app.router.add_post("/tokenize", _tokenize)
    return await serve(app)


async def auto(upstream: str, root: str | None, model_id: str | None, **kw: bool) -> TokenCounter:
    async with aiohttp.ClientSession() as session:
        return await build_counter(
            "auto", session=session, upstream=upstream, model_root=root, model_id=model_id, offload_chars=4096, **kw
        )


# --- auto -----------------------------------------------------------------------------------------------


async def test_auto_order_model_dir_then_cache_then_tokenize_then_heuristic(
    tmp_path: Path, cache: Path, serve: Serve
) -> None:
    engine = await engine_with_tokenize(serve)
    d = model_dir(tmp_path / "served")
    snap = snapshot(cache, REPO, COMMIT)
    counter = await auto(engine, str(d), REPO)  # vLLM serving a local directory under a hub-id name
    assert (counter.kind, counter.source) == ("hf", "model_dir") and str(d) in counter.name
    counter = await auto(engine, REPO, REPO)  # vLLM loaded it from the hub: root is the hub id
    assert (counter.kind, counter.source) == ("hf", "hf_cache") and str(snap) in counter.name
    counter = await auto(engine, "/not/visible/here", REPO)  # root unreadable here: the served id
    assert counter.source == "hf_cache"
    counter = await auto(engine, REPO, "alias")  # root first, a --served-model-name alias after
    assert counter.source == "hf_cache"
    counter = await auto(engine, "other-org/uncached", "uncached")
    assert (counter.kind, counter.source, counter.local) == ("vllm", "engine", None)
    counter = await auto(f"http://127.0.0.1:{free_port()}", "other-org/uncached", None)
    assert (counter.kind, counter.source) == ("heuristic", "builtin")


async def test_auto_asks_a_keyed_engines_tokenize_with_its_key(serve: Serve) -> None:
    """An engine behind a key (a proxy, or a vLLM that guards /tokenize) is found, and counted with, its key."""
    seen: list[str | None] = []

    async def guarded(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("authorization"))
        if request.headers.get("authorization") != "Bearer engine-secret":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response({"count": 5})

    app = web.Application()
    app.router.add_post("/tokenize", guarded)
    engine = await serve(app)
    assert (await auto(engine, "other-org/uncached", None)).source == "builtin"
    async with aiohttp.ClientSession() as session:
        counter = await build_counter(
            "auto",
            session=session,
            upstream=engine,
            model_root=None,
            model_id=None,
            offload_chars=4096,
            api_key="engine-secret",
        )
        assert counter.source == "engine"
        assert await counter.count(parse_request("completions", b'{"prompt": "hi"}')) == (5,)
    assert seen == [None, "Bearer engine-secret", "Bearer engine-secret"]


async def test_auto_skips_a_broken_cached_tokenizer(cache: Path, serve: Serve) -> None:
    snap = snapshot(cache, REPO, COMMIT)
    (snap / "tokenizer.json").unlink()
    (snap / "tokenizer.json").write_text("{not json")
    counter = await auto(await engine_with_tokenize(serve), REPO, REPO)
    assert counter.source == "engine"


async def test_download_is_off_by_default(cache: Path, serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", await serve(fake.app()))
    assert GatewayConfig().tokenizer_download is False
    counter = await auto(await engine_with_tokenize(serve), REPO, REPO)
    assert counter.source == "engine"
    with pytest.raises(TokenizerUnavailable, match="tokenizer_download"):
        await load_explicit(REPO, download=False)
    assert fake.seen == [] and not _contents(cache)


async def test_download_writes_the_hf_cache_layout(cache: Path, serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", await serve(fake.app()))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    counter = await auto(f"http://127.0.0.1:{free_port()}", REPO, REPO, download=True)
    assert (counter.kind, counter.source) == ("hf", "hf_download")
    assert counter.local is not None and counter.local.vocab_size == 64  # config.json came along
    base = f"/{REPO}/resolve"
    assert [p for p, _ in fake.seen] == [
        f"{base}/main/tokenizer.json",
        f"/cdn/{hashlib.sha256(fake.files['tokenizer.json']).hexdigest()}",
        f"{base}/{COMMIT}/tokenizer_config.json",  # the rest at the commit main named
        f"{base}/{COMMIT}/config.json",
        f"{base}/{COMMIT}/chat_template.jinja",
    ]
    assert all(auth == "Bearer hf_secret" for p, auth in fake.seen if "/resolve/" in p)
    root = cache / f"models--{REPO.replace('/', '--')}"
    assert (root / "refs" / "main").read_text() == COMMIT
    snap = root / "snapshots" / COMMIT
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    sha256 = hashlib.sha256(fake.files["tokenizer.json"]).hexdigest()
    assert (snap / "tokenizer.json").is_symlink() and (snap / "tokenizer.json").resolve() == root / "blobs" / sha256
    config_sha1 = hashlib.sha1(fake.files["config.json"]).hexdigest()  # named by the hub's ETag, as hf_hub does
    assert (snap / "config.json").resolve() == root / "blobs" / config_sha1
    assert not [p for p in (root / "blobs").iterdir() if p.name.endswith(".incomplete")]
    # the next start (and vLLM) finds it in the cache: nothing fetched again
    fake.seen.clear()
    tok, source = open_tokenizer(REPO)
    assert source == "hf_cache" and tok.count_messages([{"role": "user", "content": "hello world"}]) == 2
    assert (await load_explicit(REPO, download=True))[1] == "hf_cache" and fake.seen == []


async def test_an_explicit_hub_id_is_downloaded_when_allowed(
    cache: Path, serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", await serve(FakeHub().app()))
    tok, source = await load_explicit(REPO, download=True)
    assert source == "hf_download" and tok.count("hello world") == 2


@pytest.mark.parametrize(
    "fake", [FakeHub(status=401), FakeHub(commit=None)], ids=["gated-without-token", "no-commit-header"]
)
async def test_a_failed_download_fails_soft(
    cache: Path, serve: Serve, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fake: FakeHub
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", await serve(fake.app()))
    with caplog.at_level(logging.WARNING, logger="kvgate.tokenizer"):
        counter = await auto(await engine_with_tokenize(serve), REPO, REPO, download=True)
    assert counter.source == "engine" and fake.seen
    assert any("downloading the tokenizer of" in r.getMessage() for r in caplog.records)
    with pytest.raises(TokenizerUnavailable, match="Downloading it failed"):
        await load_explicit(REPO, download=True)
    assert not (cache / f"models--{REPO.replace('/', '--')}" / "snapshots").exists()


async def test_an_unreachable_hub_fails_soft(cache: Path) -> None:
    assert await hub.download_tokenizer(REPO, timeout_s=5) is None  # HF_ENDPOINT: a closed port


# --- what the gateway exports ---------------------------------------------------------------------------


async def test_the_choice_is_exported(serve: Serve) -> None:
    engine = await engine_with_tokenize(serve)
    config = GatewayConfig.model_validate({"upstream": {"url": engine}, "tokenizer": "vllm"})
    gw = Gateway(config)
    try:
        assert 'kvgate_tokenizer_info{kind="heuristic",source="pending"} 1.0' in gw.metrics.render().decode()
        await gw._resolve_tokenizer()
        request = parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": "hi"}]}))
        for _ in range(3):
            assert await gw.costs.counter.count(request) == (5,)
        scraped = parse_metrics(gw.metrics.render().decode())
        assert scraped["kvgate_tokenizer_info{kind=vllm,source=engine}"] == 1
        assert "kvgate_tokenizer_info{kind=heuristic,source=pending}" not in scraped
        assert scraped["kvgate_tokenize_cache_lookups_total{result=hit}"] == 2
        assert scraped["kvgate_tokenize_cache_lookups_total{result=miss}"] == 1
    finally:
        await gw.shutdown()


async def test_auto_asks_again_after_settling_for_the_heuristic(
    serve: Serve, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto probes the engine's /tokenize once; a probe that failed (the engine busy starting) left the inexact
    heuristic for the life of the process. It is asked again a few times, and takes /tokenize once it answers."""
    answers = [500, 500]

    async def tokenize(request: web.Request) -> web.StreamResponse:
        if answers:
            return web.Response(status=answers.pop(0))
        return await _tokenize(request)

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    engine = await serve(app)
    monkeypatch.setattr("gateway.server.app.AUTO_RETRY_DELAYS_S", (0.01, 0.01, 0.01))
    gw = Gateway(GatewayConfig.model_validate({"upstream": {"url": engine}, "tokenizer": "auto"}))
    try:
        await gw._on_model(gw.pool.model)
        assert gw.costs.counter.source == "builtin"
        retry = gw._auto_retry
        assert retry is not None
        await retry
        assert gw.costs.counter.source == "engine" and answers == [] and gw._auto_retry is None
    finally:
        await gw.shutdown()


async def test_of_two_overlapping_tokenizer_choices_the_later_one_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    """An auto retry still probing /tokenize while the engine's model changes (and auto chooses again): the
    retry finishing last must not put the heuristic back over the newer choice. A choice of the same tokenizer
    keeps what was learned of it (the count agreement)."""
    release_first = asyncio.Event()
    made: list[TokenCounter] = []

    async def build(spec: str, **kw: object) -> TokenCounter:
        counter = TokenCounter(HeuristicTokenizer() if not made else load_tokenizer("heuristic:3"))
        counter.source = "builtin" if not made else "engine"
        made.append(counter)
        if len(made) == 1:
            await release_first.wait()  # the stale retry: its probe answers late
        return counter

    monkeypatch.setattr("gateway.server.app.build_counter", build)
    gw = Gateway(GatewayConfig())
    try:
        stale = asyncio.create_task(gw._resolve_tokenizer())
        await asyncio.sleep(0)
        await gw._resolve_tokenizer()  # begun later, answers first
        release_first.set()
        await stale
        assert gw.costs.counter is made[1]
        agreement = gw.costs.agreement
        await gw._resolve_tokenizer()  # the same tokenizer again (a re-read of /v1/models)
        assert gw.costs.counter is made[2] and gw.costs.agreement is agreement
    finally:
        await gw.shutdown()
