"""A list scheduler over a `Problem`: the solver's warm start and its fallback.

Tasks are placed one by one, in an order consistent with the dependencies, each at the
earliest time its predecessors (plus lags) allow where its resource has a gap long enough
(insertion: a late task may fill an early gap). Members of a collective are placed at the
first time all of their resources are free. For a choice, the option whose tasks finish
earliest is taken. Memory is not modelled here (the solver and the replay check it).

`order_key(i)` (a tuple) ranks the tasks that are ready at once. `first` tasks are placed before all others: giving the per-step pipeline work first and the
refresh's K-FAC work second reproduces PipeFisher's greedy filling of the bubbles.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import networkx as nx

from pfcompile.problem import Problem, Schedule


class _Timeline:
    """Busy intervals of one resource, sorted, with first-fit insertion."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []

    def fit(self, t: int, dur: int) -> int:
        if dur == 0:
            return t
        i = bisect.bisect_right(self.ends, t)
        while i < len(self.starts):
            if t + dur <= self.starts[i]:
                return t
            t = max(t, self.ends[i])
            i += 1
        return t

    def book(self, t: int, dur: int) -> None:
        if dur == 0:
            return
        i = bisect.bisect_left(self.starts, t)
        self.starts.insert(i, t)
        self.ends.insert(i, t + dur)


def list_schedule(p: Problem, first: set[int] | None = None, order_key=None,
                  pinned: dict[int, int] | None = None, options: set[int] | None = None) -> Schedule:
    """`pinned`: tasks whose start is given (booked before anything else is placed);
    `options`: the option to take in each choice they cover (default: the earliest finish)."""
    g = nx.DiGraph()
    g.add_nodes_from(range(len(p.tasks)))
    lag = {}
    for a, b, l in p.edges:
        g.add_edge(a, b)
        lag[a, b] = max(l, lag.get((a, b), l))
    for chain in p.chains:
        for a, b in zip(chain, chain[1:]):
            g.add_edge(a, b)
            lag.setdefault((a, b), 0)
    # a step boundary is a zero-length barrier node (ids past the tasks): one node, not
    # |step j| x |step j+1| edges
    barrier = len(p.tasks)
    for groups in p.phases:
        for g0, g1 in zip(groups, groups[1:]):
            g.add_edges_from((i, barrier) for i in g0)
            g.add_edges_from((barrier, j) for j in g1)
            lag.update({(i, barrier): 0 for i in g0})
            lag.update({(barrier, j): 0 for j in g1})
            barrier += 1
    group_of = {i: gr for gr in p.rendezvous for i in gr}
    first = first or set()
    key = order_key or (lambda i: (i,))
    order = list(nx.lexicographical_topological_sort(
        g, key=lambda i: (i < len(p.tasks) and i not in first, key(i) if i < len(p.tasks) else ())))

    by_opt = p.option_tasks()
    chosen: set[int] = set(options or ())
    choice_of = {o: c for c in p.choices for o in c}

    lines: dict[tuple, _Timeline] = defaultdict(_Timeline)
    start: list[int | None] = [None] * barrier
    for i, t0 in (pinned or {}).items():
        start[i] = t0
        lines[p.tasks[i].resource].book(t0, p.tasks[i].dur)
    decided = {c[0] for c in p.choices if any(o in chosen for o in c)}  # choices (by first option id)

    def dur(i: int) -> int:
        return p.tasks[i].dur if i < len(p.tasks) else 0

    def release(i: int) -> int:
        r = 0
        for a in g.predecessors(i):
            if start[a] is not None:
                r = max(r, start[a] + dur(a) + lag[a, i])
        return r

    def place_group(members: list[int], trial: bool) -> int:
        t = max(release(i) for i in members)
        while True:
            t2 = max(lines[p.tasks[i].resource].fit(t, p.tasks[i].dur) for i in members)
            if t2 == t:
                break
            t = t2
        if not trial:
            for i in members:
                start[i] = t
                lines[p.tasks[i].resource].book(t, p.tasks[i].dur)
        return t

    for i in order:
        if start[i] is not None:
            continue
        if i >= len(p.tasks):  # a barrier
            start[i] = release(i)
            continue
        o = p.tasks[i].option
        if o is not None:
            c = choice_of[o]
            if c[0] not in decided:
                decided.add(c[0])
                # the option whose first tasks would finish earliest (the least loaded replica)
                best = min(c, key=lambda oo: max(
                    (place_group(group_of.get(j, [j]), trial=True) + p.tasks[j].dur
                     for j in by_opt[oo] if not any(p.tasks[a].option == oo for a in g.predecessors(j))),
                    default=0))
                chosen.add(best)
            if o not in chosen:
                continue
        members = [j for j in group_of.get(i, [i]) if start[j] is None]
        place_group(members, trial=False)
    start = start[:len(p.tasks)]
    mk = max((s + p.tasks[i].dur for i, s in enumerate(start) if s is not None), default=0)
    return Schedule(start, mk)
