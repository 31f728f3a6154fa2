"""Simulator configuration and the hardware presets it is calibrated from.

Every number that comes from a datasheet or a model card is named after its source; efficiency factors and
the OOM calibration are modelling assumptions and say so. docs/simulator.md derives the presets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway.sim.lengths import OutputLengths

GIB = 1024**3


@dataclass(frozen=True)
class ModelSpec:
    """What the step-time and memory model needs to know about the served model."""

    name: str
    params: float  # total parameters (model card)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype_bytes: int = 2  # bf16

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator, times ``tp`` for tensor parallelism (datasheet figures)."""

    name: str
    tp: int
    hbm_bytes_per_gpu: float  # usable device memory
    hbm_bandwidth: float  # bytes/s per GPU
    peak_flops: float  # dense bf16 FLOP/s per GPU


@dataclass(frozen=True)
class SimConfig:
    """Everything the engine needs; presets fill it, CLI flags override single fields."""

    served_model_name: str
    model: ModelSpec
    hardware: HardwareSpec
    num_gpu_blocks: int
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.95
    # Step-time model (assumptions, see docs/simulator.md).
    bandwidth_efficiency: float = 0.75
    mfu: float = 0.55
    step_overhead_s: float = 0.0015  # scheduler, sampling launch, python
    per_seq_overhead_s: float = 1.5e-5
    tp_overhead_s_per_layer: float = 0.0  # all-reduce latency per layer when tp > 1
    # OOM model: step memory = fixed + KV in use + activation per prefill token.
    runtime_overhead_bytes_per_gpu: float = 1.5 * GIB  # CUDA context, graphs, NCCL buffers
    activation_bytes_per_prefill_token: float = 512 * 1024
    max_num_queued_reqs: int | None = None
    stream_interval: int = 1  # vLLM's --stream-interval: tokens per streamed event at least
    # Natural output lengths for requests that do not carry their own (``sim_output_tokens``); None: they
    # generate to max_tokens. Drawn from a generator seeded with ``seed`` (vLLM's --seed).
    output_tokens: OutputLengths | None = None
    seed: int = 0

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.model.kv_bytes_per_token

    @property
    def card_bytes(self) -> float:
        return self.hardware.hbm_bytes_per_gpu * self.hardware.tp

    @property
    def fixed_bytes(self) -> float:
        """Weights plus runtime overhead: memory that is in use whatever the batch."""
        return self.model.weight_bytes + self.runtime_overhead_bytes_per_gpu * self.hardware.tp

    def oom_usage_threshold(self, prefill_tokens: int) -> float:
        """KV usage above which a step carrying ``prefill_tokens`` prefill tokens exceeds the card."""
        room = self.card_bytes - self.fixed_bytes - self.activation_bytes_per_prefill_token * prefill_tokens
        return room / (self.block_bytes * (self.num_gpu_blocks - 1))

    def scaled(self, kv_scale: float) -> SimConfig:
        """A miniature: KV pool, KV headroom and the per-step token budget all shrink by ``kv_scale``.

        Activation memory per prefill token stays, so a step at a given KV usage whose prefill is the same
        fraction of the (scaled) budget OOMs exactly when the full-size one would. Scenarios scale their
        prompt and output lengths by the same factor; CI uses this to replay the 8B/H100 burst cheaply.
        """
        if kv_scale == 1.0:
            return self
        blocks = max(2, round((self.num_gpu_blocks - 1) * kv_scale) + 1)
        exact = (blocks - 1) / (self.num_gpu_blocks - 1)
        headroom = (self.card_bytes - self.fixed_bytes) * exact
        tp = self.hardware.tp
        hw = dataclasses.replace(self.hardware, hbm_bytes_per_gpu=(self.fixed_bytes + headroom) / tp)
        budget = max(self.block_size, round(self.max_num_batched_tokens * exact))
        return dataclasses.replace(self, hardware=hw, num_gpu_blocks=blocks, max_num_batched_tokens=budget)


LLAMA3_8B = ModelSpec(
    name="meta-llama/Meta-Llama-3-8B-Instruct",
    params=8.03e9,
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    hidden_size=4096,
)
LLAMA3_70B = ModelSpec(
    name="meta-llama/Meta-Llama-3-70B-Instruct",
    params=70.6e9,
    num_layers=80,
    num_kv_heads=8,
    head_dim=128,
    hidden_size=8192,
)
H100_SXM = HardwareSpec(
    name="H100-SXM-80GB", tp=1, hbm_bytes_per_gpu=79.0 * GIB, hbm_bandwidth=3.35e12, peak_flops=989e12
)

PRESETS: dict[str, SimConfig] = {
    # 31,744 blocks * 16 tokens * 128 KiB = 62 GiB of KV: a pool sized with gpu_memory_utilization ~0.95
    # whose activation profile under-estimated the real prefill peak, so a full 8192-token prefill chunk
    # at >= ~94% KV usage exceeds the card (the seeds' failure), while <= 90% never does.
    "llama3-8b-h100": SimConfig(
        served_model_name="llama3-8b",
        model=LLAMA3_8B,
        hardware=H100_SXM,
        num_gpu_blocks=31_744,
    ),
    # Tensor parallel 4: 36,864 blocks * 16 * 320 KiB = 180 GiB of KV across the four cards.
    "llama3-70b-4xh100": SimConfig(
        served_model_name="llama3-70b",
        model=LLAMA3_70B,
        hardware=dataclasses.replace(H100_SXM, name="4xH100-SXM-80GB", tp=4),
        num_gpu_blocks=36_864,
        activation_bytes_per_prefill_token=1024 * 1024,
        tp_overhead_s_per_layer=2.0e-5,
    ),
}


def preset(name: str) -> SimConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(sorted(PRESETS))}") from None
