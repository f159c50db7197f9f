"""Plots for `pagedllm plan --plot FILE.png`: concurrency versus context length per scheme,
and, after ``--simulate``, the simulated timeline. matplotlib with the Agg backend (no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.planner.capacity import SCHEME_LABELS

STYLES = {
    "contiguous_max": ("tab:red", "--"),
    "contiguous_exact": ("tab:orange", "-."),
    "paged": ("tab:blue", "-"),
    "paged_shared": ("tab:green", ":"),
}


def write_plot(plan: dict[str, Any], path: str | Path) -> Path:
    """Draw the plan (and its simulation, if any) into one PNG; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = plan.get("simulation")
    fig, axes = plt.subplots(1, 2 if sim else 1, figsize=(13 if sim else 7, 4.8), squeeze=False)
    _concurrency_axes(axes[0][0], plan)
    if sim:
        _timeline_axes(axes[0][1], sim)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _concurrency_axes(ax: Any, plan: dict[str, Any]) -> None:
    from matplotlib.ticker import FuncFormatter

    shared = plan["shared_prefix"]
    for scheme, points in plan["curve"].items():
        if scheme == "paged_shared" and not shared:
            continue  # identical to paged without a shared prompt
        # A session shorter than the shared prompt is not a session of this workload.
        kept = [(x, y) for x, y in points if y > 0 and (scheme != "paged_shared" or x > shared)]
        xs, ys = [x for x, _ in kept], [y for _, y in kept]
        label = SCHEME_LABELS[scheme] + (
            f" ({shared:,} tokens)" if scheme == "paged_shared" else ""
        )
        if not kept:
            label += ": none fit"
        color, style = STYLES[scheme]
        ax.step(xs, ys, where="post", color=color, linestyle=style, label=label, linewidth=1.8)
    for row in plan["concurrency"]:
        ax.axvline(row["mean_length"], color="black", linestyle=":", linewidth=0.7, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
    target = plan["target_concurrency"]
    ax.axhline(target, color="gray", linewidth=0.8)
    ax.annotate(
        f"target {target}",
        (ax.get_xlim()[0], target),
        textcoords="offset points",
        xytext=(4, 3),
        fontsize=8,
        color="gray",
    )
    ax.set_xlabel("tokens per sequence (prompt + output)")
    ax.set_ylabel("maximum concurrent sequences")
    model, device = plan["model"], plan["device"]
    ax.set_title(
        f"{model['name']} on {device['name']}, tp {device['tp']}: "
        f"{plan['geometry']['num_tokens']:,} KV tokens",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _timeline_axes(ax: Any, sim: dict[str, Any]) -> None:
    timeline = sim["timeline"]
    t = [p["time"] for p in timeline]
    ax.plot(t, [p["num_running"] for p in timeline], label="running (admitted)", color="tab:blue")
    ax.plot(t, [p["num_waiting"] for p in timeline], label="waiting", color="tab:orange")
    if any(p["num_swapped"] for p in timeline):
        ax.plot(t, [p["num_swapped"] for p in timeline], label="swapped", color="tab:purple")
    preempt_t = [p["time"] for p in timeline if p["preempted"]]
    if preempt_t:
        ax.plot(
            preempt_t,
            [0] * len(preempt_t),
            "|",
            color="tab:red",
            markersize=10,
            label=f"preemption ({sim['preemption_mode']})",
        )
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("sequences")
    usage = ax.twinx()
    usage.plot(
        t,
        [100 * p["kv_usage"] for p in timeline],
        color="tab:green",
        alpha=0.5,
        linewidth=0.8,
        label="KV blocks in use (%)",
    )
    usage.set_ylabel("KV blocks in use (%)")
    usage.set_ylim(0, 105)
    ax.set_title(
        f"simulated: {sim['num_requests']} requests at {sim['arrival_rate']:g}/s, "
        f"{sim['num_preemptions']} preemptions",
        fontsize=10,
    )
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = usage.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3)


def _tokens(x: float, _pos: int) -> str:
    return f"{x / 1024:g}k" if x >= 1024 else f"{x:g}"


def write_cache_plot(report: dict[str, Any], path: str | Path) -> Path:
    """`pagedllm cache-report --plot`: hit rate by prompt position, and the divergence
    histogram (tokens recomputed by the token index where requests diverged)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6))
    points = report["hit_rate_by_position"]
    left.plot([p for p, _ in points], [r for _, r in points], color="tab:blue", linewidth=1.8)
    left.set_ylim(0, 1.02)
    left.set_xlabel("prompt position (tokens)")
    left.set_ylabel("requests reaching it that found it cached")
    left.set_title(f"hit rate by position ({report['cache']} cache)")
    left.grid(True, alpha=0.3)
    rows = report["divergences"]
    if rows:
        colors = plt.get_cmap("tab10")
        kinds = sorted({d["kind"] for d in rows})
        for k, kind in enumerate(kinds):
            mine = [d for d in rows if d["kind"] == kind]
            right.bar(
                [d["token_index"] for d in mine],
                [d["tokens_recomputed"] for d in mine],
                width=max(1.0, max(d["token_index"] for d in rows) / 80),
                color=colors(k),
                label=kind,
            )
        right.legend()
    else:
        right.text(0.5, 0.5, "no divergence points", ha="center", va="center")
    right.set_xlabel("token index of the divergence")
    right.set_ylabel("tokens recomputed because of it")
    right.set_title("divergence points")
    right.grid(True, alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
