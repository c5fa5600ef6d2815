"""Lower bounds on the cycle makespan and on the refresh cycle k: every plan states its distance
from the best possible.

All bounds relax the problem (drop constraints), so each is below every feasible schedule:

- critical path: the longest chain of durations and lags through the dependencies;
  a task of an option counts only under that option (min over the options of a choice);
- device work: on each resource, the earliest any of its tasks can start + its mandatory
  work + the shortest tail after its tasks;
- shared work: resources linked by a choice (the replicas that may invert a factor)
  together carry their mandatory work plus the cheapest option of each choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import networkx as nx

from pfcompile.place.problem import Problem, topological_order


@dataclass
class Bounds:
    critical_path: int
    device_work: int
    shared_work: int

    @property
    def makespan(self) -> int:
        return max(self.critical_path, self.device_work, self.shared_work)

    def as_dict(self, scale: float = 1.0) -> dict[str, float]:
        return {"critical_path": self.critical_path * scale, "device_work": self.device_work * scale,
                "shared_work": self.shared_work * scale, "makespan": self.makespan * scale}


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
        return Bounds(0, device_work_bound(by_rank, zero, zero), shared_work_bound(by_rank, zero, zero))
    head, tail = heads_and_tails(p)
    return Bounds(critical_path_bound(p, head, tail), device_work_bound(p, head, tail),
                  shared_work_bound(p, head, tail))


def refresh_steps_lower_bound_at(kfac_work_ms: dict, step_work_ms: dict, step_time_ms: float) -> int | None:
    """The least k at which a plan can run at `step_time_ms` (the best first-order step
    time: K-FAC then costs nothing): each device's idle time per step at that step time
    (step time - the work every step holds, fwd/bwd, gradient sync, preconditioning,
    update) must absorb its refresh work over k steps. A plan may use fewer steps, but it
    is then slower than `step_time_ms`."""
    return refresh_steps_lower_bound(kfac_work_ms, {q: step_time_ms - w for q, w in step_work_ms.items()})


def refresh_steps_lower_bound(kfac_work_ms: dict, idle_ms: dict) -> int | None:
    """k >= ceil(K-FAC work of one refresh / idle time per step) on the most loaded device.

    `kfac_work_ms[d]`: the refresh work device d must absorb (curvature, sync and inversion;
    with a choice of inverting replica, its even share); `idle_ms[d]`: the device's idle
    time in one step of the pipeline without K-FAC (less what every step must also hold,
    such as preconditioning). Below this k, the device cannot absorb the refresh without
    lengthening the step. None when a device has refresh work but no idle time at all: no
    k hides it (a one-stage pipeline, say)."""
    k = 1
    for d, work in kfac_work_ms.items():
        if work <= 1e-9:
            continue
        idle = idle_ms.get(d, 0.0)
        if idle <= 1e-9:
            return None
        k = max(k, math.ceil(work / idle - 1e-9))
    return k
