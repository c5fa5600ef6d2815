"""The per-device timeline of a plan, drawn like the PipeFisher paper's figures.

matplotlib rather than graphviz with pinned positions: a timeline is a bar chart over a
real time axis (ms ticks, step boundaries, exact block widths, a legend), which
matplotlib draws natively and graphviz would have to fake node by node.
"""

from __future__ import annotations

import io

from pfcompile.formats.plan import Plan
from pfcompile.render.style import color_of, group_of, label_of, legend_groups, optimizer_title, style_of

# Within a device's row (height 1): compute on top, communication as a strip beneath it,
# so a transfer that overlaps compute never hides it.
COMPUTE = (0.06, 0.62)  # (offset from row top, height)
COMM = (0.72, 0.2)


def render_timeline(plan: Plan, fmt: str, width_in: float = 16.0) -> bytes:
    import matplotlib  # noqa: PLC0415 (only this output needs it)

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    world = plan.world_size
    ops = [(q, t, p) for q in range(world) for t, step in enumerate(plan.ranks[q]) for p in step]
    t_end = max((p.end for _, _, p in ops), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(width_in, 1.0 + 0.55 * world))
    present: set[str] = set()
    # a device holding several stages (interleaved chunks, Chimera's two pipelines) draws
    # its second stage's forward/backward lighter (Chimera: the up pipeline, replica 1)
    chunk = {(q, s): i for q in range(world)
             for i, (r, s) in enumerate(sorted((r, s) for s, r in plan.stages_of(q)))}
    for q, _t, p in ops:
        kind = p.op.kind
        group = group_of(kind)
        present.add(group)
        off, height = COMM if group in ("p2p", "sync_curv", "sync_grad") else COMPUTE
        width = max(p.end - p.start, 0.0)
        colour = color_of(kind)
        if group in ("fwd", "bwd", "bwd_weight") and chunk.get((q, p.op.stage), 0) % 2:
            colour = _lighter(colour)
        ax.broken_barh([(p.start, width)], (q + off, height), facecolors=colour,
                       edgecolors="white", linewidth=0.3)
        if group in ("fwd", "bwd", "bwd_weight") and width > t_end / 120:
            ax.text(p.start + width / 2, q + off + height / 2, str(p.op.mb), ha="center", va="center",
                    fontsize=7, color="white")

    # step boundaries: where the next step of the cycle begins on its first device
    for t in range(1, plan.refresh_steps):
        starts = [p.start for q in range(world) for p in plan.ranks[q][t]]
        if starts:
            x = min(starts)
            ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
            ax.text(x, -0.42, f" step {t}", fontsize=8, va="top")

    ax.set_ylim(world, -0.45)  # room above device 0 for the step labels
    ax.set_xlim(0, t_end * 1.01)
    ax.set_yticks([q + 0.5 for q in range(world)])
    ax.set_yticklabels([f"device {q}" for q in range(world)])
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(_title(plan), fontsize=10)
    legend = [Patch(facecolor=style_of(g)[1], label=label_of(g)) for g in legend_groups(present)]
    height = fig.get_size_inches()[1]
    fig.legend(handles=legend, loc="lower center", ncol=min(len(legend), 9), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))  # leave a strip at the bottom for the legend
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _lighter(hex_colour: str, towards_white: float = 0.4) -> str:
    rgb = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * towards_white):02x}" for c in rgb)


def _title(plan: Plan) -> str:
    cfg, st = plan.config, plan.stats
    head = (f"{plan.model.get('name', 'model')}: {cfg.schedule} D={cfg.stages} N={cfg.micro_batches}, "
            f"method={cfg.method}" + (f", {optimizer_title(cfg.optimizer)}" if cfg.optimizer_work else ", first-order")
            + f", {plan.refresh_steps} step(s) per refresh")
    facts = []
    if isinstance(st.get("step_time_ms"), (int, float)):
        facts.append(f"step time {st['step_time_ms']:.1f} ms")
    if isinstance(st.get("utilization"), (int, float)):
        facts.append(f"utilization {st['utilization']:.1%}")
    return head + (" — " + ", ".join(facts) if facts else "")
