"""The comparison as a markdown table and side-by-side PNG plots (KV usage, queue depth, throughput)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtests.compare import ArmResult
from loadtests.stats import throughput_series

ROWS: list[tuple[str, str]] = [
    ("OOM crashes", "oom_crashes"),
    ("preemptions", "preemptions"),
    ("peak KV usage (sampled)", "peak_kv_usage"),
    ("time KV > 90% (s)", "time_above_90_s"),
    ("time KV in 80–90% (fraction of run)", "time_in_80_90_frac"),
    ("requests served / sent", "served"),
    ("goodput (served with TTFT ≤ SLO)", "goodput"),
    ("output token throughput, whole run (tok/s)", "output_tok_per_s"),
    ("output token throughput while demand queued (tok/s)", "saturated_tok_per_s"),
    ("makespan (s)", "makespan_s"),
    ("TTFT p50 (s)", "ttft_p50_s"),
    ("TTFT p99 (s)", "ttft_p99_s"),
    ("every 429/503 has Retry-After", "rejections_with_retry_after"),
    ("backend down (s)", "backend_down_s"),
    ("/metrics samples per real second", "sample_hz_real"),
    ("longest gap between samples (real s)", "sample_max_gap_real_s"),
    ("simulator lag behind its time scale (real s)", "sim_lag_real_s"),
]


def fmt(key: str, s: dict[str, Any]) -> str:
    v = s.get(key)
    if key == "served":
        return f"{s['served']} / {s['requests']}"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        if key in ("peak_kv_usage", "time_in_80_90_frac"):
            return f"{v:.3f}"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"
    return str(v)


def table(results: Sequence[ArmResult]) -> str:
    head = "| metric | " + " | ".join(r.arm for r in results) + " |"
    sep = "| --- | " + " | ".join("---" for _ in results) + " |"
    lines = [head, sep]
    for label, key in ROWS:
        lines.append(f"| {label} | " + " | ".join(fmt(key, r.summary) for r in results) + " |")
    outcomes = sorted({k for r in results for k in r.summary["outcomes"] if k != "ok"})
    for o in outcomes:
        lines.append(
            f"| rejected/failed: {o} | " + " | ".join(str(r.summary["outcomes"].get(o, 0)) for r in results) + " |"
        )
    return "\n".join(lines)


def plots(results: Sequence[ArmResult], out_dir: Path, title: str) -> list[Path]:
    paths = []
    specs = [
        ("kv_usage", "KV cache usage", lambda r: ([s.t for s in r.samples if s.up], [s.kv for s in r.samples if s.up])),
        ("queue_depth", "queued requests", None),
        (
            "throughput",
            "generation tok/s (1 s window)",
            lambda r: tuple(zip(*throughput_series(r.samples, 1.0), strict=True)) or ([], []),
        ),
    ]
    for key, ylabel, getter in specs:
        fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.2), sharey=True, squeeze=False)
        for ax, r in zip(axes[0], results, strict=True):
            if key == "queue_depth":
                ax.plot([s.t for s in r.samples], [s.waiting for s in r.samples], label="engine waiting", lw=1)
                if any(not math.isnan(s.gateway_queue) for s in r.samples):
                    ax.plot([s.t for s in r.samples], [s.gateway_queue for s in r.samples], label="kvgate queue", lw=1)
                ax.legend(fontsize=7)
            else:
                assert getter is not None
                xs, ys = getter(r)
                ax.plot(xs, ys, lw=1)
            if key == "kv_usage":
                ax.axhline(0.9, color="r", ls="--", lw=0.8)
                ax.axhline(0.8, color="g", ls=":", lw=0.8)
                ax.set_ylim(0, 1.05)
            down = [s.t for s in r.samples if not s.up]
            if down:
                ax.plot(down, [0] * len(down), "rx", ms=3, label="backend down")
            ax.set_title(f"{r.arm}", fontsize=9)
            ax.set_xlabel("simulated s")
        axes[0][0].set_ylabel(ylabel)
        fig.suptitle(f"{title}: {ylabel}", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{key}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths
