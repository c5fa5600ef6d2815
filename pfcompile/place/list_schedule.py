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

from pfcompile.place.problem import Problem, Schedule, topological_order


class _Timeline:
    """Busy time of one resource as sorted, disjoint blocks with first-fit insertion.

    Touching bookings merge into one block, so a fit scans only the gaps after its release
    time, not every task booked there: linear, not quadratic, in a rank's task count (a
    rank of a 32 x 128 cycle holds thousands of back-to-back tasks)."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []

    def fit(self, t: int, dur: int) -> int:
        if dur == 0:
            return t
        starts, ends = self.starts, self.ends
        i = bisect.bisect_right(ends, t)
        n = len(starts)
        while i < n:
            if t + dur <= starts[i]:
                return t
            if ends[i] > t:
                t = ends[i]
            i += 1
        return t

    def book(self, t: int, dur: int) -> None:
        if dur == 0:
            return
        starts, ends = self.starts, self.ends
        e = t + dur
        i = bisect.bisect_left(starts, t)
        if i > 0 and ends[i - 1] >= t:  # touches the block before: extend it
            i -= 1
            ends[i] = max(ends[i], e)
        else:
            starts.insert(i, t)
            ends.insert(i, e)
        while i + 1 < len(starts) and starts[i + 1] <= ends[i]:  # reaches the next block: merge
            ends[i] = max(ends[i], ends[i + 1])
            del starts[i + 1], ends[i + 1]


def _graph(p: Problem) -> tuple[list[list[tuple[int, int]]], list[list[int]]]:
    """(preds, succ) of the tasks and step barriers, built once per problem: the warm start
    schedules each problem several times with different priorities. Rebuilt if the
    problem grew since (the key counts its tasks and constraints)."""
    key = (p.n, len(p.edges), len(p.chains), len(p.phases), sum(len(c) for c in p.chains))
    cached = getattr(p, "_list_graph", None)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    n = p.n
    preds: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for a, b, l in p.edges:
        preds[b].append((a, l))
    for chain in p.chains:
        for a, b in zip(chain, chain[1:]):
            preds[b].append((a, 0))
    # a step boundary is a zero-length barrier node (ids past the tasks): one node, not
    # |step j| x |step j+1| edges
    for groups in p.phases:
        for g0, g1 in zip(groups, groups[1:]):
            bar = len(preds)
            preds.append([(i, 0) for i in g0])
            for j in g1:
                preds[j].append((bar, 0))
    total = len(preds)
    succ: list[list[int]] = [[] for _ in range(total)]
    for b in range(total):
        for a, _ in preds[b]:
            succ[a].append(b)
    p._list_graph = (key, preds, succ)
    return preds, succ


def list_schedule(p: Problem, first: set[int] | None = None, order_key=None,
                  pinned: dict[int, int] | None = None, options: set[int] | None = None) -> Schedule:
    """`pinned`: tasks whose start is given (booked before anything else is placed);
    `options`: the option to take in each choice they cover (default: the earliest finish)."""
    n = p.n
    preds, succ = _graph(p)
    total = len(preds)
    group_of = {i: gr for gr in p.rendezvous for i in gr}
    first = first or set()
    key = order_key or (lambda i: (i,))

    def rank(i: int) -> tuple:
        return (i < n and i not in first, key(i) if i < n else ())

    order = topological_order(total, succ, rank)

    by_opt = p.option_tasks()
    chosen: set[int] = set(options or ())
    choice_of = {o: c for c in p.choices for o in c}

    lines: dict[tuple, _Timeline] = defaultdict(_Timeline)
    start: list[int | None] = [None] * total
    for i, t0 in (pinned or {}).items():
        start[i] = t0
        lines[p.resource[i]].book(t0, p.dur[i])
    decided = {c[0] for c in p.choices if any(o in chosen for o in c)}  # choices (by first option id)

    def dur(i: int) -> int:
        return p.dur[i] if i < n else 0

    def release(i: int) -> int:
        r = 0
        for a, l in preds[i]:
            if start[a] is not None:
                r = max(r, start[a] + dur(a) + l)
        return r

    def place_group(members: list[int], trial: bool) -> int:
        t = max(release(i) for i in members)
        while True:
            t2 = max(lines[p.resource[i]].fit(t, p.dur[i]) for i in members)
            if t2 == t:
                break
            t = t2
        if not trial:
            for i in members:
                start[i] = t
                lines[p.resource[i]].book(t, p.dur[i])
        return t

    for i in order:
        if start[i] is not None:
            continue
        if i >= n:  # a barrier
            start[i] = release(i)
            continue
        o = p.option[i]
        if o is not None:
            c = choice_of[o]
            if c[0] not in decided:
                decided.add(c[0])
                # the option whose first tasks would finish earliest (the least loaded replica)
                best = min(c, key=lambda oo: max(
                    (place_group(group_of.get(j, [j]), trial=True) + p.dur[j]
                     for j in by_opt[oo] if not any(a < n and p.option[a] == oo for a, _ in preds[j])),
                    default=0))
                chosen.add(best)
            if o not in chosen:
                continue
        members = [j for j in group_of.get(i, [i]) if start[j] is None]
        place_group(members, trial=False)
    start = start[:n]
    return Schedule(start, p.objective(start))
