"""The cost step of the request path: count a parsed request's prompt tokens, then price it in KV blocks
against what is known of the engine right now (its geometry, its context length).

Counting text exactly is the most expensive thing kvgate does for a request, and it matters only near a limit.
So a text request is first checked at the high end of its learned token band
(:mod:`gateway.tokens.prompt_estimate`); if that passes the context and never-fits checks, so would the exact
count (both checks only get stricter as the prompt grows), and the tokenizer is skipped. The request then
reserves a quantile of the learned ratio (0.7 by default: ~3% above the median on mixed English text and
READMEs with Llama 3's tokenizer, and over 64 such prompts at least 0.98 of their true total in 2,000 draws),
not the band's high end (1.5-2x the median there): the error of one prompt does not matter, the sum's does, and
the engine's sampled usage and the watermark's margin cover it. A prompt whose band is wide enough that its
error alone could eat that margin (more than ``MAX_ERROR_SHARE`` of the pool) is counted, as is anything near
a limit. Token-id prompts are exact and free either way.

A chat the band cannot decide gets a second chance before it is counted: when an earlier turn of the same
conversation was counted (or served: ``usage``), that count plus the most the new messages can be (one token
per byte, and their framing; :mod:`gateway.tokens.conversations`) decides it the same way, and the long
conversations that come near the context limit are not tokenized again at every turn.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import InferenceRequest
from gateway.tokens.agreement import CountAgreement
from gateway.tokens.chat_render import media_items
from gateway.tokens.conversations import FRAMING_TOKENS, Conversation, ConversationCounts, conversation_of
from gateway.tokens.cost import KvGeometry, RequestCost, estimate_cost
from gateway.tokens.counting import TokenCounter
from gateway.tokens.media import MediaTokens
from gateway.tokens.prompt_estimate import EstimateErrors, PromptLengths, key_of, prompt_sizes

log = logging.getLogger("kvgate.tokens")

MAX_ERROR_SHARE = 0.01  # of the pool's tokens: a prompt whose band is wider than this is counted exactly


@dataclass(slots=True)
class PricingTally:
    """How requests were priced (plain counters, monotonic), and how good the estimate is."""

    by_estimate: int = 0  # text priced by its learned estimate: tokenizer skipped
    by_conversation: int = 0  # chats priced by an earlier turn's exact count and the new messages' band
    by_tokenizer: int = 0  # text counted: fast path off, not learned yet, not estimable, or near a limit
    by_token_ids: int = 0  # token-id prompts: exact and free
    near_limit: int = 0  # of by_tokenizer: the band's high end failed a check, or its band is too wide
    errors: EstimateErrors = field(default_factory=EstimateErrors)  # actual / estimated, from learn()


class CostEstimator:
    """``counter`` may be swapped while serving (``--tokenizer auto`` resolves once the engine has answered).

    ``fast_path`` skips the tokenizer for text whose band decides like an exact count would, once
    the request's (model, endpoint) has learned from ``lengths.min_samples`` served requests; until then
    every text request is counted. The prior alone would decide safely too (one token per byte is more than
    a byte-level tokenizer makes), but pricing at it would reserve up to 4x the prompt for the first requests
    of a burst, so it is only a fallback answer, never a price. With the ``heuristic`` tokenizer the count is
    itself an estimate and cheap: no fast path."""

    def __init__(
        self,
        counter: TokenCounter,
        *,
        geometry: Callable[[], KvGeometry | None],
        max_model_len: Callable[[], int | None],
        fast_path: bool = True,
        reserve_quantile: float = 0.7,
        max_error_share: float = MAX_ERROR_SHARE,
        lengths: PromptLengths | None = None,
        conversations: ConversationCounts | None = None,
        media: MediaTokens | None = None,
    ) -> None:
        self.counter = counter
        self._geometry = geometry
        self._max_model_len = max_model_len
        self.fast_path = fast_path
        self.reserve_quantile = reserve_quantile
        self.max_error_share = max_error_share
        self.lengths = lengths if lengths is not None else PromptLengths()
        self.conversations = conversations if conversations is not None else ConversationCounts()
        self.media = media if media is not None else MediaTokens()
        self.tally = PricingTally()
        self.agreement = CountAgreement()  # of local counts with the engine's

    async def estimate(self, request: InferenceRequest, *, exact: bool = False) -> RequestCost:
        """The request's cost. Priced by estimate it decides every limit as exact counting would, reserves a
        quantile of the learned ratio (in sum over many requests above their truth) and carries the band's high
        end for token charges;
        ``exact=True`` counts anyway (e.g. to re-price a request a tenant's token budget would refuse)."""
        geometry = self._geometry()
        if geometry is None:
            raise GatewayError(
                503,
                "The gateway does not know the engine's KV-cache size yet (no vllm:cache_config_info scraped).",
                type="service_unavailable",
                code="upstream_not_ready",
                retry_after_s=1.0,
            )
        token_ids = request.endpoint == "completions" and all(isinstance(p, list) for p in request.prompts)
        conversation = None
        if not (token_ids or exact) and self.fast_path and self.counter.kind != "heuristic":
            cost, near_limit = self._by_estimate(request, geometry)
            if cost is not None:
                self.tally.by_estimate += 1
                return cost
            conversation = conversation_of(request)
            if conversation is not None:
                cost = self._by_known_prefix(request, conversation, geometry)
                if cost is not None:
                    self.tally.by_conversation += 1
                    return cost
            self.tally.near_limit += near_limit
        prompt_tokens = await self.counter.count(request)
        if token_ids:
            self.tally.by_token_ids += 1
        else:
            self.tally.by_tokenizer += 1
            if conversation is not None:
                self.conversations.observe(conversation, prompt_tokens[0])
        return self._price(request, prompt_tokens, geometry, media_tokens=self._media_allowance(request))

    def _media_allowance(self, request: InferenceRequest) -> int:
        """What a chat's images, audio and video add to the text counted locally (the engine's ``/tokenize``
        counts them itself)."""
        if request.messages is None or self.counter.kind == "vllm":
            return 0
        model = request.model or ""
        return sum(n * self.media.per_item((model, modality)) for modality, n in media_items(request.messages).items())

    def learn(self, request: InferenceRequest, cost: RequestCost, prompt_tokens: int) -> None:
        """What the engine counted (``usage.prompt_tokens``) for a request it served, priced at ``cost``. Only a
        request with one text prompt teaches tokens per byte (every chat; a batch's usage sums its prompts, and
        token ids need no estimate); with the heuristic counting, whose count is itself an estimate, nothing
        uses that. A chat with media counted here teaches what its items took beyond the text."""
        if request.truncate_to is not None or request.history_elsewhere:
            return  # a truncated prompt's count, or one with a history only the engine has, says nothing of its size
        if request.messages is not None and self.counter.kind != "vllm" and (items := media_items(request.messages)):
            if len(items) == 1:  # with two modalities, which took what cannot be told apart
                ((modality, n),) = items.items()
                text = cost.prompt_tokens[0] - cost.media_tokens
                self.media.observe((request.model or "", modality), (prompt_tokens - text) / n)
            return
        if self.counter.kind == "heuristic":
            return
        if cost.prompt_high is None and self.counter.kind != "vllm" and len(cost.prompt_tokens) == 1:
            self._compare_counts(request, cost.prompt_tokens[0], prompt_tokens)
        sizes = prompt_sizes(request)
        if sizes is None or len(sizes) != 1 or prompt_tokens <= 0:
            return
        key = key_of(request)
        if self.lengths.learned(key):
            self.tally.errors.record(prompt_tokens, self.lengths.band(key, sizes[0]))
        self.lengths.observe(key, sizes[0], prompt_tokens)
        if request.messages is not None and sizes[0] >= self.conversations.min_bytes:
            conversation = conversation_of(request)
            if conversation is not None:
                self.conversations.observe(conversation, prompt_tokens)  # the next turn's known prefix

    def _compare_counts(self, request: InferenceRequest, ours: int, engine: int) -> None:
        """A text prompt counted here (token ids are the engine's own count): does the engine count the same?"""
        if request.endpoint == "completions" and isinstance(request.prompts[0], list):
            return
        if self.agreement.observe(ours, engine):
            ratio = self.agreement.median_ratio() or 0.0
            if self.agreement.disagrees:
                log.warning(
                    "the tokenizer %s does not count prompts as the engine does (its usage.prompt_tokens are %.2fx "
                    "these counts, the median of the last %d): is it the served model's? Requests near the context "
                    "limit may be refused, or let through, wrongly; set --tokenizer to the model's, or vllm",
                    self.counter.name,
                    ratio,
                    len(self.agreement),
                )
            else:
                log.info("the tokenizer %s counts as the engine does again", self.counter.name)

    def _by_estimate(self, request: InferenceRequest, geometry: KvGeometry) -> tuple[RequestCost | None, bool]:
        """Checked at the band's high end and priced at the reserve quantile. No cost when nothing is learned
        yet, or (near a limit: True) when the high end fails a check or the band is too wide for the pool."""
        key = key_of(request)
        sizes = prompt_sizes(request) if self.lengths.learned(key) else None
        if sizes is None:
            return None, False
        highs = tuple(self.lengths.high(key, size) for size in sizes)
        reserved = tuple(self.lengths.reserved(key, size, self.reserve_quantile) for size in sizes)
        cost = self._decided(request, highs, reserved, geometry)
        return cost, cost is None

    def _by_known_prefix(
        self, request: InferenceRequest, conversation: Conversation, geometry: KvGeometry
    ) -> RequestCost | None:
        """An earlier turn's exact count plus the new messages' band and framing, decided as the estimate is;
        the very conversation counted before is priced at its count."""
        known = self.conversations.longest_known(conversation)
        if known is None:
            return None
        if known.whole:
            return self._price(request, (known.tokens,), geometry)  # exact: a limit refuses as a count would
        key = key_of(request)
        # checked at one token per byte: the learned band is a band over whole prompts, and a dense new turn
        # (code, hashes, CJK after English) is no draw from it
        most = math.ceil(self.lengths.prior.high * known.tail_bytes)
        tail = self.lengths.reserved(key, known.tail_bytes, self.reserve_quantile)
        if not self.lengths.learned(key):
            tail = most  # the prior's ratio is no price: the new messages at their most
        framing = FRAMING_TOKENS * known.tail_messages
        return self._decided(request, (known.tokens + most + framing,), (known.tokens + tail + framing,), geometry)

    def _decided(
        self,
        request: InferenceRequest,
        highs: tuple[int, ...],
        reserved: tuple[int, ...],
        geometry: KvGeometry,
    ) -> RequestCost | None:
        """Priced at ``reserved`` when every limit holds at ``highs`` (so it holds for the truth) and the gap
        between them is small for the pool; else None: only a count decides."""
        # the byte-weighted reserve can pass the rank-based high end on a large window: never price above it
        reserved = tuple(map(min, reserved, highs))
        error_tokens = (sum(highs) - sum(reserved)) * request.sequences_per_prompt
        try:
            self._price(request, highs, geometry)
        except GatewayError:
            return None
        if error_tokens > self.max_error_share * geometry.num_blocks * geometry.block_size:
            return None
        return self._price(request, reserved, geometry, prompt_high=highs)

    def _price(
        self,
        request: InferenceRequest,
        prompt_tokens: tuple[int, ...],
        geometry: KvGeometry,
        prompt_high: tuple[int, ...] | None = None,
        media_tokens: int = 0,
    ) -> RequestCost:
        return estimate_cost(
            prompt_tokens,
            max_tokens=request.max_tokens,
            sequences_per_prompt=request.sequences_per_prompt,
            max_model_len=self._max_model_len(),
            geometry=geometry,
            min_tokens=request.min_tokens,
            prompt_high=prompt_high,
            truncate_to=request.truncate_to,
            media_tokens=media_tokens,
        )
