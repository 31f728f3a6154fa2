"""Which requests kvgate forwards, decided on the raw request target. Pure.

kvgate is the only public door to the engine, so it forwards by allow-list: a route it knows, on its exact
canonical path, with a method that route takes. Nothing is normalised: a target that would only match after
decoding (``%2F``, ``%3F``, ``%2E``), after removing dot segments or doubled slashes, or with a trailing slash is
refused with 400 and never reaches the engine. The upstream request line is the canonical path as received plus
the query string, so what kvgate checked is exactly what the engine routes on.

Routes come from vLLM's own router (checked against the engine in ``tests/e2e``):

* generation routes go through admission (each parsed for a cost, even a coarse one);
* read-only routes pass through under the same auth;
* everything else (admin and debug routes such as ``/reset_prefix_cache``, ``/sleep``, ``/collective_rpc``,
  ``/v1/load_lora_adapter``, the engine's ``/metrics``, anything unknown) is 404 unless the config lists the
  exact path in ``passthrough.allow``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.paths import GENERATION, READ_ONLY, BodyKind, is_canonical
from gateway.protocol.errors import GatewayError

RouteKind = Literal["generation", "read_only", "allowed"]

# vLLM routes kvgate knowingly keeps closed (404 unless allow-listed): admin, debug, weight updates, docs, and
# routes it has no cost model for. The e2e suite checks that every route of the real engine is in one of the
# three tables, so a new vLLM route is classified on purpose, never by default.
CLOSED = frozenset(
    {
        "/abort_requests", "/collective_rpc", "/fault_tolerance/apply", "/fault_tolerance/status",
        "/finish_weight_update", "/get_world_size", "/init_weight_transfer_engine", "/is_paused",
        "/is_scaling_elastic_ep", "/is_sleeping", "/kv_event_sources", "/pause", "/release_kv_cache_memory",
        "/reset_encoder_cache", "/reset_mm_cache", "/reset_prefix_cache", "/resume", "/scale_elastic_ep",
        "/server_info", "/shutdown_weight_transfer_engine", "/sleep", "/start_draft_weight_update",
        "/start_profile", "/start_weight_update", "/stop_profile", "/tokenizer_info", "/update_weight_version",
        "/update_weights", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/wake_up", "/weight_checker",
        "/weight_info", "/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc", "/ready",
        "/readyz", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
        "/v1/chat/completions/batch", "/v1/chat/completions/render", "/v1/completions/render",
        "/v1/responses/render", "/v1/messages/render", "/v1/messages/count_tokens",
        "/v1/chat/completions/derender", "/v1/completions/derender", "/generative_scoring", "/v2/embed",
        "/v1/realtime", "/v1/systemone",
    }
)  # fmt: skip
POST_ONLY = frozenset({"POST"})
# Methods an allow-listed admin path may use. HEAD is left out: its answer has a length but no body.
ALLOWED_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH"})


@dataclass(frozen=True, slots=True)
class Route:
    kind: RouteKind
    path: str  # the canonical path, exactly as received
    body: BodyKind | None = None  # generation routes only


def route(method: str, raw_path: str, allowed: frozenset[str]) -> Route:
    """The route for ``method raw_path``, or a GatewayError: 400 non-canonical, 404 unknown, 405 wrong method."""
    body = GENERATION.get(raw_path)  # the tables' paths are canonical: an exact hit needs no further check
    if body is not None:
        _check_method(method, POST_ONLY)
        return Route("generation", raw_path, body)
    if not is_canonical(raw_path):
        raise GatewayError(
            400,
            "The request path is not in canonical form (percent-encoding, dot segments, '//' or a trailing '/').",
            code="invalid_path",
        )
    methods = READ_ONLY.get(raw_path)
    if methods is not None:
        _check_method(method, methods)
        return Route("read_only", raw_path)
    if raw_path in allowed:
        _check_method(method, ALLOWED_METHODS)
        return Route("allowed", raw_path)
    raise GatewayError(404, f"No route {raw_path} on this gateway.", code="not_found")


def _check_method(method: str, allowed: frozenset[str]) -> None:
    if method not in allowed:
        raise GatewayError(
            405,
            f"Method {method} is not allowed here; use {', '.join(sorted(allowed))}.",
            code="method_not_allowed",
            extra_headers=[(b"allow", ", ".join(sorted(allowed)).encode())],
        )
