"""The per-pair message order every plan keeps: a post-pass over the placed op lists.

NCCL ignores point-to-point tags: between an ordered pair of ranks the n-th receive gets
the n-th send (pytorch/pytorch#94819). Schedules that send in both directions between
the same ranks (Chimera's two pipelines, interleaved chunks, a placement that puts two
stages' messages on one link) do not keep that order by themselves, whoever placed them.

The pass keeps every send where the planner put it and moves receives EARLIER only: when
rank b reaches a receive of message m from rank a, it first receives every message a sent
to b before m in that step, in a's order. That adds no wait: a posts those sends before m,
so they are there no later than m is, and receiving a tensor before its consumer needs it
is always allowed (it is kept until used). The cost is memory (the tensor is held a little
longer) and the replay that follows measures it.
"""

from __future__ import annotations

from collections import defaultdict

from pfcompile.formats.ops import Op


def order_messages(steps: dict[int, list[list[Op]]]) -> dict[int, list[list[Op]]]:
    """steps[rank][step] -> op lists in execution order; returns new lists whose receives
    follow, for every pair of ranks, the order of the matching sends."""
    out = {q: [list(ops) for ops in s] for q, s in steps.items()}
    k = len(next(iter(steps.values()))) if steps else 0
    for t in range(k):
        sent: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (a, b) -> message keys in send order
        for a, s in steps.items():
            for op in s[t]:
                if op.kind.startswith("send_"):
                    sent[(a, op.peer)].append(op.message_key())
        for b in out:
            out[b][t] = _pull_receives(out[b][t], b, sent)
    return out


def _pull_receives(ops: list[Op], b: int, sent: dict) -> list[Op]:
    recv_of = {(op.peer, op.message_key()): op for op in ops if op.kind.startswith("recv_")}
    nxt: dict[int, int] = defaultdict(int)  # sender -> index of its next message to b
    got: set[tuple] = set()
    new: list[Op] = []
    for op in ops:
        if not op.kind.startswith("recv_"):
            new.append(op)
            continue
        a, key = op.peer, op.message_key()
        if (a, key) in got:
            continue  # pulled earlier
        order = sent.get((a, b), [])
        if key not in order[nxt[a]:]:
            new.append(op)  # no such send (the checker refuses the plan); leave it in place
            continue
        while True:
            k2 = order[nxt[a]]
            nxt[a] += 1
            r = recv_of.get((a, k2))
            if r is not None and (a, k2) not in got:
                new.append(r)
                got.add((a, k2))
            if k2 == key:
                break
    return new
