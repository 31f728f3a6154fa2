"""Configuration: pydantic models, YAML loading with error locations, and flag overrides.

One file configures a gateway. ``kvgate validate FILE`` reports each problem as ``file:line:col: path:
message`` so an operator can fix a ConfigMap without starting the server.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.paths import CONTROL_PATHS, GENERATION, READ_ONLY, is_canonical


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DiscoveryConfig(_Model):
    """Engines found by DNS: every address of ``dns`` is one vLLM engine (a Kubernetes headless Service
    resolves to its ready pods), re-resolved every ``interval_s``; engines come and go with the answer."""

    dns: str = Field(description="Host name to resolve, e.g. vllm-engines.default.svc.cluster.local")
    port: int = Field(8000, ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    interval_s: float = Field(5.0, gt=0)


class UpstreamConfig(_Model):
    """The engines: ``url`` (a pool of one, the sidecar layout), or ``urls`` (a static pool), or
    ``discovery`` (a pool found by DNS). One of them is used, in the reverse order."""

    url: str = "http://127.0.0.1:8000"
    urls: list[str] = Field(default_factory=list, description="A static pool of engines; replaces url when set.")
    discovery: DiscoveryConfig | None = None

    def static_urls(self) -> list[str]:
        """The engines known without asking DNS."""
        return [u.rstrip("/") for u in (self.urls or [self.url])]

    @model_validator(mode="after")
    def _urls_are_http(self) -> UpstreamConfig:
        for url in [self.url, *self.urls]:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"upstream: {url!r} is not an engine URL: use http(s)://host:port")
        return self

    connect_timeout_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest silence from the engine: until the response head arrives (time to first byte) and "
        "between two body chunks. Not a cap on a stream's total length.",
    )
    api_key: str | None = Field(
        None,
        description="The engine's --api-key: sent upstream instead of the client's Authorization, and on kvgate's "
        "own calls (/v1/models, /tokenize).",
    )
    priority_scheduling: bool = Field(
        False,
        description="The engines run vLLM with --scheduling-policy priority: each generation carries its "
        "tenant's class as vLLM's request priority (X-Vllm-Priority: critical -1, standard 0, sheddable 1; read "
        "by vLLM on chat, completions, responses and messages, not on pooling and scoring routes), so the "
        "engine's own queue and preemptions follow the classes kvgate admits by. Leave off for FCFS engines.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="The engines' --stream-interval: tokens vLLM batches into each streamed event (a request "
        "may ask for more). kvgate counts a stream's progress, and what it bills without usage, from its events.",
    )
    max_connections: int = Field(1024, ge=1)
    max_response_header_bytes: int = Field(
        64 * 1024, ge=1024, description="An engine response whose head is larger is answered 502."
    )


class ListenConfig(_Model):
    """The client side of the server: where it listens and what a connection may cost it."""

    host: str = "0.0.0.0"
    port: int = Field(8080, ge=1, le=65535)
    control_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve /healthz, /readyz and /metrics on this port (same host), and only them; the client "
        "port then answers them 404. For a client port reachable from outside the cluster: /readyz names the "
        "engines' addresses and /metrics the tenants, so probes and Prometheus use this port instead.",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="A connection must send a request's whole head within this long (slowloris)."
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest silence while a request body is being received, or while a client takes nothing "
        "of its response (then it is cut off).",
    )
    keepalive_timeout_s: float = Field(30.0, gt=0, description="An idle keep-alive connection is closed after this.")
    readiness: Literal["engine", "gateway"] = Field(
        "engine",
        description="engine: /readyz is 503 while the engines' metrics are stale (a sidecar: the Service routes "
        "around the pod whose engine is down). gateway: /readyz is 200 once the engines have been seen, whether "
        "they are fresh now or not (a tier of gateways in front of shared engines: while an engine restarts, "
        "clients hear 503 with Retry-After from kvgate instead of finding no endpoint at all).",
    )
    max_connections: int = Field(
        4096, ge=1, description="Connections (and requests) served at once; beyond it new ones get 503."
    )
    arrivals_per_tick: int = Field(
        8,
        ge=1,
        description="Requests parsed and priced per event-loop iteration; more wait for the next, in order, "
        "so a burst does not hold back the connects and writes of requests already admitted.",
    )

    @model_validator(mode="after")
    def _ports_differ(self) -> ListenConfig:
        if self.control_port == self.port:
            raise ValueError(f"listen.control_port: {self.control_port} is the client port too")
        return self


class ModelConfig(_Model):
    """Overrides for what the gateway otherwise learns from the upstream's /metrics and /v1/models."""

    max_model_len: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    num_gpu_blocks: int | None = Field(None, ge=1)


class OutputEstimateConfig(_Model):
    """Reserve what requests will most likely produce instead of their cap (see README: How much kvgate
    reserves, and why)."""

    enabled: bool = Field(
        True,
        description="Reserve prompt + the quantile of learned output lengths (capped by max_tokens) instead of the "
        "whole budget; a request that outruns it grows its reservation as it streams.",
    )
    quantile: float = Field(
        0.7,
        gt=0,
        le=1,
        description="The quantile reserved per request while the engine stays healthy. Per request it is well "
        "above the median; summed over the dozens of requests a batch holds it is above their mean, so the "
        "sum stays under the pool while the growth of the few long ones is covered as they stream.",
    )
    prior_tokens: int | None = Field(
        None,
        ge=1,
        description="Output tokens per sequence expected while nothing has been learned yet (cold start); "
        "unset: the whole budget until min_samples requests have finished.",
    )
    min_samples: int = Field(32, ge=1, description="Finished requests a key needs before it is trusted.")
    window: int = Field(512, ge=16, description="Latest finished requests remembered per key.")
    relax_after_s: float = Field(
        30.0, gt=0, description="After a preemption or an overshoot, one step back down per this long of calm."
    )


class PrefixAffinityConfig(_Model):
    """In a pool, send a request whose prompt starts like an earlier one's to the engine that took that one, so
    vLLM's prefix cache hits there (docs/pool.md); a tie-breaker that never overrides safety."""

    enabled: bool = Field(True, description="Place by prompt prefix when it costs little headroom (pools only).")
    max_headroom_cost: float = Field(
        0.05,
        ge=0,
        le=1,
        description="The affine engine is taken only while its projected KV usage after the request is at most "
        "this much above the best engine's: the imbalance affinity may cause.",
    )
    chunk_bytes: int = Field(
        256, ge=16, description="Prompt bytes per hashed chunk (~64 tokens of English: a few KV blocks)."
    )
    max_chunks: int = Field(64, ge=1, description="Leading chunks hashed per request (64 x 256 B: 16 KiB).")
    max_entries: int = Field(65536, ge=1, description="Chunk hashes remembered, least recently used dropped first.")


class AdmissionConfig(_Model):
    high_watermark: float = Field(0.90, gt=0, le=1)
    low_watermark: float = Field(0.80, gt=0, le=1)
    queue_max_length: int = Field(1024, ge=0)
    queue_max_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Request bodies held by requests in the admission queue, in bytes; beyond it new arrivals "
        "get 429 queue_full.",
    )
    queue_max_wait_s: float = Field(
        120.0,
        gt=0,
        description="Wait budget of a request whose client did not send one (x-kvgate-max-wait-s, or the OpenAI "
        "SDKs' x-stainless-read-timeout) and whose tenant sets none; long enough for a burst the engine clears "
        "in a minute or two, and a request that could not make it is refused early anyway.",
    )
    stale_after_s: float = Field(2.0, gt=0, description="A metrics sample older than this is stale.")
    stale_policy: Literal["ledger", "hold"] = Field(
        "ledger",
        description="ledger: admit against the gateway's own reservations under stale_ledger_cap, where they "
        "bound the engine (exclusive_upstream, the engine seen at least once, the other replicas' claims known, "
        "and not last seen full with requests of ours in; else as hold); hold: admit nothing until metrics are "
        "fresh (queued requests time out with 503).",
    )
    stale_ledger_cap: float = Field(
        0.75,
        gt=0,
        le=1,
        description="The most the ledger may fill the engine to while its metrics are stale (stale_policy ledger); "
        "never above high_watermark (a lower watermark lowers the default with it).",
    )
    exclusive_upstream: bool = Field(
        True,
        description="All traffic to the engine goes through this gateway (sidecar), or through this gateway's "
        "replicas sharing their engine books in Redis (redis.share_engine_reservations): the ledgers then bound "
        "usage from above (prompts priced without the tokenizer: in sum over the requests in flight), which lets "
        "the gateway admit as soon as a request ends instead of a scrape later; what a sample shows beyond all "
        "that was reserved while it was taken still counts. Replicas whose shared books cannot answer (Redis "
        "down) go by the engine's samples meanwhile.",
    )
    growth_model: Literal["lockstep", "worst_case"] = Field(
        "lockstep",
        description="How in-flight requests are expected to grow. lockstep: every decoding request adds one token "
        "per engine step (continuous batching) and frees its blocks when done, so the projection is the peak of "
        "that schedule; worst_case: every request holds its whole reservation at once (safe even if decoding "
        "stalls unevenly, but leaves the engine well below the watermark).",
    )

    output_estimate: OutputEstimateConfig = OutputEstimateConfig()
    prefix_affinity: PrefixAffinityConfig = PrefixAffinityConfig()

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> AdmissionConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError("low_watermark must be below high_watermark")
        if "stale_ledger_cap" in self.model_fields_set and self.stale_ledger_cap > self.high_watermark:
            raise ValueError(
                "stale_ledger_cap must be at most high_watermark: without fresh metrics kvgate would admit more than "
                "with them"
            )
        return self


class TelemetryConfig(_Model):
    scrape_interval_s: float = Field(0.25, gt=0, le=60)
    scrape_timeout_s: float = Field(1.0, gt=0)


class RequestLimitsConfig(_Model):
    """Limits on one request from a client (the `limits:` section): body size, when to tokenize off the loop."""

    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    offload_tokenize_chars: int = Field(
        4096, ge=0, description="Prompts longer than this are tokenized on a worker thread."
    )


PriorityClass = Literal["critical", "standard", "sheddable"]


class TenantLimits(_Model):
    """The limits one tenant runs under; every field may also be overridden per model."""

    requests_per_minute: int | None = Field(None, ge=1, description="Requests per minute (token bucket).")
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="Prompt plus reserved output tokens per minute: pre-charged at admission, settled against "
        "the response's usage, refunded when the client leaves before the first token.",
    )
    max_concurrent: int | None = Field(None, ge=1, description="Requests admitted and not yet finished.")
    max_queued: int | None = Field(None, ge=0, description="Requests waiting (for a slot or for KV capacity).")
    max_queue_wait_s: float | None = Field(
        None, gt=0, description="Longest wait before a 503 queue_timeout (default: admission.queue_max_wait_s)."
    )
    priority: PriorityClass | None = Field(
        None, description="critical > standard > sheddable: strict priority; sheddable is shed first."
    )
    weight: float | None = Field(None, gt=0, description="Fair-share weight among tenants of the same class.")


class TenantConfig(TenantLimits):
    name: str = Field(min_length=1)
    api_keys: list[str] = Field(default_factory=list, description="Plain keys or 'sha256:<hex>'.")
    priority: PriorityClass | None = Field(
        "standard", description="critical > standard > sheddable: strict priority; sheddable is shed first."
    )
    weight: float | None = Field(1.0, gt=0, description="Fair-share weight among tenants of the same class.")
    models: dict[str, TenantLimits] = Field(
        default_factory=dict,
        description="Per-model overrides (by the request's 'model'); an overridden model gets its own counters.",
    )

    @model_validator(mode="after")
    def _keys_well_formed(self) -> TenantConfig:
        for key in self.api_keys:
            check_api_key(key)
        return self


def check_api_key(key: str) -> None:
    """A key a client can send: ``sha256:`` and 64 hex digits, or printable text without whitespace at either end
    (the Authorization header's token is read without it: such a key never matches)."""
    if key.startswith("sha256:"):
        digest = key.removeprefix("sha256:")
        if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
            raise ValueError("a 'sha256:' key must be followed by 64 hex digits")
    elif not key or not key.isprintable() or key != key.strip():
        raise ValueError("an API key must be printable, without whitespace at either end (no client could send it)")


class AuthConfig(_Model):
    require_api_key: bool = Field(False, description="401 for requests without a known key.")
    default_tenant: str = Field("default", description="Tenant of anonymous traffic (when keys are optional).")
    isolate_prefix_cache: bool = Field(
        False,
        description="Each tenant's generations reach the engine with a cache_salt of its own: no tenant shares "
        "cached prompt blocks with another (nor can time whether another's prefix is cached). Costs the hits "
        "tenants would have had on each other's prefixes (a common system prompt).",
    )


class RedisConfig(_Model):
    """Shared rate-limit counters and concurrency slots, so N replicas enforce one global limit."""

    url: str | None = Field(None, description="redis://host:port/db; unset = everything stays in-process.")
    key_prefix: str = "kvgate"
    timeout_s: float = Field(0.05, gt=0, le=5, description="No request waits on Redis longer than this.")
    on_failure: Literal["open", "closed"] = Field(
        "open",
        description="open: fall back to local limits divided by `replicas` (reported as degraded); "
        "closed: refuse limited tenants with 503 until Redis is back.",
    )
    replicas: int = Field(1, ge=1, description="Gateway replicas sharing the limits (divides them when degraded).")
    reconnect_interval_s: float = Field(1.0, gt=0, description="How often to probe a Redis that went away.")
    slot_lease_s: float = Field(
        30.0, gt=1, description="A concurrency slot of a replica that died frees itself after this long."
    )
    slot_poll_s: float = Field(0.02, gt=0, description="How often a request waiting for a shared slot retries.")
    share_engine_reservations: bool = Field(
        True,
        description="Replicas claim each admission's blocks on its engine in Redis (an atomic script), so two "
        "replicas admitting into one engine between two scrapes cannot overshoot together.",
    )
    reservation_lease_s: float = Field(
        10.0, gt=1, description="A dead replica's claimed blocks free themselves after this long."
    )


class PassthroughConfig(_Model):
    """Engine routes kvgate does not understand stay closed (404) unless listed here."""

    allow: list[str] = Field(
        default_factory=list,
        description="Exact paths forwarded as they are (e.g. /reset_prefix_cache, /v1/load_lora_adapter): no "
        "admission, no rate limit. Each must be canonical (starts with /, no dot segments, no %, no //).",
    )
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="If set, only these keys (plain or 'sha256:<hex>') may call the allowed paths; otherwise any "
        "tenant's API key may (an anonymous caller never may).",
    )

    @model_validator(mode="after")
    def _paths_canonical(self) -> PassthroughConfig:
        for key in self.admin_api_keys:
            check_api_key(key)
        for path in self.allow:
            if not is_canonical(path) or path == "/":
                raise ValueError(
                    f"passthrough.allow: {path!r} is not a canonical path (it starts with /, has no %, ?, #, "
                    "empty, . or .. segment, no trailing / and is printable ASCII); requests are matched as sent"
                )
            if path in CONTROL_PATHS:
                raise ValueError(f"passthrough.allow: {path!r} is kvgate's own endpoint")
            if path in GENERATION or path in READ_ONLY:  # routed first: an entry here would never be reached
                raise ValueError(f"passthrough.allow: {path!r} is a route kvgate serves itself (admitted or read-only)")
        return self


class ReloadConfig(_Model):
    enabled: bool = Field(True, description="Watch the config file and apply new auth/tenants without restart.")
    interval_s: float = Field(1.0, gt=0, description="How often the file (and its ..data symlink) is checked.")


class GatewayConfig(_Model):
    upstream: UpstreamConfig = UpstreamConfig()
    listen: ListenConfig = ListenConfig()
    tokenizer: str = Field(
        "auto",
        description="auto, a model directory, a hub id (org/name, from the HF cache), hf:PATH, "
        "tiktoken:NAME_OR_FILE, vllm or heuristic[:N].",
    )
    tokenizer_download: bool = Field(
        False,
        description="Let a hub-id tokenizer (or auto, by the served model's id) missing from the HF cache be "
        "downloaded from HF_ENDPOINT (with HF_TOKEN) into that cache.",
    )
    tokenizer_fast_path: bool = Field(
        True,
        description="Skip the tokenizer for a text prompt far from every limit once its model and route have "
        "learned tokens per byte from served requests (the engine's usage): the limits are checked at the learned "
        "band's high end, the prompt reserves tokenizer_fast_path_quantile of the learned ratio. Counted exactly "
        "near a limit, while learning, and when the band is wider than 1% of the KV pool.",
    )
    tokenizer_fast_path_quantile: float = Field(
        0.7,
        gt=0,
        le=1,
        description="Quantile of learned tokens per byte a prompt priced without the tokenizer reserves: above the "
        "median per prompt, above the true total over the dozens an engine holds at once.",
    )
    tokenizer_media_tokens: int = Field(
        1024,
        ge=0,
        description="Tokens one image, audio clip or video of a chat is priced at, with a local tokenizer (which "
        "renders it as the template's placeholder; the model's processor expands it), until the model's served "
        "requests of that modality have shown what theirs take (their usage less the counted text: the 0.9 "
        "quantile of the last 256). The engine's /tokenize (tokenizer: vllm) counts media itself.",
    )
    model: ModelConfig = ModelConfig()
    admission: AdmissionConfig = AdmissionConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    limits: RequestLimitsConfig = RequestLimitsConfig()
    auth: AuthConfig = AuthConfig()
    tenants: list[TenantConfig] = Field(default_factory=list)
    redis: RedisConfig = RedisConfig()
    reload: ReloadConfig = ReloadConfig()
    passthrough: PassthroughConfig = PassthroughConfig()
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    log_requests: bool = Field(
        True,
        description="One line per proxied request (logger kvgate.access, at info): method, path, status, the "
        "error code, tenant, model, engine, the ids kvgate and the engine know it by, queue wait, duration and "
        "the engine's token counts. Written in batches (at most 0.1 s late): no CPU cost measurable per request.",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_in_lower_case(cls, value: Any) -> Any:
        """Any case, and Python's other names for two levels (``warn``, ``fatal``), as logging takes them."""
        if not isinstance(value, str):
            return value
        value = value.lower()
        return {"warn": "warning", "fatal": "critical"}.get(value, value)

    @field_validator("tokenizer")
    @classmethod
    def _heuristic_ratio(cls, value: str) -> str:
        kind, _, arg = value.partition(":")
        if kind == "heuristic" and arg:
            try:
                ratio = float(arg)
            except ValueError:
                ratio = math.nan
            if not math.isfinite(ratio) or ratio <= 0:
                raise ValueError(f"heuristic:{arg}: characters per token must be a positive number")
        return value

    @model_validator(mode="after")
    def _metrics_fresh_between_scrapes(self) -> GatewayConfig:
        if self.admission.stale_after_s <= self.telemetry.scrape_interval_s:
            raise ValueError(
                f"admission.stale_after_s ({self.admission.stale_after_s:g}) must exceed telemetry.scrape_interval_s "
                f"({self.telemetry.scrape_interval_s:g}): every sample would go stale before the next one is taken"
            )
        return self

    @model_validator(mode="after")
    def _claims_outlive_restates(self) -> GatewayConfig:
        """A replica renews its claimed blocks when it restates them, after each scrape (or failed one): a lease
        shorter than twice that gap lets a live request's claim lapse, and the other replicas admit on its room."""
        telemetry, redis = self.telemetry, self.redis
        gap = telemetry.scrape_interval_s + telemetry.scrape_timeout_s
        if redis.url and redis.share_engine_reservations and redis.reservation_lease_s <= 2 * gap:
            raise ValueError(
                f"redis.reservation_lease_s ({redis.reservation_lease_s:g}) must exceed twice "
                f"telemetry.scrape_interval_s + scrape_timeout_s ({gap:g}): claims are renewed once per scrape"
            )
        return self

    @model_validator(mode="after")
    def _tenants_unique(self) -> GatewayConfig:
        names: set[str] = set()
        owners: dict[str, str] = {}  # key digest -> tenant (a key and its sha256: form within one tenant: rotation)
        for tenant in self.tenants:
            if tenant.name in names:
                raise ValueError(f"tenant '{tenant.name}' is defined twice")
            names.add(tenant.name)
            for key in tenant.api_keys:
                digest = (
                    key.removeprefix("sha256:").lower()
                    if key.startswith("sha256:")
                    else hashlib.sha256(key.encode()).hexdigest()
                )
                owner = owners.setdefault(digest, tenant.name)
                if owner != tenant.name:
                    raise ValueError(f"an API key of tenant '{tenant.name}' is also one of tenant '{owner}'")
        names.add(self.auth.default_tenant)
        for tenant in self.tenants:  # a per-model override's counters are keyed '<tenant>/<model>'
            for model in tenant.models:
                if f"{tenant.name}/{model}" in names:
                    raise ValueError(
                        f"tenant '{tenant.name}/{model}' would share the counters of the override for model "
                        f"'{model}' of tenant '{tenant.name}': rename one"
                    )
        return self

    @model_validator(mode="after")
    def _allowed_paths_have_keys(self) -> GatewayConfig:
        if self.passthrough.allow and not self.passthrough.admin_api_keys and not any(t.api_keys for t in self.tenants):
            raise ValueError(
                "passthrough.allow opens engine routes that only a key may call: set passthrough.admin_api_keys "
                "(or give tenants api_keys)"
            )
        return self

    def with_overrides(self, **flags: Any) -> GatewayConfig:
        """Apply command-line flags (None means 'not given') on top of the file. Only what the file set is carried
        over: a per-model override merges the fields it sets over its tenant's (``exclude_unset``), and a full
        dump would make every one of them "set" (its None replacing the tenant's limit)."""
        data = self.model_dump(exclude_unset=True)
        for section in ("upstream", "listen"):
            data.setdefault(section, {})
        if flags.get("upstream") is not None and flags.get("upstream_dns") is not None:
            raise ConfigError(["command line: --upstream and --upstream-dns name the engines two ways: give one"])
        mapping = {
            "upstream": ("upstream", "url"),
            "host": ("listen", "host"),
            "port": ("listen", "port"),
            "control_port": ("listen", "control_port"),
        }
        for flag, value in flags.items():
            if value is None:
                continue
            if flag == "upstream" and isinstance(value, list):  # --upstream given once or more
                if len(value) == 1:
                    data["upstream"]["url"], data["upstream"]["urls"] = value[0], []
                else:
                    data["upstream"]["url"], data["upstream"]["urls"] = value[0], list(value)
                data["upstream"]["discovery"] = None  # the file's discovery would otherwise win over the flag
            elif flag == "upstream_dns":
                host, _, port = str(value).rpartition(":") if ":" in str(value) else (str(value), "", "")
                data["upstream"]["discovery"] = {"dns": host, **({"port": int(port)} if port else {})}
            elif flag in mapping:
                section, key = mapping[flag]
                data[section][key] = value
            else:
                data[flag] = value
        try:
            return GatewayConfig.model_validate(data)
        except ValidationError as exc:  # the flags broke it (a --port on the control port): say so, as for a file
            raise ConfigError(_locate_errors(exc, None, "command line")) from exc


class ConfigError(Exception):
    """A config file that does not load; ``errors`` are printable ``file:line:col: path: message`` lines."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class ConfigFile:
    """A config file as it was read: what it says (before command-line flags) and the digest of its bytes, so
    that hot reload starts from what was loaded, not from what the file holds when the watcher starts."""

    path: str
    config: GatewayConfig
    digest: str  # sha256 of the bytes read


def read_config_file(path: str | Path) -> ConfigFile:
    """The config in ``path``. A file with no settings at all is an error, not "every default": the defaults are
    the most open policy, and an empty file almost always means a ConfigMap that failed to render. ``{}`` says
    "every default" on purpose."""
    raw = Path(path).read_bytes()
    config = parse_config_bytes(raw, str(path))
    return ConfigFile(str(path), config, hashlib.sha256(raw).hexdigest())


def parse_config_bytes(raw: bytes, source: str) -> GatewayConfig:
    """A config file's bytes: UTF-8 (as YAML 1.2 wants), with settings in it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"{source}: not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})"]
        ) from None
    if has_no_settings(text):
        raise ConfigError([f"{source}:1:1: the file has no settings (write {{}} to mean every default)"])
    return parse_config(text, source)


def load_config(path: str | Path | None) -> GatewayConfig:
    """The config in ``path`` (no path: every default); see :func:`read_config_file`."""
    return GatewayConfig() if path is None else read_config_file(path).config


def has_no_settings(text: str) -> bool:
    """True for a document with nothing in it (empty, whitespace, comments, a bare ``---`` or ``null``).

    A YAML syntax error is not "empty": :func:`parse_config` reports it with its location."""
    if not text.strip():
        return True  # even with tabs, which YAML would call a syntax error
    try:
        return yaml.safe_load(text) is None
    except yaml.YAMLError:
        return False


def parse_config(text: str, filename: str = "<config>") -> GatewayConfig:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark else filename
        raise ConfigError([f"{where}: YAML syntax error: {getattr(exc, 'problem', exc)}"]) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{filename}:1:1: the top level must be a mapping"])
    if duplicates := _duplicate_keys(root, filename):
        raise ConfigError(duplicates)
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_locate_errors(exc, root, filename)) from exc


def _duplicate_keys(node: yaml.Node | None, filename: str, path: tuple[str, ...] = ()) -> list[str]:
    """A key given twice in one mapping: YAML keeps the last silently (a second ``admission:`` block would put
    every setting of the first back to its default)."""
    errors: list[str] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            name = str(key.value)
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                mark = key.start_mark
                if name in seen:
                    errors.append(
                        f"{filename}:{mark.line + 1}:{mark.column + 1}: {'.'.join((*path, name))}: given twice "
                        f"(also on line {seen[name] + 1}); only one may stay"
                    )
                seen.setdefault(name, mark.line)
            errors += _duplicate_keys(value, filename, (*path, name))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            errors += _duplicate_keys(item, filename, (*path, str(i)))
    return errors


def _locate_errors(exc: ValidationError, root: yaml.Node | None, filename: str) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        node = _find_node(root, loc)
        line, col = (node.start_mark.line + 1, node.start_mark.column + 1) if node is not None else (1, 1)
        path = ".".join(str(p) for p in loc) or "<root>"
        lines.append(f"{filename}:{line}:{col}: {path}: {err['msg']}")
    return lines


def _find_node(root: yaml.Node | None, loc: tuple[Any, ...]) -> yaml.Node | None:
    """The deepest YAML node along ``loc`` (a missing key points at its parent mapping)."""
    node = root
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            child = next((v for k, v in node.value if k.value == part), None)
            key = next((k for k, _ in node.value if k.value == part), None)
            if child is None:
                return node
            # Point at the key for scalars: editors highlight the line that names the setting.
            node = child if not isinstance(child, yaml.ScalarNode) else key
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            return node
    return node


def validate_file(path: str) -> int:
    """``kvgate validate``: exit 0 and say so, or print every error with its location and exit 1."""
    try:
        load_config(path)
    except OSError as exc:
        print(f"{path}: cannot be read: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    print(f"{path}: OK")
    return 0
