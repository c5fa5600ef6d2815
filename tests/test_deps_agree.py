"""The graph builder's dependency rules (pfcompile.graph.taskgraph, what the planners place)
and the replay's (pfcompile.check.deps, what checks their plans) are written apart; here
they must agree, edge for edge, on every family, for every optimizer (K-FAC, Shampoo, Muon,
AdamW), with each layer's work on every replica and divided between them.

A collective is compared as one unit: the graph makes each member wait for every replica's
producers, the replay makes each member wait for its own and then for the rendezvous; both
mean "the collective starts when all members' producers are done"."""

import pytest

from pfcompile.check.deps import PlanLayout, op_dependencies
from pfcompile.formats.plan import task_at
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.graph.taskgraph import build_task_graph
from pfcompile.place import assemble
from tests.test_graph import uniform_profile

CASES = [
    ("gpipe", dict(stages=2, micro_batches=3)),
    ("gpipe", dict(stages=2, micro_batches=4, replicas=2)),
    ("1f1b", dict(stages=4, micro_batches=5)),
    ("1f1b", dict(stages=2, micro_batches=4, replicas=2)),
    ("interleaved", dict(stages=2, micro_batches=4, virtual_stages=2)),
    ("chimera", dict(stages=4, micro_batches=4)),
    ("zb-h1", dict(stages=4, micro_batches=5)),
    ("zb-v", dict(stages=2, micro_batches=4)),
    ("dualpipev", dict(stages=2, micro_batches=5)),
]


OPTIMIZERS = ("kfac", "shampoo", "muon", "adamw")


def _profile():
    """The uniform profile with Shampoo's and Muon's per-layer costs too."""
    prof = uniform_profile(blocks=4)
    for layer in prof.covered_layers:
        layer.optimizer_ms.update({"shampoo": {"stats": 0.04, "inv_L": 0.3, "inv_R": 0.2, "precond": 0.05},
                                   "muon": {"orth": 0.1}})
    return prof


def _units(tg):
    """Each task's unit: the members of its collective, or itself."""
    unit = {t: (t,) for t in tg.g.nodes}
    for members in tg.collectives.values():
        for t in members:
            unit[t] = tuple(members)
    return unit


# every case with each optimizer, every layer's work on every replica; where there are
# replicas and work, also divided layer by layer
AGREE = [(schedule, kw, opt, "all") for schedule, kw in CASES for opt in OPTIMIZERS] + \
        [(schedule, kw, opt, "layers") for schedule, kw in CASES for opt in OPTIMIZERS
         if (kw.get("replicas", 1) > 1 or schedule == "chimera") and opt != "adamw"]


@pytest.mark.parametrize("schedule,kw,optimizer,precond", AGREE)
def test_graph_and_replay_dependency_rules_agree(schedule, kw, optimizer, precond):
    prof = _profile()
    cfg = PipelineConfig(schedule, refresh_steps=1 if optimizer == "muon" else 2, optimizer=optimizer,
                         precond=precond, **kw)
    tg = build_task_graph(prof, cfg)
    plan = assemble.assemble(prof, tg, assemble.appended_steps(tg), "none")
    if precond == "layers":  # each layer's work on its owner, gathered by ag_grad
        assert plan.config.precond == "split" and None not in plan.config.precond_owner
    layout = PlanLayout(plan)
    listed = {}  # graph task -> the step its plan lists it in
    for q, steps in enumerate(plan.ranks):
        for t, ops in enumerate(steps):
            for p in ops:
                listed[tuple(task_at(t, q, p.op))] = t
    assert set(listed) == {tuple(t) for t in tg.g.nodes}  # the plan lists exactly the graph's tasks

    checked = 0
    for members in set(_units(tg).values()):
        inside = {tuple(t) for t in members}
        graph_preds = {tuple(u) for t in members for u in tg.g.predecessors(t)} - inside
        replay_preds = set()
        for t in members:
            local, remote = op_dependencies(layout, t.rank, 0, listed[tuple(t)], t.op)
            replay_preds |= {(step, rank, op) for cycle, step, rank, op in local + remote if cycle == 0}
        assert graph_preds == replay_preds - inside, (members, graph_preds ^ replay_preds)
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("schedule,kw", CASES)
def test_only_a_first_steps_forward_has_rules_that_differ_by_cycle(schedule, kw):
    """The replay and the verifier derive cycle 1's rules from cycle 0's for every listing
    but those `differs_by_cycle` names (pfcompile.formats.rules.CycleIndex): the shortcut
    must give what op_dependencies gives."""
    from pfcompile.formats.rules import differs_by_cycle

    prof = uniform_profile(blocks=4)
    cfg = PipelineConfig(schedule, refresh_steps=2, **kw)
    tg = build_task_graph(prof, cfg)
    plan = assemble.assemble(prof, tg, assemble.appended_steps(tg), "none")
    layout = PlanLayout(plan)
    differing = 0
    for q, steps in enumerate(plan.ranks):
        for t, ops in enumerate(steps):
            for p in ops:
                at0 = op_dependencies(layout, q, 0, t, p.op)
                at1 = op_dependencies(layout, q, 1, t, p.op)
                shifted = tuple([(c + 1, *rest) for c, *rest in keys] for keys in at0)
                if differs_by_cycle(t, p.op):
                    differing += at1 != shifted
                else:
                    assert at1 == shifted, (q, t, p.op)
    assert differing > 0  # a first-step forward waits for the previous cycle's update
