"""Lower bounds on the cycle makespan and on the refresh cycle k: every plan states its distance
from the best possible.

All bounds relax the problem (drop constraints), so each is below every feasible schedule:

- critical path: the longest chain of durations and lags through the dependencies;
  a task of an option counts only under that option (min over the options of a choice);
- device work: on each resource, the earliest any of its tasks can start + its mandatory
  work + the shortest tail after its tasks;
- shared work: resources linked by a choice (the replicas that may invert a factor)
  together carry their mandatory work plus the cheapest option of each choice.
- rank span (periodic problems): a rank's span, measured from its own first start, holds
  its work and the waits its dependencies force on it: a path that leaves the rank and
  comes back (a micro-batch's forward to the last stage and its backward back; a step's
  update to the next step's forward through the other stages) is a wait inside the span
  (`rank_span_bounds`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

import networkx as nx
import numpy as np

from pfcompile.place.problem import Problem, topological_order


@dataclass
class Bounds:
    critical_path: int
    device_work: int
    shared_work: int
    rank_span: int = 0  # periodic problems only (rank_span_bounds)

    @property
    def makespan(self) -> int:
        return max(self.critical_path, self.device_work, self.shared_work, self.rank_span)

    def as_dict(self, scale: float = 1.0) -> dict[str, float]:
        return {"critical_path": self.critical_path * scale, "device_work": self.device_work * scale,
                "shared_work": self.shared_work * scale, "rank_span": self.rank_span * scale,
                "makespan": self.makespan * scale}


def heads_and_tails(p: Problem) -> tuple[list[int], list[int]]:
    """head[i]: earliest start of i; tail[i]: least time from i's end to the makespan.

    An edge counts when it binds whatever the choices are: from a mandatory task, or
    inside one option (an optional predecessor may be absent)."""
    n = p.n
    succ: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    edges = list(p.edges) + [(a, b, 0) for chain in p.chains for a, b in zip(chain, chain[1:])]
    for a, b, lag in edges:  # a fixed order is a dependency too
        succ[a].append((b, lag))
    order = topological_order(n, [[b for b, _ in out] for out in succ])
    opt, dur = p.option, p.dur
    head = [0] * n
    for a in order:
        ha = head[a] + dur[a]
        for b, lag in succ[a]:
            if (opt[a] is None or opt[a] == opt[b]) and ha + lag > head[b]:
                head[b] = ha + lag
    tail = [0] * n
    for a in reversed(order):
        for b, lag in succ[a]:
            if opt[b] is None or opt[b] == opt[a]:
                tail[a] = max(tail[a], lag + dur[b] + tail[b])
    # rendezvous members start together: each inherits the latest head of its group
    for group in p.rendezvous:
        if len({opt[i] for i in group}) == 1:
            h = max(head[i] for i in group)
            for i in group:
                head[i] = h
    return head, tail


def critical_path_bound(p: Problem, head=None, tail=None) -> int:
    if head is None:
        head, tail = heads_and_tails(p)
    best = max((head[i] + p.dur[i] + tail[i] for i in range(p.n) if p.option[i] is None), default=0)
    by_opt = p.option_tasks()
    for options in p.choices:
        best = max(best, min(max((head[i] + p.dur[i] + tail[i] for i in by_opt[o]), default=0)
                             for o in options))
    return best


def device_work_bound(p: Problem, head=None, tail=None) -> int:
    if head is None:
        head, tail = heads_and_tails(p)
    best = 0
    for tasks in p.resources().values():
        mand = [i for i in tasks if p.option[i] is None]
        if not mand:
            continue
        work = sum(p.dur[i] for i in mand)
        best = max(best, min(head[i] for i in tasks) + work + min(tail[i] for i in tasks))
    return best


def shared_work_bound(p: Problem, head=None, tail=None) -> int:
    """Resources coupled by choices share the optional work: |G|·C >= their total."""
    if not p.choices:
        return 0
    if head is None:
        head, tail = heads_and_tails(p)
    by_opt = p.option_tasks()
    res = p.resources()
    link = nx.Graph()
    link.add_nodes_from(res)
    for options in p.choices:
        touched = [p.resource[i] for o in options for i in by_opt[o]]
        link.add_edges_from(zip(touched, touched[1:]))
    best = 0
    for group in nx.connected_components(link):
        if len(group) < 2:
            continue
        total = 0
        for r in group:
            total += min(head[i] for i in res[r]) + min(tail[i] for i in res[r])
            total += sum(p.dur[i] for i in res[r] if p.option[i] is None)
        for options in p.choices:
            work = [sum(p.dur[i] for i in by_opt[o] if p.resource[i] in group) for o in options]
            total += min(work)
        best = max(best, math.ceil(total / len(group)))
    return best


def lower_bounds(p: Problem) -> Bounds:
    if p.periodic:
        # the period: a rank's work fits in one period wherever it starts, so heads, tails
        # and chains across ranks bound nothing (critical path 0); each rank's work does
        zero = [0] * p.n
        by_rank = replace(p, resource=[(r[0],) for r in p.resource])
        return Bounds(0, device_work_bound(by_rank, zero, zero), shared_work_bound(by_rank, zero, zero),
                      max(rank_span_bounds(p).values(), default=0))
    head, tail = heads_and_tails(p)
    return Bounds(critical_path_bound(p, head, tail), device_work_bound(p, head, tail),
                  shared_work_bound(p, head, tail))


# --- the rank span of a periodic problem ------------------------------------------------------

_NONE = -(2 ** 62)  # "no path": far below any sum of durations


def rank_span_bounds(p: Problem) -> dict:
    """Per rank q, a lower bound on its span (last end - first start of its tasks), which
    the periodic objective bounds from below (Problem.periodic).

    Measure time from lo_q, the first start on q. Every task of q starts at or after 0 and
    ends at or before the span; a dependency path that leaves q and comes back forces
    its length between its two ends on q. So: rel_head[x] = the least start of any task x
    relative to lo_q (0 on q, longest path from q's tasks elsewhere; -inf when no path
    from q reaches x), rel_tail[x] = the least (span - start of x) (x's duration on q,
    longest path to q's tasks elsewhere). The span is then at least rel_head + rel_tail
    of any task, and at least the preemptive one-machine bound of q's mandatory tasks
    with those release dates and tails (Jackson's preemptive schedule, which is the
    largest of min head + work + min tail over all subsets): a relaxation that keeps the
    rank's no-overlap and every path, and drops everything else (other ranks'
    no-overlap, memory, which option is taken)."""
    if not p.periodic or p.n == 0:
        return {}
    rel = relative_heads_and_tails(p)
    if rel is None:
        return {}
    node, col, head, tail = rel
    # a head and a tail hold when their task is present: only a mandatory one's sum binds
    mandatory = np.zeros(head.shape[0], dtype=bool)
    mandatory[[node[i] for i in range(p.n) if p.option[i] is None]] = True
    both = (head > _NONE // 2) & (tail > _NONE // 2) & mandatory[:, None]
    through = np.where(both, head + tail, 0).max(axis=0)
    out = {q: int(through[c]) for q, c in col.items()}
    for res, tasks in p.resources().items():
        q, c = res[0], col[res[0]]
        jobs = [(int(head[node[i], c]), p.dur[i], int(tail[node[i], c]) - p.dur[i])
                for i in tasks if p.option[i] is None and p.dur[i] > 0]
        out[q] = max(out[q], jackson_preemptive(jobs))
    return out


def relative_heads_and_tails(p: Problem):
    """-> (node of each task, column of each rank, rel_head, rel_tail) as in
    rank_span_bounds: rel_head[node[i], col[q]] is the least start of task i after the
    first start on rank q (_NONE: unbounded), rel_tail the least (q's last end - start of
    i). None if the dependencies have a cycle."""
    graph = _span_graph(p)
    if graph is None:
        return None
    node, n_nodes, fwd, bwd = graph
    col = {q: c for c, q in enumerate(sorted({r[0] for r in p.resource}))}
    head = np.full((n_nodes, len(col)), _NONE, dtype=np.int64)
    tail = np.full((n_nodes, len(col)), _NONE, dtype=np.int64)
    for i in range(p.n):
        c = col[p.resource[i][0]]
        head[node[i], c] = 0
        tail[node[i], c] = max(tail[node[i], c], p.dur[i])
    _longest(head, fwd)
    _longest(tail, bwd, backwards=True)
    return node, col, head, tail


def jackson_preemptive(jobs: list[tuple[int, int, int]]) -> int:
    """The makespan of Jackson's preemptive schedule of (release, duration, tail) jobs on
    one machine: at every moment run the released job with the longest tail. It equals
    max over job subsets of (least release + total duration + least tail), a lower bound
    on any one-machine schedule's max(end + tail)."""
    jobs = sorted(jobs)
    ready: list[tuple[int, int]] = []  # (-tail, left to run)
    t = best = i = 0
    while i < len(jobs) or ready:
        if not ready:
            t = max(t, jobs[i][0])
        while i < len(jobs) and jobs[i][0] <= t:
            heapq.heappush(ready, (-jobs[i][2], jobs[i][1]))
            i += 1
        neg_tail, left = heapq.heappop(ready)
        run = left if i == len(jobs) else min(left, jobs[i][0] - t)
        t += run
        if run < left:
            heapq.heappush(ready, (neg_tail, left - run))
        else:
            best = max(best, t - neg_tail)
    return best


def _span_graph(p: Problem):
    """The dependencies as start-to-start arcs between nodes: members of a collective (all
    of one option) are one node, each phase boundary a node of its own. -> (node of each
    task, number of nodes, forward pass, backward pass), each pass as `_longest` takes it;
    None if the arcs have a cycle. An arc a -> b binds for heads when a is present
    whenever b is (a mandatory or of b's option), for tails when b is present whenever a is.

    A phase boundary comes after every task of its group, and those tasks share one
    machine: the boundary is at least their one-machine makespan from their heads (and,
    backwards, the next group's from their tails), not only the latest of their ends."""
    parent = list(range(p.n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    opt = p.option
    for group in p.rendezvous:
        if len({opt[i] for i in group}) == 1:
            for j in group[1:]:
                parent[find(j)] = find(group[0])
    roots = sorted({find(i) for i in range(p.n)})
    ids = {r: n for n, r in enumerate(roots)}
    node = [ids[find(i)] for i in range(p.n)]
    n_nodes = len(roots)
    node_opt = [opt[r] for r in roots]
    arcs = [(a, b, p.dur[a] + lag) for a, b, lag in p.edges]
    arcs += [(a, b, p.dur[a]) for chain in p.chains for a, b in zip(chain, chain[1:])]
    src, dst, delta = [], [], []
    for a, b, d in arcs:
        if node[a] != node[b]:
            src.append(node[a]), dst.append(node[b]), delta.append(d)
    before, after = [], []  # per boundary: (node, [(task node, duration)] per machine)
    for groups in p.phases:
        for g0, g1 in zip(groups, groups[1:]):
            v = n_nodes
            n_nodes += 1
            node_opt.append(None)
            for a in g0:
                src.append(node[a]), dst.append(v), delta.append(p.dur[a])
            for b in g1:
                src.append(v), dst.append(node[b]), delta.append(0)
            before.append((v, _by_machine(p, g0, node)))
            after.append((v, _by_machine(p, g1, node)))
    src, dst, delta = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(delta, dtype=np.int64)
    o = np.array([-1 if x is None else x for x in node_opt], dtype=np.int64)
    head_ok = (o[src] == -1) | (o[src] == o[dst])
    tail_ok = (o[dst] == -1) | (o[dst] == o[src])
    levels = _levels(n_nodes, src, dst)
    if levels is None:
        return None
    fwd = _by_level(src[head_ok], dst[head_ok], delta[head_ok], levels[0], before)
    bwd = _by_level(dst[tail_ok], src[tail_ok], delta[tail_ok], levels[1], after)
    return node, n_nodes, fwd, bwd


def _by_machine(p: Problem, tasks: list[int], node: list[int]) -> list[tuple]:
    """The mandatory tasks of a group with a duration, per no-overlap resource: (their
    nodes, their durations) as arrays."""
    out: dict = {}
    for i in tasks:
        if p.option[i] is None and p.dur[i] > 0:
            out.setdefault(p.resource[i], []).append(i)
    return [(np.array([node[i] for i in ts], dtype=np.int64), np.array([p.dur[i] for i in ts], dtype=np.int64))
            for ts in out.values() if len(ts) > 1]


def _levels(n: int, src, dst):
    """(longest-path level from the sources, from the sinks) of every node; None on a cycle."""
    from pfcompile.place.problem import topological_order

    out = []
    for a, b in ((src, dst), (dst, src)):
        succ: list[list[int]] = [[] for _ in range(n)]
        for x, y in zip(a.tolist(), b.tolist()):
            succ[x].append(y)
        try:
            order = topological_order(n, succ)
        except ValueError:
            return None
        level = [0] * n
        for x in order:
            lx = level[x] + 1
            for y in succ[x]:
                if lx > level[y]:
                    level[y] = lx
        out.append(np.array(level, dtype=np.int64))
    return out


def _by_level(src, dst, delta, level, machines):
    """[(arcs into the level's nodes, the level's boundaries with their machines)] in level order."""
    lv = level[dst]
    order = np.argsort(lv, kind="stable")
    src, dst, delta, lv = src[order], dst[order], delta[order], lv[order]
    at: dict[int, list] = {}
    for v, groups in machines:
        if groups:
            at.setdefault(int(level[v]), []).append((v, groups))
    out = []
    bounds = np.flatnonzero(np.diff(lv)) + 1
    for s, d, w in zip(np.split(src, bounds), np.split(dst, bounds), np.split(delta, bounds)):
        out.append((s, d, w, at.get(int(level[d[0]]), []) if len(d) else []))
    return out


def _longest(value, parts, backwards: bool = False) -> None:
    """Longest paths, level by level, for each rank's column at once: value[dst] =
    max(value[dst], value[src] + delta) (a level's arcs all start at lower levels), then
    each boundary of the level is at least the one-machine makespan of its group: its
    tasks with a known value in order of it, each starting at the later of its release
    and the previous end (a task with no known value may lie before the rank's start:
    left out). Forwards a task's release is its head; backwards, in reversed time, it is
    its tail less its duration (the time from its end to the span's end)."""
    for src, dst, delta, boundaries in parts:
        cand = value[src] + delta[:, None]
        cand[value[src] <= _NONE // 2] = _NONE
        np.maximum.at(value, dst, cand)
        for v, groups in boundaries:
            for nodes, dur in groups:
                h = value[nodes]  # (tasks, columns)
                if backwards:
                    h = np.where(h > _NONE // 2, h - dur[:, None], _NONE)
                order = np.argsort(h, axis=0, kind="stable")
                h = np.take_along_axis(h, order, axis=0)
                d = np.where(h > _NONE // 2, dur[order], 0)
                t = np.full(h.shape[1], _NONE, dtype=np.int64)
                for row in range(h.shape[0]):
                    t = np.maximum(t, h[row]) + d[row]
                value[v] = np.maximum(value[v], np.where(t > _NONE // 2, t, _NONE))


def refresh_steps_lower_bound_at(refresh_work_ms: dict, step_work_ms: dict, step_time_ms: float) -> int | None:
    """The least k at which a plan can run at `step_time_ms` (the best first-order step
    time: K-FAC then costs nothing): each device's idle time per step at that step time
    (step time - the work every step holds, fwd/bwd, gradient sync, preconditioning,
    update) must absorb its refresh work over k steps. A plan may use fewer steps, but it
    is then slower than `step_time_ms`."""
    return refresh_steps_lower_bound(refresh_work_ms, {q: step_time_ms - w for q, w in step_work_ms.items()})


def refresh_steps_lower_bound(refresh_work_ms: dict, idle_ms: dict) -> int | None:
    """k >= ceil(K-FAC work of one refresh / idle time per step) on the most loaded device.

    `refresh_work_ms[d]`: the refresh work device d must absorb (curvature, sync and inversion;
    with a choice of inverting replica, its even share); `idle_ms[d]`: the device's idle
    time in one step of the pipeline without K-FAC (less what every step must also hold,
    such as preconditioning). Below this k, the device cannot absorb the refresh without
    lengthening the step. None when a device has refresh work but no idle time at all: no
    k hides it (a one-stage pipeline, say)."""
    k = 1
    for d, work in refresh_work_ms.items():
        if work <= 1e-9:
            continue
        idle = idle_ms.get(d, 0.0)
        if idle <= 1e-9:
            return None
        k = max(k, math.ceil(work / idle - 1e-9))
    return k
