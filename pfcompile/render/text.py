"""A plan as text: its statistics and each rank's ops per step in compact form (`pfcompile inspect`)."""

from __future__ import annotations

from pfcompile.formats.plan import Plan


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and v and all(isinstance(x, int) for x in v) and max(v) >= 2**20:
        return "[" + ", ".join(f"{x / 2**30:.2f}" for x in v) + "] GiB"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def format_stats(plan: Plan) -> str:
    c = plan.config
    head = (f"plan: {plan.model.get('name', '?')}  {c.schedule}  D={c.stages} N={c.micro_batches} "
            f"R={c.replicas} v={c.virtual_stages} W={c.world_size}  method={c.method} "
            f"optimizer={c.optimizer} k={c.refresh_steps}")
    width = max((len(k) for k in plan.stats), default=0)
    lines = [head] + [f"  {k:<{width}}  {_fmt(v)}" for k, v in plan.stats.items() if k != "partition_search"]
    return "\n".join(lines + format_partition_search(plan))


def format_partition_search(plan: Plan) -> list[str]:
    """`--partition auto`: the cuts planned in the final round, fastest first (each cut by
    its parts per stage; the plan's `partition` names the chosen one's parts)."""
    search = plan.stats.get("partition_search")
    if not search:
        return []
    lines = [f"  partition_search  chose the {search['chosen']} cut; {search['screened']} cuts screened, "
             f"{search['seconds']:.1f} s in all"]
    for f in sorted(search["finalists"], key=lambda f: f["step_time_ms"]):
        sizes = " ".join(str(len(stage.split(","))) for stage in f["partition"].split("|"))
        lines.append(f"    {f['rule']:<8} {f['step_time_ms']:10.1f} ms  k={f['refresh_steps']:<3} "
                     f"{f['solver_status'] or '':<9} parts per stage: {sizes}")
    for f in search.get("refused", []):
        lines.append(f"    {f['rule']:<8} no plan: {f['why']}")
    return lines


def format_cluster(plan: Plan) -> list[str]:
    """Which node holds which stages and replicas, and why (plans made with --nodes)."""
    clu = plan.config.cluster
    if not clu:
        return []
    g = clu.gpus_per_node
    lines = [f"cluster: {clu.nodes} nodes x {g} GPUs (torchrun --nnodes {clu.nodes} --nproc-per-node {g}); "
             f"intra {clu.intra.latency_ms} ms + {clu.intra.bytes_per_ms / 1e6:g} GB/s, "
             f"inter {clu.inter.latency_ms} ms + {clu.inter.bytes_per_ms / 1e6:g} GB/s"]
    for n in range(clu.nodes):
        held = [f"rank {q}: " + ", ".join(f"s{s}/r{r}" for s, r in plan.stages_of(q)) for q in range(n * g, (n + 1) * g)]
        lines.append(f"  node {n}: " + "; ".join(held))
    placed = plan.stats.get("placement")
    if placed:
        lines.append(f"  placement: {placed['chosen_by']}; traffic crossing nodes {placed['crossing_ms_per_step']} "
                     f"ms/step estimated (family numbering: {placed['crossing_ms_per_step_family_numbering']}); "
                     f"{placed['traffic_inside_nodes']:.1%} of the bytes stay inside nodes")
        lines.append(f"  why: {placed['why']}")
    return lines


def format_plan(plan: Plan, max_ops: int | None = None) -> str:
    lines = [format_stats(plan), "", *format_cluster(plan), "partition: " + " | ".join(",".join(p) for p in plan.partition)]
    for q, steps in enumerate(plan.ranks):
        held = ", ".join(f"s{s}/r{r}" for s, r in plan.stages_of(q))
        for t, ops in enumerate(steps):
            shown = ops if max_ops is None else ops[:max_ops]
            end = max((p.end for p in ops), default=0.0)
            more = f" ... (+{len(ops) - len(shown)} more)" if len(shown) < len(ops) else ""
            lines.append(f"rank {q} [{held}] step {t} ({len(ops)} ops, ends {end:.1f} ms): "
                         + " ".join(str(p.op) for p in shown) + more)
    return "\n".join(lines)
