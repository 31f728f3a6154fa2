"""Step-time model: a roofline over one engine step.

A step reads the weights once and the KV of every scheduled sequence, and does 2 * params FLOPs per token
plus attention. Decode steps are memory bound (cost grows with batch size and context through the KV read);
prefill chunks are compute bound (cost per prompt token). The slower of the two bounds, plus fixed and
per-sequence overheads, is the step time.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.sim.config import SimConfig


@dataclass(frozen=True)
class StepShape:
    """What the timing model needs to know about one scheduled batch."""

    num_seqs: int
    new_tokens: int  # prefill chunk tokens + one per decoding sequence
    context_tokens: int  # sum over sequences of the KV they attend to (computed + new)
    attention_pairs: int  # sum over sequences of new_tokens * context: attention FLOPs


def step_seconds(cfg: SimConfig, shape: StepShape) -> float:
    """Simulated wall time of one forward step on the preset's hardware."""
    if shape.num_seqs == 0:
        return 0.0
    hw, model = cfg.hardware, cfg.model
    bandwidth = hw.hbm_bandwidth * hw.tp * cfg.bandwidth_efficiency
    flops_rate = hw.peak_flops * hw.tp * cfg.mfu
    bytes_moved = model.weight_bytes + shape.context_tokens * model.kv_bytes_per_token
    # QK^T and PV: 2 matmuls * 2 FLOPs * heads*head_dim (= hidden) per (query, key) pair per layer.
    flops = 2 * model.params * shape.new_tokens + 4 * model.num_layers * model.hidden_size * shape.attention_pairs
    compute = max(bytes_moved / bandwidth, flops / flops_rate)
    tp_comm = cfg.tp_overhead_s_per_layer * model.num_layers if hw.tp > 1 else 0.0
    return compute + cfg.step_overhead_s + cfg.per_seq_overhead_s * shape.num_seqs + tp_comm
