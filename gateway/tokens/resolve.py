"""Choosing the token counter at start-up: an explicit ``--tokenizer`` spec, or the best ``auto`` can find.

``auto`` prefers a local tokenizer (exact, and no round trip per request) to the engine's ``/tokenize``, and
that to the heuristic. The choice decides how exact admission is, so it is logged and exported
(``kvgate_tokenizer_info{kind, source}``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp
import orjson

from gateway.tokens import hub
from gateway.tokens.count_cache import CountCache
from gateway.tokens.counting import TOKENIZE_TIMEOUT_S, TokenCounter, engine_headers
from gateway.tokens.tokenizers import (
    HeuristicTokenizer,
    HFTokenizer,
    LocalTokenizer,
    TokenizerUnavailable,
    open_tokenizer,
)

log = logging.getLogger("kvgate.counting")

Choice = tuple[LocalTokenizer | None, str]  # (None: the engine's /tokenize), source


async def build_counter(
    spec: str,
    *,
    session: aiohttp.ClientSession,
    upstream: str,
    model_root: str | None,
    offload_chars: int,
    model_id: str | None = None,
    api_key: str | None = None,
    download: bool = False,
    tokenize_timeout_s: float = TOKENIZE_TIMEOUT_S,
    cache: CountCache | None = None,
    tokenize_at: Callable[[], str] | None = None,
) -> TokenCounter:
    """The counter for ``spec``. An explicit spec that cannot be loaded raises :class:`TokenizerUnavailable`
    (start-up stops); ``auto`` always finds one (see :func:`choose_auto`). ``api_key`` is the engine's, for
    /tokenize; ``tokenize_at`` says which engine's /tokenize to call at each count (in a pool: one that takes
    requests now), else ``upstream``'s."""
    if spec == "vllm":
        choice: Choice = (None, "engine")
    elif spec == "auto":
        choice = await choose_auto(session, upstream, model_root, model_id, download=download, api_key=api_key)
    else:
        choice = await load_explicit(spec, download=download)
    return TokenCounter(
        choice[0],
        session=session,
        upstream=tokenize_at or upstream,
        api_key=api_key,
        offload_chars=offload_chars,
        tokenize_timeout_s=tokenize_timeout_s,
        cache=cache,
        source=choice[1],
    )


async def load_explicit(
    spec: str, *, download: bool, env: Mapping[str, str] | None = None
) -> tuple[LocalTokenizer, str]:
    """Any spec but ``auto`` and ``vllm``; a hub id missing from the cache is downloaded if allowed."""
    try:
        return open_tokenizer(spec)
    except TokenizerUnavailable as exc:
        repo = _repo_of(spec)
        if not download or repo is None:
            raise
        snapshot = await hub.download_tokenizer(repo, env=env)
        if snapshot is None:
            raise TokenizerUnavailable(f"{exc}\nDownloading it failed too (see the warning above).") from None
        return HFTokenizer.load(str(snapshot)), "hf_download"


def _repo_of(spec: str) -> str | None:
    """The hub id a spec names (bare or after ``hf:``), unless it is a path that exists. A repo id has no
    ':', so ``tiktoken:...`` and ``heuristic:...`` never name one."""
    repo = spec.removeprefix("hf:")
    return repo if hub.is_repo_id(repo) and not Path(repo).exists() else None


async def choose_auto(
    session: aiohttp.ClientSession,
    upstream: str,
    model_root: str | None,
    model_id: str | None,
    *,
    download: bool,
    env: Mapping[str, str] | None = None,
    api_key: str | None = None,
) -> Choice:
    """In order: (a) the served model's own directory (``root`` in /v1/models is a path a sidecar sharing the
    model volume can read); (b) the Hugging Face cache a sidecar shares with vLLM, by ``root`` then ``id``
    (root is what vLLM loaded; id may be a --served-model-name alias); (c) only if ``download``, the hub;
    (d) the engine's /tokenize; (e) the ~4 chars/token heuristic."""
    if model_root and (Path(model_root) / hub.TOKENIZER_FILE).is_file():
        local = _try_load(model_root, "the served model's tokenizer")
        if local is not None:
            return local, "model_dir"
    repos = list(dict.fromkeys(r for r in (model_root, model_id) if r and hub.is_repo_id(r)))
    cache = hub.cache_dir(env)
    for repo in repos:
        snapshot = hub.cached_snapshot(repo, cache)
        local = _try_load(str(snapshot), f"{repo} in the Hugging Face cache") if snapshot else None
        if local is not None:
            return local, "hf_cache"
    for repo in repos if download else ():
        snapshot = await hub.download_tokenizer(repo, cache=cache, env=env)
        local = _try_load(str(snapshot), f"{repo} from the hub") if snapshot else None
        if local is not None:
            return local, "hf_download"
    if await _tokenize_endpoint_works(session, upstream, api_key):
        log.info("tokenizer auto: using the engine's /tokenize at %s (exact, one extra round trip)", upstream)
        return None, "engine"
    log.warning(
        "tokenizer auto: no local tokenizer and no /tokenize on the upstream; using the ~4 chars/token "
        "heuristic (inexact). Pass --tokenizer /path/to/model (or its hub id) for exact admission."
    )
    return HeuristicTokenizer(), "builtin"


def _try_load(path: str, what: str) -> LocalTokenizer | None:
    try:
        local = HFTokenizer.load(path)
    except TokenizerUnavailable as exc:
        log.warning("tokenizer auto: %s", exc)
        return None
    log.info("tokenizer auto: using %s at %s (exact)", what, path)
    return local


async def _tokenize_endpoint_works(session: aiohttp.ClientSession, upstream: str, api_key: str | None) -> bool:
    try:
        async with session.post(
            f"{upstream.rstrip('/')}/tokenize",
            data=orjson.dumps({"prompt": "hello"}),
            headers={"content-type": "application/json", **engine_headers(api_key)},
            timeout=aiohttp.ClientTimeout(total=5),
        ) as resp:
            return resp.status == 200 and "count" in orjson.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError, ValueError, TypeError):
        return False
