"""The scheduling problem the CP-SAT model and the lower bounds see: tasks in integer time.

A `Problem` is a TaskGraph (pfcompile.graph.taskgraph) stripped to what scheduling needs, in integer
microseconds. Keeping it apart from the graph lets the model, the bounds and the tests'
exhaustive search work on tiny hand-made instances as well as on real task graphs.

- `tasks[i]`: duration (µs), resource (rank, stream) — one no-overlap per resource — and
  the option it belongs to (None: always scheduled).
- `edges`: (u, v, lag): start(v) >= end(u) + lag (a message's transfer time is the lag).
- `rendezvous`: groups of tasks that start together (the members of one collective).
- `choices`: each a list of option ids of which exactly one is taken; an option is a set of
  tasks scheduled together or not at all (which replica inverts a factor, and the
  broadcasts from it).
- `buffers`: (rank, bytes, alloc task, free task): allocated at the start of the first,
  freed at the end of the second.
- `late_buffers`: (rank, bytes, holder task, free task): allocated at the END of the holder
  and freed at the later of the two ends (held over [end(holder), max(end(holder),
  end(free))], nothing if the free task ends first): a tensor that lives inside the
  holder's buffers until the holder ends (a split backward's K-FAC kept input, W's).
- `capacity[rank]`: bytes available for buffers (memory limit minus resident), or None.
- `chains`: sequences of tasks that must run in this order (`--fixed-order`).
- `phases`: per rank, groups of tasks that run one group after another (the steps of the
  cycle: every task of group j ends before any task of group j+1 starts).
- `periodic`: the objective is the cycle as it repeats, not the makespan from an idle
  start. Each rank runs its op lists in order, cycle after cycle, so the next cycle's
  first op on a rank starts after this cycle's last op there: a schedule repeated every P
  is valid iff every rank's span (last end - first start) is at most P (the edge from a
  stage's last update to its next forward is on one rank, so the span covers it), and the
  least such P is the steady-state period of the plan. `Schedule.makespan` is then P.

Rounding: durations and lags are rounded to the nearest microsecond, so a makespan found
optimal here is within 0.5 µs × (tasks on the critical path) of the true optimum.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

US_PER_MS = 1000


def to_us(ms: float) -> int:
    return int(round(ms * US_PER_MS))


@dataclass
class Problem:
    """Tasks as parallel lists (index i is one task): `key[i]` what it stands for (a graph
    Task, or anything hashable), `dur[i]` µs, `resource[i]` (one no-overlap each),
    `option[i]` (None: always scheduled)."""

    key: list[Hashable] = field(default_factory=list)
    dur: list[int] = field(default_factory=list)
    resource: list[tuple] = field(default_factory=list)
    option: list[int | None] = field(default_factory=list)
    edges: list[tuple[int, int, int]] = field(default_factory=list)
    rendezvous: list[list[int]] = field(default_factory=list)
    choices: list[list[int]] = field(default_factory=list)
    buffers: list[tuple[int, int, int, int]] = field(default_factory=list)
    late_buffers: list[tuple[int, int, int, int]] = field(default_factory=list)
    capacity: dict[int, int | None] = field(default_factory=dict)
    chains: list[list[int]] = field(default_factory=list)
    phases: list[list[list[int]]] = field(default_factory=list)
    periodic: bool = False

    def objective(self, start: list[int | None]) -> int:
        """The makespan, or with `periodic` the largest span of a rank (resource[0])."""
        if not self.periodic:
            return max((s + self.dur[i] for i, s in enumerate(start) if s is not None), default=0)
        lo: dict = {}
        hi: dict = {}
        for i, s in enumerate(start):
            if s is not None:
                r = self.resource[i][0]
                lo[r] = min(lo.get(r, s), s)
                hi[r] = max(hi.get(r, s), s + self.dur[i])
        return max((hi[r] - lo[r] for r in hi), default=0)

    def add(self, key: Hashable, dur: int, resource: tuple, option: int | None = None) -> int:
        self.key.append(key)
        self.dur.append(int(dur))
        self.resource.append(resource)
        self.option.append(option)
        return len(self.key) - 1

    @property
    def n(self) -> int:
        return len(self.key)


    def option_tasks(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {o: [] for c in self.choices for o in c}
        for i, o in enumerate(self.option):
            if o is not None:
                out[o].append(i)
        return out

    def resources(self) -> dict[tuple, list[int]]:
        out: dict[tuple, list[int]] = {}
        for i, r in enumerate(self.resource):
            out.setdefault(r, []).append(i)
        return out

    def horizon(self) -> int:
        """A makespan no schedule needs to exceed: everything one after another."""
        return sum(self.dur) + sum(max(0, lag) for _, _, lag in self.edges) + 1


@dataclass
class Schedule:
    """A solution: start of every scheduled task (None when its option was not taken)."""

    start: list[int | None]
    makespan: int

    def end(self, p: Problem, i: int) -> int | None:
        s = self.start[i]
        return None if s is None else s + p.dur[i]


def violations(p: Problem, s: Schedule, *, memory: bool = True) -> list[str]:
    """What a schedule breaks (empty: feasible). Independent of the CP-SAT model."""
    out = []
    st = s.start
    by_opt = p.option_tasks()
    for c in p.choices:
        taken = [o for o in c if by_opt[o] and all(st[i] is not None for i in by_opt[o])]
        if len(taken) != 1 or any(st[i] is not None for o in c if o not in taken for i in by_opt[o]):
            out.append(f"choice {c}: not exactly one option taken")
    for i in range(p.n):
        if p.option[i] is None and st[i] is None:
            out.append(f"task {p.key[i]} not scheduled")
        elif st[i] is not None and st[i] < 0:
            out.append(f"task {p.key[i]} starts before 0")
    for a, b, lag in p.edges:
        if st[a] is not None and st[b] is not None and st[b] < st[a] + p.dur[a] + lag:
            out.append(f"{p.key[b]} starts before {p.key[a]} ends (+{lag})")
    for chain in p.chains:
        for a, b in zip(chain, chain[1:]):
            if st[b] < st[a] + p.dur[a]:
                out.append(f"fixed order: {p.key[b]} before {p.key[a]}")
    for groups in p.phases:
        for g0, g1 in zip(groups, groups[1:]):
            live0 = [st[i] + p.dur[i] for i in g0 if st[i] is not None]
            live1 = [st[i] for i in g1 if st[i] is not None]
            if live0 and live1 and max(live0) > min(live1):
                out.append(f"a task of {p.key[g1[0]]}'s step starts before the previous step ends")
    for g in p.rendezvous:
        if len({st[i] for i in g if st[i] is not None}) > 1:
            out.append(f"collective {[p.key[i] for i in g]} does not start together")
    for res, tasks in p.resources().items():
        iv = sorted((st[i], st[i] + p.dur[i], i) for i in tasks if st[i] is not None and p.dur[i] > 0)
        for (_s0, e0, i), (s1, _e1, j) in zip(iv, iv[1:]):
            if s1 < e0:
                out.append(f"{p.key[i]} and {p.key[j]} overlap on {res}")
    if memory:
        for rank, peak in peak_levels(p, s).items():
            cap = p.capacity.get(rank)
            if cap is not None and peak > cap:
                out.append(f"rank {rank}: memory {peak} > capacity {cap}")
    if s.makespan < p.objective(st):
        out.append("period below a rank's span" if p.periodic else "makespan below the last end")
    return out


def peak_levels(p: Problem, s: Schedule) -> dict[int, int]:
    """Peak of the buffers' level per rank (frees at an instant count before allocations
    at the same instant, as in the CP-SAT reservoir)."""
    events: dict[int, list[tuple[int, int]]] = {}
    for rank, nbytes, a, f in p.buffers:
        events.setdefault(rank, []).extend([(s.start[a], nbytes), (s.start[f] + p.dur[f], -nbytes)])
    for rank, nbytes, h, f in p.late_buffers:
        held = s.start[h] + p.dur[h]
        freed = max(held, s.start[f] + p.dur[f])
        events.setdefault(rank, []).extend([(held, nbytes), (freed, -nbytes)])
    peaks = {}
    for rank, ev in events.items():
        level = peak = 0
        for _t, c in sorted(ev, key=lambda e: (e[0], e[1])):
            level += c
            peak = max(peak, level)
        peaks[rank] = peak
    return peaks


def topological_order(n: int, succ: list[list[int]], priority: Callable[[int], tuple] | None = None) -> list[int]:
    """Nodes 0..n-1 in an order where every edge a -> b (b in succ[a]) has a first.
    With `priority`, the least-priority ready node comes next (a list scheduler's order);
    without, Kahn's algorithm in id order. Raises ValueError on a cycle. (Lists of ints,
    not networkx: the 32 x 128 instances have ~10^5 tasks and this runs per k.)"""
    indeg = [0] * n
    for a in range(n):
        for b in succ[a]:
            indeg[b] += 1
    if priority is None:
        order = [i for i in range(n) if indeg[i] == 0]
        for a in order:  # grows while iterating
            for b in succ[a]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    order.append(b)
    else:
        ready = [(priority(i), i) for i in range(n) if indeg[i] == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, a = heapq.heappop(ready)
            order.append(a)
            for b in succ[a]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    heapq.heappush(ready, (priority(b), b))
    if len(order) != n:
        raise ValueError("the dependencies have a cycle")
    return order
