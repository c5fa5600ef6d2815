"""A refresh cycle's task graph as the solver's Problem, and a solution back as op lists.

What the model adds to the graph (pfcompile.graph.taskgraph) and why:
- the inversion choice: with replicas, each factor is inverted on ONE replica of its stage,
  chosen by the solver (an option per candidate rank: its inv and the bcast_inv from it);
- steps run one after another on every rank (the plan lists each step's ops in order and
  the runtime runs step t with list t): a boundary per rank and step;
- `fixed_order`: the family's forward/backward order per rank as a chain; the K-FAC work,
  sync_grad, precond and step are placed freely either way;
- memory: capacity = memory limit - resident bytes per rank (a reservoir in the model;
  a split backward's K-FAC kept input a late buffer: from W's end to the later of W's and
  curv_a's ends);
- sends and receives glued to the op they follow / precede (their message an edge with
  the transfer time as lag): moving them gains nothing, and it halves the tasks;
- optionally, the curvature ops one forward/backward enables as one task (its layers back
  to back; kept tensors held until the group ends).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pfcompile.formats.errors import InputError
from pfcompile.formats.ops import FLOATING_KINDS, P2P_KINDS, Op
from pfcompile.formats.plan import Task
from pfcompile.formats.profile import Profile
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.graph.taskgraph import TaskGraph, TaskGraphs, build_task_graph
from pfcompile.place.list_schedule import list_schedule
from pfcompile.place.problem import Problem, Schedule, to_us

# the passes whose order a fixed-order model keeps; a split backward's W pass is free to
# move within its dependencies and the memory limit
ORDERED_PASSES = ("fwd", "bwd", "bwd_input")
# the passes that enable curvature ops (curv_b of a split backward waits for W)
CURVATURE_PRODUCERS = ("fwd", "bwd", "bwd_weight")


@dataclass
class CycleModel:
    """The Problem of one k, and how its task indices map back to the graph."""

    tg: TaskGraph
    problem: Problem
    tasks: list[Task]
    index: dict[Task, int]
    per_step: set[int] = field(default_factory=set)  # indices of the per-step tasks
    emit: dict[Task, list[Op]] = field(default_factory=dict)  # ops a task stands for, in order
    host: dict[Task, Task] = field(default_factory=dict)  # graph task -> the model task it is in


# --- graph -> problem ---------------------------------------------------------------------


def cycle_graph(profile: Profile, cfg: PipelineConfig, k: int, graphs: TaskGraphs | None = None) -> TaskGraph:
    """The task graph the model is built from: with replicas, every candidate inverts (the
    model's options choose one)."""
    choose = cfg.optimizer_spec.refreshes and cfg.replicas > 1
    choose = choose and cfg.inversion == "balanced"  # the other policies fix the inverters
    return build_task_graph(profile, replace(cfg, refresh_steps=k, inversion="all" if choose else cfg.inversion),
                            graphs=graphs)


def cycle_from_graph(tg: TaskGraph, *, fixed_order: bool, refresh: bool = True,
                     group_curvature: bool = False, choose_inverter: bool = True,
                     periodic: bool = False) -> CycleModel:
    """`choose_inverter=False` (the user's `--inversion all`): every replica inverts.
    `periodic`: minimise the steady-state cycle instead of the makespan (Problem.periodic)."""
    cfg = tg.cfg
    choose = cfg.optimizer_spec.refreshes and cfg.replicas > 1 and choose_inverter
    host, emit, edges = _contract(tg, refresh, group_curvature)
    # deterministic task order (every model duration is >= 1 µs, so a task never starts
    # with its successor: sorting a rank's tasks by start alone respects the dependencies)
    tasks = sorted(emit, key=lambda t: (_step(t), t.rank, t.op))
    p = Problem(periodic=periodic)
    index: dict[Task, int] = {}
    option_of = _inversion_options(tg, p) if choose and refresh else {}
    duration = tg.costs.duration
    for t in tasks:
        # a glued send/receive costs its posting/completion (profile.runtime), when the profile has it
        us = sum(_model_us(duration(op, t.step)) for op in emit[t] if op.kind not in P2P_KINDS or duration(op) > 0)
        index[t] = p.add(t, us, (t.rank,), option_of.get(t))
    if choose and refresh:  # the broadcasts from each candidate inverter
        spec = cfg.optimizer_spec
        for (layer, f), cands in tg.inv_candidates.items():
            if len(cands) < 2:  # no choice (split preconditioning: only the owner needs it)
                continue
            for c in cands:
                inv = Task(None, c, Op(spec.refresh, layer=layer, factor=f))
                group = []
                for q in cands:
                    b = Task(None, q, Op(spec.broadcast, layer=layer, factor=f, peer=c))
                    index[b] = p.add(b, _model_us(duration(b.op)), (q,), option_of[inv])
                    tasks.append(b)
                    emit[b] = [b.op]
                    p.edges.append((index[inv], index[b], 0))
                    group.append(index[b])
                p.rendezvous.append(group)
    p.edges += [(index[u], index[v], to_us(lag)) for (u, v), lag in edges.items()]
    for group in tg.collectives.values():
        members = [index[t] for t in group if t in index]
        if len(members) > 1:
            p.rendezvous.append(members)
    for b in tg.buffers:
        if b.alloc in host and b.free in host:
            (p.late_buffers if b.at_end else p.buffers).append(
                (b.rank, b.nbytes, index[host[b.alloc]], index[host[b.free]]))
    limit = cfg.memory_limit_bytes
    p.capacity = {q: (None if limit is None else limit - tg.resident_bytes[q]) for q in tg.ranks}
    for steps in tg.canonical.values():
        p.phases.append([[index[t] for t in step if t in index] for step in steps])
        if fixed_order:
            p.chains.append([index[t] for step in steps for t in step if t.op.kind in ORDERED_PASSES])
    per_step = {i for i, t in enumerate(tasks) if t.step is not None}
    return CycleModel(tg, p, tasks, index, per_step, emit, host)


def _contract(tg: TaskGraph, refresh: bool, group_curvature: bool):
    """-> (host of every graph task, ops each host emits in order, edges between hosts with
    their lag).

    A send is posted right after the op that made its message and a receive waits right
    before the op that needs it: nothing is gained by moving them, so they are glued to
    those ops and their message becomes an edge with the transfer time as lag. This halves
    the tasks of a pipeline without changing what the replay computes. With
    `group_curvature`, the curvature ops a forward/backward enables form one task."""
    g = tg.g
    micro_batch_kinds = {d.kind for d in tg.cfg.optimizer_spec.micro_batch_ops}  # K-FAC's curvature
    nodes = [t for t in g.nodes if refresh or t.step is not None]
    host = {t: t for t in nodes}
    for t in nodes:
        kind = t.op.kind
        if kind in ("send_act", "send_grad"):
            (host[t],) = g.predecessors(t)
        elif kind in ("recv_act", "recv_grad"):
            (host[t],) = g.successors(t)
    if group_curvature:
        for u in nodes:
            if u.step == 0 and u.op.kind in CURVATURE_PRODUCERS:
                curv = sorted((v for v in g.successors(u) if v.op.kind in micro_batch_kinds), key=lambda v: v.op)
                for v in curv[1:]:
                    host[v] = curv[0]
    emit: dict[Task, list[Op]] = {t: [] for t in nodes if host[t] == t}
    for t in nodes:  # receives first, then the op (or the group in layer order), then sends
        if host[t] != t and t.op.kind.startswith("recv"):
            emit[host[t]].append(t.op)
    for t in nodes:
        if host[t] == t or t.op.kind in micro_batch_kinds:
            emit[host[t]].append(t.op)
    for t in nodes:
        if host[t] != t and t.op.kind.startswith("send"):
            emit[host[t]].append(t.op)
    edges: dict[tuple[Task, Task], float] = {}
    for u, v, lag in g.edges(data="lag"):
        if u in host and v in host:
            hu, hv = host[u], host[v]
            if hu != hv:
                edges[hu, hv] = max(lag, edges.get((hu, hv), lag))
    return host, emit, edges


def curvature_ops(profile: Profile, cfg: PipelineConfig) -> int:
    """The optimizer's micro-batch ops of a cycle (K-FAC's curvature: two per layer and micro-batch)."""
    return len(cfg.optimizer_spec.micro_batch_ops) * len(profile.covered_layers) * cfg.micro_batches


def _model_us(ms: float) -> int:
    """Duration in the model: at least 1 µs, so that a zero-length op (a posted send, a
    receive, the update) is ordered on its rank by the no-overlap like every other op: a
    send placed inside a curvature op would be posted only after it, later than the model
    assumed. Costs at most 1 µs per such op on the critical path."""
    return max(1, to_us(ms))


def _step(t: Task) -> int:
    return -1 if t.step is None else t.step


def _inversion_options(tg: TaskGraph, p: Problem) -> dict[Task, int]:
    """One option per (factor, candidate rank): that rank's inv (the graph, built with
    inversion="all", has one on every candidate) and its broadcasts."""
    option_of = {}
    refresh = tg.cfg.optimizer_spec.refresh
    for key, cands in tg.inv_candidates.items():
        if len(cands) < 2:  # nothing to choose: the inv is mandatory
            continue
        ids = []
        for c in cands:
            o = len(option_of)
            option_of[Task(None, c, Op(refresh, layer=key[0], factor=key[1]))] = o
            ids.append(o)
        p.choices.append(ids)
    return option_of


# --- solution -> op lists -------------------------------------------------------------------


def steps_from_schedule(cm: CycleModel, s: Schedule) -> dict[int, list[list[Op]]]:
    """Per rank, its tasks by start (ties: the problem's task order, which respects the
    dependencies); a floating task joins the step of the per-step task before it."""
    k = cm.tg.refresh_steps
    out: dict[int, list[list[Op]]] = {q: [[] for _ in range(k)] for q in cm.tg.ranks}
    by_rank: dict[int, list[tuple]] = {q: [] for q in cm.tg.ranks}
    for i, t in enumerate(cm.tasks):
        if s.start[i] is not None:
            by_rank[t.rank].append((s.start[i], s.start[i] + cm.problem.dur[i], i))
    for q, rows in by_rank.items():
        step = 0
        for _, _, i in sorted(rows):
            t = cm.tasks[i]
            if t.step is not None:
                step = t.step
            out[q][step] += cm.emit[t]
    return out


def schedule_from_steps(cm: CycleModel, steps: dict[int, list[list[Op]]]) -> Schedule | None:
    """Another planner's op lists (the greedy's) as a Schedule of this problem: each rank's
    order becomes a chain, its inverting replicas the options, and the list scheduler
    times it (as soon as possible in that order)."""
    k = cm.tg.refresh_steps
    if any(len(s) != k for s in steps.values()):
        return None
    chains, taken, seen = [], set(), set()
    for q, per_step in steps.items():
        chain = []
        for t, ops in enumerate(per_step):
            for op in ops:
                task = Task(None if op.kind in FLOATING_KINDS else t, q, op)
                i = cm.index.get(cm.host.get(task, task))
                if i is None or i in seen:  # a grouped curvature op runs with its group's first
                    continue
                seen.add(i)
                chain.append(i)
                if cm.problem.option[i] is not None:
                    taken.add(cm.problem.option[i])
        chains.append(chain)
    p = replace(cm.problem, chains=chains)
    try:
        return list_schedule(p, options=taken)
    except ValueError:  # the other plan's order contradicts a dependency
        return None


# --- memory: the smallest limit that can work -----------------------------------------------


def smallest_feasible_limit(cm: CycleModel) -> dict[int, int]:
    """Per rank: resident + the least dynamic peak under the family's order, reached by
    running each curvature op right after the op that made its kept tensor (activations
    are fixed by the fwd/bwd order; kept tensors then live only while their producer runs)
    and, with a split backward, each W pass right after its B pass (curv_b after the W)."""
    tg = cm.tg
    out = {}
    for q, steps in tg.canonical.items():
        live: dict[tuple, int] = {}  # activations (and a split backward's W buffers) between ops
        peak = 0
        for t_step, step in enumerate(steps):
            for t in _weight_pass_early(step):
                made = tg.costs.allocates(t.op, refresh=(t_step == 0))
                peak = max(peak, sum(live.values()) + sum(n for _, n in made))
                live.update(made)
                for key in tg.costs.frees(t.op):
                    live.pop(key, None)
                if t.op.kind != "bwd_input":  # its kept_b stays for the W (and curv_b) right after
                    live = {key: n for key, n in live.items() if not key[0].startswith("kept")}
        out[q] = tg.resident_bytes[q] + peak
    return out


def _weight_pass_early(step: list[Task]) -> list[Task]:
    """The step's order with every W pass right after its B pass: the least memory a
    fixed-order model can reach (W passes are free to move)."""
    w = {(t.op.stage, t.op.mb): t for t in step if t.op.kind == "bwd_weight"}
    out = []
    for t in step:
        if t.op.kind != "bwd_weight":
            out.append(t)
            if t.op.kind == "bwd_input":
                out.append(w[(t.op.stage, t.op.mb)])
    return out


def memory_error(cm: CycleModel, fixed_order: bool, *, proven: bool = False) -> InputError | None:
    """The one-line error for a limit below the smallest feasible one (None if it may fit).
    Under the family's order the smallest limit is exact; with a free order it is one that
    surely works, and only a solver's proof of infeasibility (`proven`) rejects a limit."""
    limit = cm.tg.cfg.memory_limit_bytes
    if limit is None:
        return None
    need = smallest_feasible_limit(cm)
    q = max(need, key=lambda r: need[r] - limit)
    if need[q] <= limit or not (fixed_order or proven):
        return None
    how = "under the family's order" if fixed_order else "known (under the family's order)"
    return InputError("--memory-limit", None,
                      f"rank {q} needs {need[q]} bytes, over the limit of {limit}: the smallest feasible limit "
                      f"{how} is {need[q]} bytes ({_gib(need[q])} = resident {_gib(cm.tg.resident_bytes[q])} + "
                      f"activations and kept tensors)")


def _gib(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n} B"
