"""`pfcompile plan PROFILE ...`: build a plan (baseline, greedy or CP-SAT), replay it, write it."""

from __future__ import annotations

import json
import re
import sys

from pfcompile.formats.errors import InputError, printable_table
from pfcompile.formats.jsonio import check_output_path
from pfcompile.formats.limits import (
    MAX_MICRO_BATCHES,
    MAX_REPLICAS,
    MAX_STAGES,
    MAX_TASKS,
    MAX_VIRTUAL_STAGES,
    MAX_WORLD_SIZE,
)
from pfcompile.formats.optimizers import NAMES as OPTIMIZER_NAMES
from pfcompile.formats.plan import INVERSION_POLICIES, METHODS, SCHEDULES, plan_from_json
from pfcompile.formats.profile import load_profile
from pfcompile.formats.verify import verify_plan
from pfcompile.graph.partition import RULES, even_partition, format_partition, parse_partition
from pfcompile.graph.schedules import PipelineConfig

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str = "--memory-limit") -> int:
    """"16GiB", "512MiB", "1.5GB", "123456" -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(flag, None, f"not a size: {text!r} (e.g. 16GiB, 512MiB, 1000000)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise InputError(flag, None, f"must be positive, got {text!r}")
    return int(value)


def register(sub) -> None:
    p = sub.add_parser("plan", help="compile a pipeline schedule with K-FAC into a plan file",
                       description="Build the task graph of a pipeline schedule with K-FAC from a profile, "
                                   "place the K-FAC work into the pipeline's bubbles, check the result by "
                                   "replaying it, and write the plan (the runtime's schedule file).")
    p.add_argument("profile", help="profile JSON (pfcompile profile, or profiles/*-ref.json)")
    p.add_argument("--schedule", required=True, choices=SCHEDULES, help="pipeline schedule family")
    p.add_argument("--stages", type=int, required=True, metavar="D", help="devices per pipeline")
    p.add_argument("--micro-batches", type=int, required=True, metavar="N",
                   help="micro-batches per training step, all replicas together")
    p.add_argument("--virtual-stages", type=int, default=1, metavar="V", help="model chunks per device (interleaved)")
    p.add_argument("--replicas", type=int, default=None, metavar="R",
                   help="copies of each stage (data parallel); chimera is always 2")
    p.add_argument("--memory-limit", default=None, metavar="SIZE", help="per device, e.g. 16GiB, 512MiB or bytes")
    p.add_argument("--method", default="cpsat", choices=METHODS,
                   help="none: the family's order (K-FAC after each step's work); greedy: PipeFisher's "
                        "first-fit bubble filling; cpsat: the CP-SAT planner (default; for adamw, the family's "
                        "order with its weight passes, syncs and sends placed, where that is faster)")
    p.add_argument("--optimizer", default="kfac", metavar="NAME",
                   help="whose extra work to place into the bubbles: " + ", ".join(OPTIMIZER_NAMES) +
                        " (kfac the default; adamw the first-order baseline: no extra work), or a plugin's "
                        "package.module:name")
    p.add_argument("--no-kfac", action="store_true", help="the first-order baseline (= --optimizer adamw)")
    p.add_argument("--defer-stats", action="store_true",
                   help="Shampoo, SOAP: each step's statistics fold the previous step's gradient (kept by its "
                        "update), so they may run in any bubble of the step; the runtime follows the plan")
    p.add_argument("--inverse", default="cholesky", choices=("cholesky", "eigen"), help="factor inversion method")
    p.add_argument("--inversion", default="balanced", choices=INVERSION_POLICIES,
                   help="which replicas invert a factor: balanced (one, chosen by the planner, then broadcast), "
                        "pipefisher (PipeFisher's split: floor(blocks/replicas) blocks of a stage to each replica, "
                        "the rest on every replica) or all")
    p.add_argument("--precond", default="auto", choices=("auto", "all", "split", "layers"),
                   help="with replicas: split (each replica preconditions its share of a stage's layers between "
                        "a gradient reduce-scatter and an all-gather, PipeFisher's division: floor(blocks/replicas) "
                        "blocks each, the rest on every replica), layers (the same, the layers divided one by one "
                        "by their work), all (every replica preconditions every layer), auto (default: whichever "
                        "plans faster)")
    p.add_argument("--partition", default="compute", metavar="CUT",
                   help='where the model is cut into stages: compute (default: the slowest stage\'s forward + '
                        'backward as short as it can be), even (each stage the same number of blocks), auto (the '
                        'cut whose plan is fastest, the optimizer\'s work and the memory limit counted; it plans '
                        'several cuts within --time-limit), or the parts of each stage, e.g. "embed,block0|block1,head"')
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S",
                   help="cpsat: hard wall-clock limit in seconds for the whole command, Python included "
                        "(the solver's stages and the k tried share it; the best plan found by then is kept)")
    p.add_argument("--workers", type=int, default=2, metavar="W", help="cpsat: parallel search workers")
    p.add_argument("--refresh-steps", type=int, default=None, metavar="K",
                   help="cpsat: fix the refresh cycle k (default: the planner chooses, from its lower bound)")
    p.add_argument("--pareto", action="store_true",
                   help="cpsat: plan every k from the lower bound until the step time stops falling and print "
                        "step time, overhead and status of each; -o writes the plan of --refresh-steps K "
                        "(default: the fastest)")
    order = p.add_mutually_exclusive_group()
    order.add_argument("--fixed-order", dest="fixed_order", action="store_true", default=True,
                       help="cpsat: keep the family's forward/backward order, place the rest (default)")
    order.add_argument("--free-order", dest="fixed_order", action="store_false",
                       help="cpsat: the solver may also reorder forward/backward passes within the dependencies")
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="machines the plan runs on (ranks numbered as torchrun --nnodes N --nproc-per-node G)")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G", help="ranks per machine")
    p.add_argument("--intra-link", default=None, metavar="MS,GBPS",
                   help="latency (ms) and bandwidth (GB/s) inside a node (default: the profile's measured link)")
    p.add_argument("--inter-link", default=None, metavar="MS,GBPS",
                   help="latency (ms) and bandwidth (GB/s) between nodes (required with --nodes > 1)")
    p.add_argument("--placement", default="auto", choices=("auto", "family"),
                   help="with --nodes: auto puts the ranks on the nodes so the heaviest traffic stays inside "
                        "them; family keeps the family's rank numbering")
    p.add_argument("-o", "--output", default=None, metavar="PLAN", help="write the plan here (JSON)")
    p.add_argument("--json", action="store_true", help="print the statistics as one JSON object")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="profile the command's Python with cProfile and print its N most expensive functions "
                        "(by cumulative time) on stderr")
    p.set_defaults(func=run)


def config_from_args(args, profile) -> PipelineConfig:
    if args.schedule == "chimera" and args.replicas not in (None, 2):
        raise InputError("--replicas", None, f"chimera is two pipelines (replicas 2), got {args.replicas}")
    replicas = args.replicas if args.replicas is not None else (2 if args.schedule == "chimera" else 1)
    cfg = PipelineConfig(
        schedule=args.schedule, stages=args.stages, micro_batches=args.micro_batches, replicas=replicas,
        virtual_stages=args.virtual_stages, optimizer="adamw" if args.no_kfac else args.optimizer, inverse=args.inverse,
        memory_limit_bytes=parse_bytes(args.memory_limit) if args.memory_limit else None,
        inversion=args.inversion, precond="all" if args.precond == "auto" else args.precond,
        defer_stats=args.defer_stats)
    cfg.cluster = cluster_from_args(args, profile, cfg.world_size)
    cfg.validate()
    if cfg.num_stages > len(profile.parts):
        raise InputError("--stages", None, f"{cfg.num_stages} model stages but the profile has only {len(profile.parts)} parts")
    if args.partition == "even":
        cfg.partition = even_partition(profile, cfg.num_stages)
    elif args.partition not in RULES:  # the parts of each stage
        cfg.partition = parse_partition(args.partition, profile, cfg.num_stages)
    return cfg  # compute: the default cut; auto: chosen by the planner


def options_from_args(args):
    """The planning options of the command line, made once and passed unchanged to the planner."""
    from pfcompile.place.options import PlanOptions

    return PlanOptions(method=args.method, time_limit=args.time_limit, workers=args.workers,
                       fixed_order=args.fixed_order, refresh_steps=args.refresh_steps, precond=args.precond,
                       placement=args.placement, partition="auto" if args.partition == "auto" else None)


def parse_link(text: str, flag: str):
    """"0.01,10" -> LinkModel(latency 0.01 ms, 10 GB/s)."""
    from pfcompile.formats.profile import LinkModel

    try:
        lat, gbps = (float(x) for x in text.split(","))
    except ValueError:
        raise InputError(flag, None, f"expected LATENCY_MS,GBPS like 0.01,10, got {text!r}") from None
    if lat < 0 or gbps <= 0:
        raise InputError(flag, None, f"latency must be >= 0 and bandwidth positive, got {text!r}")
    return LinkModel(latency_ms=lat, bytes_per_ms=gbps * 1e6)


def cluster_from_args(args, profile, world: int):
    if args.nodes is None and args.gpus_per_node is None:
        if args.intra_link or args.inter_link:
            raise InputError("--intra-link/--inter-link", None, "need --nodes and --gpus-per-node")
        return None
    from pfcompile.formats.profile import Cluster

    nodes = args.nodes if args.nodes is not None else 1
    gpus = args.gpus_per_node if args.gpus_per_node is not None else world // max(1, nodes)
    if nodes < 1 or gpus < 1:
        raise InputError("--nodes" if nodes < 1 else "--gpus-per-node", None, "must be a positive integer")
    intra = parse_link(args.intra_link, "--intra-link") if args.intra_link else profile.comm.p2p
    if args.inter_link:
        inter = parse_link(args.inter_link, "--inter-link")
    elif nodes > 1:
        raise InputError("--inter-link", None, "give the link between nodes (e.g. 0.05,10 for 50 us, 10 GB/s)")
    else:
        inter = intra
    return Cluster(nodes, gpus, intra, inter)


def check_plan_bounds(args) -> None:
    """The configuration's sizes, each against its bound (pfcompile.formats.limits)."""
    for flag, value, limit in (("--stages", args.stages, MAX_STAGES),
                               ("--micro-batches", args.micro_batches, MAX_MICRO_BATCHES),
                               ("--virtual-stages", args.virtual_stages, MAX_VIRTUAL_STAGES),
                               ("--replicas", args.replicas, MAX_REPLICAS)):
        if value is None:
            continue
        if value < 1:
            raise InputError(flag, None, f"must be a positive integer, got {value}")
        if value > limit:
            raise InputError(flag, None, f"{value} is over the limit of {limit} (the planner holds every op of "
                             f"the cycle in memory; see pfcompile/formats/limits.py)")
    world = args.stages * (args.replicas or 1)
    if world > MAX_WORLD_SIZE:
        raise InputError("--stages", None, f"{args.stages} stages x {args.replicas} replicas = {world} ranks, "
                         f"over the limit of {MAX_WORLD_SIZE}")
    if args.time_limit is not None and not (0 < args.time_limit <= 86400):
        raise InputError("--time-limit", None, f"must be a number of seconds in (0, 86400], got {args.time_limit}")
    if args.workers < 1:
        raise InputError("--workers", None, f"must be a positive integer, got {args.workers}")


def estimated_tasks(cfg: PipelineConfig, covered_layers: int) -> int:
    """Ops of one step: per (stage, micro-batch) a forward, a backward and up to four
    messages; per covered layer the optimizer's micro-batch ops (K-FAC's curvature: two per
    micro-batch), and per layer and replica its syncs, refreshes, broadcasts and per-step ops."""
    n = 6 * cfg.num_stages * cfg.micro_batches
    if cfg.optimizer_work:
        spec = cfg.optimizer_spec
        n += len(spec.micro_batch_ops) * covered_layers * cfg.micro_batches + 7 * covered_layers * cfg.replicas
    return n


def check_task_bound(cfg: PipelineConfig, covered_layers: int) -> None:
    n = estimated_tasks(cfg, covered_layers)
    if n > MAX_TASKS:
        raise InputError("--micro-batches", None, f"{cfg.num_stages} stages x {cfg.micro_batches} micro-batches "
                         f"make about {n} tasks per step, over the limit of {MAX_TASKS} (the planner's task "
                         "graph would not fit in memory; see pfcompile/formats/limits.py)")


def run(args) -> int:
    if args.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        try:
            return prof.runcall(_run, args)
        finally:
            print(f"## cProfile: the {args.cprofile} most expensive functions by cumulative time "
                  f"(CP-SAT's search is the native `solve`)", file=sys.stderr)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(args.cprofile)
    return _run(args)


def peak_rss_mib() -> float:
    """This process's peak resident set so far (Linux ru_maxrss is in KiB)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _run(args) -> int:
    check_plan_bounds(args)  # before reading anything: a typo must not start a runaway
    if args.output:
        check_output_path(args.output, "--output")
    from pfcompile.place.budget import Budget

    options = options_from_args(args)
    # from the command's start (pfcompile.cli.main): the interpreter, imports, loading, writing count
    budget = Budget(args.time_limit, started=getattr(args, "started", None))
    profile = load_profile(args.profile)
    cfg = config_from_args(args, profile)
    check_task_bound(cfg, len(profile.covered_layers))
    from pfcompile.place.upfront import check_before_planning

    check_before_planning(profile, cfg, args.method)  # no plan can: refused before the task graph
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pfcompile.place.build import build_plan  # the planner's stack (networkx, ortools) only now
    from pfcompile.place.options import Planning

    console = Console(stderr=True)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(f"{args.method}: placing K-FAC work", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        def describe(text: str) -> None:
            bar.update(task, description=text)

        planning = Planning(budget=budget, progress=progress, describe=describe)
        if args.pareto:
            return _run_pareto(args, profile, cfg, options, planning)
        plan, result, baseline = build_plan(profile, cfg, options, where=args.output or "<plan>", planning=planning)
    if "refresh_steps_note" in plan.stats:
        print(plan.stats["refresh_steps_note"], file=sys.stderr)
    if "bubbles_too_small" in plan.stats:
        print(f"note: the bubbles cannot hold the K-FAC work ({plan.stats['bubbles_too_small']}): CP-SAT stretched "
              f"the step, starting from the work appended to it", file=sys.stderr)
    # what is written is what every reader will verify: check the file's form, not the object
    with budget.stage("verify"):
        verify_plan(plan_from_json(plan.to_json(), args.output or "<plan>"), args.output or "<plan>",
                    profile_model=profile.model, profile_hash=profile.hash)
        if args.output:
            plan.save(args.output)
    # where the command's time went (the plan's own stats stop at its replay) and its memory
    seconds = {**budget.report(), "total": round(budget.elapsed(), 3)}
    keys = ("utilization", "utilization_pipefisher", "utilization_pipefisher_mean", "utilization_strict",
            "step_time_ms", "expected_step_time_ms", "step_time_from_idle_ms", "baseline_step_time_ms", "baseline_utilization", "step_overhead",
            "expected_baseline_step_time_ms", "expected_step_overhead", "expected_step_replay_steps",
            "tight_baseline_step_time_ms", "step_overhead_tight",
            "refresh_steps", "refresh_steps_lower_bound", "solver_status", "gap", "solve_seconds", "tasks",
            "peak_memory_bytes", "refresh_steps_note", "bubbles_too_small", "placement", "partition_search")
    out = {"plan": args.output, "schedule": cfg.schedule, "method": plan.config.method, "optimizer": cfg.optimizer,
           "partition": format_partition(plan.partition),
           **{k: plan.stats.get(k) for k in keys}, "stage_seconds": seconds, "peak_rss_mib": peak_rss_mib()}
    if args.json:
        print(json.dumps(out))
    else:
        from pfcompile.render.text import format_stats

        if args.output:
            print(f"wrote {args.output}")
        print(printable_table(format_stats(plan)))
        print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) + f"; peak RSS {out['peak_rss_mib']:.0f} MiB")
    return 0


PARETO_KEYS = ("refresh_steps", "step_time_ms", "step_overhead", "step_overhead_tight", "solver_status", "gap",
               "utilization_pipefisher_mean", "utilization_strict")


def _run_pareto(args, profile, cfg, options, planning) -> int:
    if options.partition == "auto":
        raise InputError("--pareto", None, "plans one cut: choose it first (--partition auto without --pareto), "
                         "then give it to --partition")
    if options.method != "cpsat" or not cfg.optimizer_spec.refreshes:
        raise InputError("--pareto", None, "needs --method cpsat and an optimizer with a refresh cycle (kfac, shampoo)")
    from dataclasses import replace

    from pfcompile.place.build import build_plan, pareto

    options = replace(options, refresh_steps=None, precond=None)  # each k of the table: the config's division
    plans = pareto(profile, cfg, options, planning=planning)
    if args.refresh_steps is not None:
        picked = [p for p in plans if p.refresh_steps == args.refresh_steps]
        if not picked:
            picked = [build_plan(profile, cfg, replace(options, refresh_steps=args.refresh_steps))[0]]
    else:
        picked = [min(plans, key=lambda p: (round(p.stats["step_time_ms"], 3), p.refresh_steps))]
    verify_plan(plan_from_json(picked[0].to_json(), args.output or "<plan>"), args.output or "<plan>",
                profile_model=profile.model, profile_hash=profile.hash)
    if args.output:
        picked[0].save(args.output)
    rows = [{k: p.stats.get(k) for k in PARETO_KEYS} for p in plans]
    if args.json:
        print(json.dumps({"plan": args.output, "refresh_steps_lower_bound": plans[0].stats.get("refresh_steps_lower_bound"),
                          "baseline_step_time_ms": plans[0].stats.get("baseline_step_time_ms"),
                          "tight_baseline_step_time_ms": plans[0].stats.get("tight_baseline_step_time_ms"),
                          "pareto": rows}))
        return 0
    if args.output:
        print(f"wrote {args.output} (k={picked[0].refresh_steps})")
    st = plans[0].stats
    print(f"k lower bound {st.get('refresh_steps_lower_bound')}; baseline {st['baseline_step_time_ms']:.1f} ms, "
          f"tight baseline {st.get('tight_baseline_step_time_ms', float('nan')):.1f} ms")
    print("| k | step ms | overhead | overhead vs tight | status | gap | util. PipeFisher mean | util. strict |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        pct = lambda x: "-" if x is None else f"{100 * x:.2f}%"  # noqa: E731
        print(f"| {r['refresh_steps']} | {r['step_time_ms']:.1f} | {pct(r['step_overhead'])} | "
              f"{pct(r['step_overhead_tight'])} | {r['solver_status']} | {pct(r['gap'])} | "
              f"{pct(r['utilization_pipefisher_mean'])} | {pct(r['utilization_strict'])} |")
    return 0
