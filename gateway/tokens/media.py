"""Tokens per image, audio clip or video of a chat, learned from the engine's own counts. Pure: no I/O.

A local tokenizer renders a chat's text exactly, but an image is a template placeholder there: vLLM's model
processor expands it to hundreds or thousands of tokens (576 for LLaVA-1.5, 256 for Gemma 3, one per 28x28
patch for Qwen2-VL), by the model and the image's size, which kvgate cannot compute without the model's
processor. So each media item is priced at what the engine said such items cost: from a served request's
``usage.prompt_tokens``, less the text kvgate counted, over its media items, per model and modality (a video
is many images' worth): a quantile of the recent ones (above most; a large image is rarer than a typical one),
and the configured prior until a key has ``min_samples``. Only a request with one modality teaches. The
engine's ``/tokenize`` (the ``vllm`` tokenizer) counts media itself: no allowance there.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque

Key = tuple[str, str]  # (model, modality: image, audio or video)


class MediaTokens:
    """Per model and modality: the tokens one media item took, over the last ``window`` requests."""

    def __init__(
        self, prior: int = 1024, *, window: int = 256, min_samples: int = 8, quantile: float = 0.9, max_keys: int = 64
    ) -> None:
        if prior < 0 or not 1 <= min_samples <= window or not 0 < quantile <= 1 or max_keys < 1:
            raise ValueError("need prior >= 0, 1 <= min_samples <= window, 0 < quantile <= 1, max_keys >= 1")
        self.prior = prior
        self.window = window
        self.min_samples = min_samples
        self.quantile = quantile
        self.max_keys = max_keys
        self._seen: OrderedDict[Key, tuple[deque[float], list[float]]] = OrderedDict()

    def observe(self, key: Key, per_item: float) -> None:
        """A served request's media items took ``per_item`` tokens each (in the mean)."""
        if per_item < 0 or not math.isfinite(per_item):
            return  # the text was over-counted (the heuristic): this says nothing of the media
        entry = self._seen.get(key)
        if entry is None:
            entry = self._seen[key] = (deque(), [])
            if len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(key)
        recent, ordered = entry
        if len(recent) == self.window:
            ordered.pop(bisect.bisect_left(ordered, recent.popleft()))
        recent.append(per_item)
        bisect.insort(ordered, per_item)

    def per_item(self, key: Key) -> int:
        """What one item of this model and modality is priced at."""
        entry = self._seen.get(key)
        if entry is None or len(entry[1]) < self.min_samples:
            return self.prior
        ordered = entry[1]
        return math.ceil(ordered[min(len(ordered) - 1, math.ceil(self.quantile * len(ordered)) - 1)])
