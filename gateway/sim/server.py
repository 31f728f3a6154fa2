"""The HTTP shell: an aiohttp app and an asyncio loop that steps the engine in (scaled) real time.

Each step is planned by the engine, slept for ``duration * time_scale`` real seconds, then completed; tokens
are handed to the waiting handlers. The engine clock is virtual: while idle it runs at real time divided by
``time_scale``; a step always takes exactly its modelled duration on it, even when the CPU could not keep up
with the scale (the overrun is counted in ``kvgate_sim_lag_seconds_total`` and left off the clock). So the
engine's dynamics and every latency it reports are in simulated seconds and do not depend on how busy the
machine running the simulator is. ``kvgate_sim_clock_seconds`` exports the clock so load tests can measure in
the same time base.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.protocol.requests import lax_bool, template_tool
from gateway.sim.api import (
    DONE,
    ApiError,
    Plan,
    Renderer,
    busy_error,
    check_model,
    check_request,
    engine_dead_error,
    plan_request,
    sse_error,
    token_text,
)
from gateway.sim.blocks import blocks_for
from gateway.sim.config import GIB, SimConfig
from gateway.sim.engine import Engine, SimRequest, Step, TokenEvent
from gateway.sim.metrics import SimMetrics
from gateway.tokens.tokenizers import LocalTokenizer

log = logging.getLogger("kvgate.sim")

OomMode = Literal["exit", "restart"]


@dataclass
class Channel:
    """Where the engine loop leaves a request's progress for its handler."""

    produced: int = 0
    finished: bool = False
    finish_reason: str = "length"
    error: ApiError | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class _Supervisor(Collector):
    """Counts OOM crashes across engine restarts (what a process supervisor would see)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.ooms = 0
        self.restarts = 0
        self.lag_s = 0.0
        self.created = time.time()

    def collect(self) -> Iterator[Metric]:
        oom = CounterMetricFamily("kvgate_sim_oom_crashes", "Simulated CUDA OOM crashes since the simulator started.")
        oom.add_metric([], self.ooms, created=self.created)
        yield oom
        rs = CounterMetricFamily("kvgate_sim_engine_restarts", "Engine restarts after an OOM.")
        rs.add_metric([], self.restarts, created=self.created)
        yield rs
        lag = CounterMetricFamily(
            "kvgate_sim_lag_seconds",
            "Real seconds the step loop ran behind the time-scaled step model (CPU too slow for the scale).",
        )
        lag.add_metric([], self.lag_s, created=self.created)
        yield lag
        clock = GaugeMetricFamily("kvgate_sim_clock_seconds", "The engine's virtual clock (simulated seconds).")
        clock.add_metric([], self.clock())
        yield clock


class SimServer:
    """Owns the engine incarnation, the request channels and the step loop."""

    def __init__(
        self,
        cfg: SimConfig,
        tokenizer: LocalTokenizer,
        *,
        time_scale: float = 1.0,
        oom_mode: OomMode = "restart",
        restart_delay_s: float = 60.0,
        legacy_gpu_cache_metric: bool = False,
        model_root: str | None = None,
    ) -> None:
        min_blocks = blocks_for(cfg.max_model_len, cfg.block_size) + 1
        if cfg.num_gpu_blocks < min_blocks:
            raise ValueError(
                f"To serve at least one request with the model's max seq len ({cfg.max_model_len}), "
                f"{min_blocks} KV blocks are needed; num_gpu_blocks is {cfg.num_gpu_blocks}"
            )
        self.cfg = cfg
        self.tokenizer = tokenizer
        # what /v1/models says --model named: the directory whose tokenizer it counts with, else the hub id
        self.model_root = model_root or cfg.model.name
        self.time_scale = time_scale
        self.oom_mode = oom_mode
        self.restart_delay_s = restart_delay_s
        self.legacy = legacy_gpu_cache_metric
        self.supervisor = _Supervisor(self.now)
        self.state: Literal["ready", "restarting", "dead"] = "ready"
        self.exit_code = 0
        self.shutdown = asyncio.Event()
        self.wake = asyncio.Event()
        self.channels: dict[str, Channel] = {}
        self._ids = itertools.count()
        # Outlives engine restarts, so a restarted engine does not replay the same lengths.
        self._lengths = random.Random(cfg.seed)
        self._anchor_virtual = 0.0
        self._anchor_real = time.monotonic()
        self._step_end: float | None = None  # virtual end of the step in flight: the clock never passes it
        self._fresh_engine()

    def _fresh_engine(self) -> None:
        self.engine = Engine(self.cfg)
        self.metrics = SimMetrics(
            self.cfg, self.engine, legacy_gpu_cache_metric=self.legacy, supervisor=[self.supervisor]
        )

    def now(self) -> float:
        t = self._anchor_virtual + (time.monotonic() - self._anchor_real) / self.time_scale
        return t if self._step_end is None else min(t, self._step_end)

    # -- the step loop ---------------------------------------------------------------------------------
    async def run_engine(self) -> None:
        while not self.shutdown.is_set():
            if self.state != "ready" or not self.engine.has_work():
                self.wake.clear()
                await self.wake.wait()
                continue
            started = time.monotonic()
            begin = self.now()
            step = self.engine.schedule(begin)
            if step.oom:
                await self._oom(step)
                continue
            if not step.scheduled:
                self.wake.clear()
                await self.wake.wait()
                continue
            self._step_end = begin + step.duration
            planned = step.duration * self.time_scale
            await asyncio.sleep(max(0.0, planned - (time.monotonic() - started)))
            self.supervisor.lag_s += max(0.0, time.monotonic() - started - planned)
            self._anchor_virtual = self._step_end
            done_at = time.monotonic()
            self._dispatch(self.engine.complete(step, self._anchor_virtual))
            # The next step starts where this one ended: the real time spent applying the step and waking
            # its streams is the simulator's own overhead, not the GPU's (the step-time model already has a
            # per-step overhead), so it is counted as lag instead of passing on the virtual clock.
            self._anchor_real = time.monotonic()
            self._step_end = None
            self.supervisor.lag_s += self._anchor_real - done_at

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for ev in events:
            if ev.index == 1:
                self.metrics.observe_first_token(ev.request)
            if ev.finished:
                self.metrics.observe_finished(ev.request)
            ch = self.channels.get(ev.request.request_id)
            if ch is not None:
                ch.produced = ev.index
                ch.finished = ev.finished
                if ev.finished and ev.request.finish_reason is not None:
                    ch.finish_reason = ev.request.finish_reason
                ch.wake.set()

    async def _oom(self, step: Step) -> None:
        cfg = self.cfg
        self.supervisor.ooms += 1
        free_mib = (
            max(
                0.0,
                cfg.card_bytes - (step.memory_bytes - step.prefill_tokens * cfg.activation_bytes_per_prefill_token),
            )
            / 2**20
        )
        log.error(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate %.2f GiB. "
            "GPU 0 has a total capacity of %.2f GiB of which %.2f MiB is free. "
            "[sim: step of %d sequences, %d prefill tokens, KV usage %.4f, "
            "step memory %.2f GiB > %.2f GiB; oom #%d]",
            step.prefill_tokens * cfg.activation_bytes_per_prefill_token / GIB,
            cfg.card_bytes / GIB,
            free_mib,
            len(step.scheduled),
            step.prefill_tokens,
            self.engine.usage(),
            step.memory_bytes / GIB,
            cfg.card_bytes / GIB,
            self.supervisor.ooms,
        )
        for req in self.engine.fail_all(self.now()):
            ch = self.channels.get(req.request_id)
            if ch is not None:
                ch.error = engine_dead_error()
                ch.wake.set()
        if self.oom_mode == "exit":
            log.error("EngineCore died (simulated CUDA OOM); exiting with status 1")
            self.state = "dead"
            self.exit_code = 1
            await asyncio.sleep(0.05)  # let handlers send their 500s
            self.shutdown.set()
            return
        self.state = "restarting"
        log.error("engine restarting in %.1f simulated seconds", self.restart_delay_s)
        await asyncio.sleep(self.restart_delay_s * self.time_scale)
        self._fresh_engine()
        self.supervisor.restarts += 1
        self.state = "ready"
        log.warning("engine restarted after OOM #%d", self.supervisor.ooms)

    # -- HTTP ------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)  # vLLM's SageMaker ping: its health
        app.router.add_post("/ping", self.health)
        app.router.add_get("/load", self.load)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/version", self.version)
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.state == "ready" else 503)

    async def load(self, _: web.Request) -> web.Response:
        """vLLM's server load (as with --enable-server-load-tracking): the generation requests in progress."""
        return web.json_response({"server_load": len(self.channels)})

    async def detokenize(self, request: web.Request) -> web.Response:
        """The tokens' text, as vLLM's /detokenize answers: the simulator's ids carry no meaning, so the text
        is its output words, one per id."""
        body = await _json(request)
        if isinstance(body, ApiError):
            return _error(body)
        try:
            check_model(body, self.cfg.served_model_name)
        except ApiError as err:
            return _error(err)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            return _error(ApiError(400, "tokens must be a list of integers >= 0", "BadRequestError", "tokens"))
        return web.json_response({"prompt": "".join(token_text(i + 1) for i in range(len(tokens)))})

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0+kvgate-sim"})

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        if self.state != "ready":
            return web.Response(status=503, text="engine is not running\n")
        return web.Response(
            body=self.metrics.render(),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Version": "0.0.4"},
        )

    async def models(self, _: web.Request) -> web.Response:
        name = self.cfg.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.model_root,  # vLLM's is what --model named: a path or a hub id
            "parent": None,
            "max_model_len": self.cfg.max_model_len,
            "permission": [{"id": "modelperm-sim", "object": "model_permission", "allow_sampling": True}],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if isinstance(body, ApiError):
            return _error(body)
        if "messages" in body:
            n = self._count_chat(body, documents=False)  # vLLM's /tokenize has no documents field
            tokens: list[int] = list(range(n))
        elif isinstance(body.get("prompt"), str):
            prompt = body["prompt"]
            if lax_bool(body.get("add_special_tokens")) is False:  # no BOS: as many pseudo ids as it counts
                tokens = list(range(self.tokenizer.count(prompt, add_special_tokens=False)))
            else:
                tokens = self.tokenizer.encode(prompt)
        else:
            return _error(ApiError(400, "prompt or messages is required", "BadRequestError"))
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": self.cfg.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    def _text_counter(self, body: Mapping[str, Any]) -> Callable[[str], int]:
        """A completion's prompt counted as vLLM does: with the tokenizer's special tokens, unless the body says
        ``add_special_tokens: false``."""
        special = lax_bool(body.get("add_special_tokens")) is not False
        return lambda text: self.tokenizer.count(text, add_special_tokens=special)

    def _count_chat(self, body: Mapping[str, Any], documents: bool = True) -> int:
        """A chat's prompt as vLLM renders it: the messages, the tools, the chat_template_kwargs and (on the
        chat route) the documents."""
        extra = dict(body.get("chat_template_kwargs") or {})
        if documents and body.get("documents") is not None:
            extra["documents"] = body["documents"]
        tools = body.get("tools")
        if isinstance(tools, list):  # as vLLM shows them to the template: missing fields as nulls
            tools = [template_tool(t) if isinstance(t, dict) else t for t in tools]
        special = lax_bool(body.get("add_special_tokens")) is True  # vLLM's chat default: none added
        return self.tokenizer.count_messages(body["messages"], tools, extra=extra or None, add_special_tokens=special)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await _json(request)
        if isinstance(body, ApiError):
            return _error(body)
        # vLLM's order: the body's fields and the model, then the engine (dead, or no room in its queue: vLLM's
        # _preflight), and only then the prompt's length against the context (its renderer)
        try:
            check_request(kind, body, served_model=self.cfg.served_model_name)
        except ApiError as err:
            return _error(err)
        if self.state != "ready":
            return _error(engine_dead_error())
        limit = self.cfg.max_num_queued_reqs
        # vLLM's check_admission: every unfinished request counts (running and waiting), and a request needs room
        if limit is not None and len(self.engine.running) + len(self.engine.waiting) + 1 > limit:
            self.metrics.rejections["max_num_queued_reqs"] += 1
            # checked before a response starts (vLLM's _preflight): a plain 503, streams included. vLLM answers
            # with an in-band SSE error a stream that passed that check in a burst and is refused when added: a
            # race this single-threaded engine does not have
            return _error(busy_error())
        try:
            plan = plan_request(
                kind,
                body,
                served_model=self.cfg.served_model_name,
                max_model_len=self.cfg.max_model_len,
                count_text=self._text_counter(body),
                count_chat=self._count_chat,
            )
        except ApiError as err:
            return _error(err)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        request_id = f"{prefix}-sim{next(self._ids):08x}"
        # one engine request per prompt (vLLM's "<id>-<i>" for a batch's), all waking this handler
        wake = asyncio.Event()
        batch = len(plan.prompt_lens) > 1
        channels: list[tuple[str, Channel]] = []
        try:
            for i, (prompt_len, max_tokens) in enumerate(zip(plan.prompt_lens, plan.max_tokens, strict=True)):
                engine_id = f"{request_id}-{i}" if batch else request_id
                self.engine.add(
                    SimRequest(
                        engine_id,
                        prompt_len,
                        max_tokens,
                        self.now(),
                        output_tokens=self._natural_length(plan),
                        min_tokens=plan.min_tokens,
                        ignore_eos=plan.ignore_eos,
                    )
                )
                # once the engine took it: nothing to leak if it did not
                channels.append((engine_id, Channel(wake=wake)))
                self.channels[engine_id] = channels[-1][1]
            self.wake.set()
            renderer = Renderer(plan, request_id)
            chans = [ch for _, ch in channels]
            if plan.stream:
                return await self._stream(request, plan, renderer, chans)
            while not all(ch.finished for ch in chans) and not any(ch.error for ch in chans):
                wake.clear()
                await wake.wait()
            error = next((ch.error for ch in chans if ch.error is not None), None)
            if error is not None:
                return _error(error)
            outcomes = [(ch.produced, ch.finish_reason) for ch in chans]
            return web.Response(body=renderer.full(outcomes), content_type="application/json")
        finally:
            for engine_id, ch in channels:
                self.channels.pop(engine_id, None)
                if not ch.finished and ch.error is None:
                    self.engine.abort(engine_id, self.now())

    def _natural_length(self, plan: Plan) -> int | None:
        """The body's ``sim_output_tokens``, else a draw from ``--output-tokens``, else none (runs to the cap).

        Drawn once at admission: the length belongs to the request and survives preemption. Draws are in
        arrival order, so only the body field makes one request's length independent of concurrency.
        """
        if plan.output_tokens is not None:
            return plan.output_tokens
        if self.cfg.output_tokens is not None:
            return self.cfg.output_tokens.draw(self._lengths)
        return None

    async def _stream(
        self, request: web.Request, plan: Plan, renderer: Renderer, chans: list[Channel]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        sent = [0] * len(chans)
        wake = chans[0].wake  # shared by the batch's channels
        # vLLM's output processor: the first token at once, then an event per stream_interval tokens (the
        # request's, raised to the server's), and the rest when the request ends
        interval = max(plan.stream_interval, self.cfg.stream_interval)
        while True:
            wake.clear()  # before looking: whatever the engine does from here on wakes the wait below
            parts: list[bytes] = []
            for i, ch in enumerate(chans):
                held = ch.produced - sent[i]
                if held == 0 or (sent[i] > 0 and held < interval and not ch.finished):
                    continue
                if sent[i] == 0 and plan.kind == "chat":
                    parts.append(renderer.role_chunk())
                # every token since its last event in one: vLLM's output collector merges the deltas a stream's
                # reader has not taken yet (a busy server sends fewer events than tokens)
                finish = ch.finish_reason if ch.finished else None
                parts.append(renderer.chunk(sent[i] + 1, finish, ch.produced, choice=i))
                sent[i] = ch.produced
            error = next((ch.error for ch in chans if ch.error is not None), None)
            done = all(ch.finished for ch in chans)
            if error is not None:
                parts.append(sse_error(error))
            elif done and plan.include_usage:
                parts.append(renderer.usage_chunk(sum(sent)))
            if error is not None or done:
                await resp.write(b"".join([*parts, DONE]))
                break
            if parts:
                await resp.write(b"".join(parts))
            else:
                await wake.wait()
        await resp.write_eof()
        return resp


async def _json(request: web.Request) -> dict[str, Any] | ApiError:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return ApiError(400, f"invalid JSON body: {exc}", "BadRequestError")
    if not isinstance(body, dict):
        return ApiError(400, "the request body must be a JSON object", "BadRequestError")
    return body


def _error(err: ApiError) -> web.Response:
    return web.Response(status=err.status, body=err.body(), content_type="application/json")
