"""A model's tokenizer files in the Hugging Face cache, and fetching them into it (only when allowed).

A sidecar that shares vLLM's HF cache sees the very tokenizer vLLM loaded, at no cost. The cache layout is
``models--{org}--{name}/snapshots/{commit}/{file}``, files usually symlinks into ``blobs/``, with
``refs/main`` holding the commit of ``main``. A download writes the same layout, so vLLM, other tools and
kvgate's next start reuse it instead of fetching it again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("kvgate.tokenizer")

DEFAULT_ENDPOINT = "https://huggingface.co"
TOKENIZER_FILE = "tokenizer.json"
# What HFTokenizer.load reads: the tokenizer, its config (chat template, special tokens), the model's config
# (vocab_size) and a chat template kept in its own file. Only the first is required.
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "config.json", "chat_template.jinja")
DOWNLOAD_TIMEOUT_S = 60.0  # the whole download; one stalled read gives up after _READ_TIMEOUT_S
_READ_TIMEOUT_S = 10.0
_MAX_FILE_BYTES = 128 << 20  # tokenizer.json of large-vocabulary models is tens of MB; nothing near this

# Hub repo ids: ``name`` or ``org/name``, no ``--`` or ``..`` (the hub refuses them; they would also break the
# cache's folder names). A path such as ``./model`` or ``/models/x`` never matches.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_ETAG = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # git blob sha1, or the sha256 of an LFS file


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.fullmatch(name)) and "--" not in name and ".." not in name


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where huggingface_hub (and so vLLM) keeps models, as ``huggingface_hub.constants`` works it out:
    HF_HUB_CACHE, else the legacy HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else XDG_CACHE_HOME or
    ~/.cache, then huggingface/hub; with ``~`` and ``$VARS`` expanded."""
    env = os.environ if env is None else env

    def expanded(value: str) -> Path:
        return Path(_expandvars(os.path.expanduser(value), env))

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return expanded(env[name])
    if env.get("HF_HOME"):
        return expanded(env["HF_HOME"]) / "hub"
    base = expanded(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _expandvars(value: str, env: Mapping[str, str]) -> str:
    """``os.path.expandvars`` against ``env`` (unknown variables left as they are, as it does)."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return env.get(name, match.group(0))

    return re.sub(r"\$(?:(\w+)|\{([^}]*)\})", one, value)


def repo_dir(repo_id: str, cache: Path) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def cached_snapshot(repo_id: str, cache: Path | None = None) -> Path | None:
    """The snapshot holding ``repo_id``'s tokenizer.json: the one ``refs/main`` names, else the newest that
    has one (a pinned revision, or a cache filled offline), else None."""
    if not is_repo_id(repo_id):
        return None
    snapshots = repo_dir(repo_id, cache or cache_dir()) / "snapshots"
    try:
        main = (snapshots.parent / "refs" / "main").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        main = ""
    if _COMMIT.fullmatch(main) and (snapshots / main / TOKENIZER_FILE).is_file():
        return snapshots / main
    try:
        found = [d for d in snapshots.iterdir() if (d / TOKENIZER_FILE).is_file()]
    except OSError:
        return None
    return max(found, key=lambda d: (d.stat().st_mtime, d.name), default=None)


class _Refused(Exception):
    """The hub answered, but not with the files: the message says how."""


async def download_tokenizer(
    repo_id: str,
    *,
    cache: Path | None = None,
    env: Mapping[str, str] | None = None,
    revision: str = "main",
    timeout_s: float = DOWNLOAD_TIMEOUT_S,
) -> Path | None:
    """Fetch ``repo_id``'s tokenizer files from ``HF_ENDPOINT`` (with ``HF_TOKEN``, for gated models) into the
    cache, and return their snapshot. Fails soft: any failure is a logged warning and None."""
    import httpx

    env = os.environ if env is None else env
    endpoint = (env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    if env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        log.warning("not downloading the tokenizer of %s: HF_HUB_OFFLINE is set", repo_id)
        return None
    if not is_repo_id(repo_id):
        return None
    headers = {"user-agent": "kvgate"}
    if env.get("HF_TOKEN"):
        headers["authorization"] = f"Bearer {env['HF_TOKEN']}"
    root = repo_dir(repo_id, cache or cache_dir(env))
    try:
        async with (
            asyncio.timeout(timeout_s),
            httpx.AsyncClient(
                headers=headers, follow_redirects=True, timeout=httpx.Timeout(_READ_TIMEOUT_S), trust_env=True
            ) as client,
        ):
            snapshot = await _fetch(client, f"{endpoint}/{repo_id}/resolve", revision, root)
    except (httpx.HTTPError, OSError, TimeoutError, _Refused) as exc:
        log.warning(
            "downloading the tokenizer of %s from %s failed: %s: %s", repo_id, endpoint, type(exc).__name__, exc
        )
        return None
    log.info("downloaded the tokenizer of %s from %s into %s", repo_id, endpoint, snapshot)
    return snapshot


async def _fetch(client: httpx.AsyncClient, base: str, revision: str, root: Path) -> Path:
    """tokenizer.json first (it names the commit: the others are fetched at that commit, so all files agree
    even if ``main`` moves meanwhile); the others may be missing. Bodies are read whole (tens of MB at most),
    then written to disk on a worker thread."""
    commit = ""
    files: dict[str, tuple[bytes, str | None]] = {}
    for name in TOKENIZER_FILES:
        async with client.stream("GET", f"{base}/{quote(commit or revision, safe='')}/{name}") as resp:
            if resp.status_code == 404 and name != TOKENIZER_FILE:
                continue
            if resp.status_code != 200:
                raise _Refused(f"{name}: HTTP {resp.status_code}")
            hub = (resp.history[0] if resp.history else resp).headers  # the hub's own answer, not a CDN's
            if not commit:
                commit = hub.get("x-repo-commit", "").lower()
                if not _COMMIT.fullmatch(commit):
                    raise _Refused("the hub did not name the commit (no X-Repo-Commit header)")
            etag = (hub.get("x-linked-etag") or hub.get("etag") or "").removeprefix("W/").strip('"').lower()
            files[name] = (await _read(resp, name), etag if _ETAG.fullmatch(etag) else None)
    return await asyncio.to_thread(_store, root, revision, commit, files)


async def _read(resp: httpx.Response, name: str) -> bytes:
    body = bytearray()
    async for chunk in resp.aiter_bytes():
        body += chunk
        if len(body) > _MAX_FILE_BYTES:
            raise _Refused(f"{name}: larger than {_MAX_FILE_BYTES} bytes")
    return bytes(body)


def _store(root: Path, revision: str, commit: str, files: Mapping[str, tuple[bytes, str | None]]) -> Path:
    """The layout huggingface_hub writes: each file a blob named by the hub's ETag (else by its sha256),
    linked from ``snapshots/{commit}/``, and ``refs/{revision}`` naming the commit. Every file is written to a
    temporary name and renamed, so a reader (vLLM, another replica) never sees half a file."""
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "blobs").mkdir(exist_ok=True)
    for name, (body, etag) in files.items():
        blob = root / "blobs" / (etag or hashlib.sha256(body).hexdigest())
        _write_atomic(blob, body)
        _link(blob, snapshot / name)
    if revision != commit:
        _write_atomic(root / "refs" / revision, commit.encode())
    return snapshot


def _link(blob: Path, link: Path) -> None:
    """A relative symlink, as huggingface_hub makes (a copy where symlinks are not allowed)."""
    temp = link.with_name(f".{link.name}.{uuid.uuid4().hex}")
    try:
        os.symlink(os.path.relpath(blob, link.parent), temp)
    except OSError:
        shutil.copyfile(blob, temp)
    os.replace(temp, link)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    temp.write_bytes(data)
    os.replace(temp, path)
