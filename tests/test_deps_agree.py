"""The dependencies of the optimizers' ops: derived once from their declarations' reads and
writes (pfcompile.formats.dataflow), checked here against a closed list of what each op
waits for; then the two places that turn them into ops, the task graph the planners place
(pfcompile.graph.taskgraph) and the rules the verifier and the replay apply
(pfcompile.formats.rules, through pfcompile.check.deps), must agree edge for edge on every
family, for every optimizer (K-FAC, Shampoo, Muon, AdamW), with each layer's work on every
replica and divided between them.

A collective is compared as one unit: the graph makes each member wait for every replica's
producers, the replay makes each member wait for its own and then for the rendezvous; both
mean "the collective starts when all members' producers are done"."""

import pytest
from helpers import uniform_profile

from pfcompile.check.deps import PlanLayout, op_dependencies
from pfcompile.formats.dataflow import producers
from pfcompile.formats.optimizers import OPTIMIZERS as DECLARATIONS
from pfcompile.formats.optimizers import optimizer as declaration
from pfcompile.formats.plan import task_at
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.graph.taskgraph import build_task_graph
from pfcompile.place import assemble


def _text(p) -> str:
    """A producer as `kind[.factor][@0][ per mb][ on source] (name)`."""
    return (p.kind + (f".{p.factor}" if p.factor else "") + ("@0" if p.first_step else "")
            + (" per mb" if p.every_micro_batch else "") + (" on source" if p.on_source else "") + f" ({p.name})")


# (optimizer, op kind, the op's factor, the stage has replicas) -> what the op waits for, in
# order; every op of every declaration is listed (the test fails on one missing)
EXPECTED = {
    ("kfac", "curv_a", None, False): ["fwd@0 (input)"],
    ("kfac", "curv_b", None, False): ["wgrad@0 (output_grad)"],
    ("kfac", "sync_curv", "A", True): ["curv_a per mb (stat:A)"],
    ("kfac", "sync_curv", "B", True): ["curv_b per mb (stat:B)"],
    # both factors (the pi-corrected damping): their reductions, or every micro-batch's statistics
    ("kfac", "inv", "A", False): ["curv_a per mb (stat:A)", "curv_b per mb (stat:B)"],
    ("kfac", "inv", "B", True): ["sync_curv.A (stat:A)", "sync_curv.B (stat:B)"],
    ("kfac", "bcast_inv", "A", True): ["inv.A on source (root:A)"],
    # the roots it reads are the previous cycle's, in force: no dependency
    ("kfac", "precond", None, False): ["gradient (grad)"],
    ("kfac", "precond", None, True): ["gradient (grad)"],
    ("shampoo", "stats", None, True): ["gradient (grad)"],
    ("shampoo", "inv", "L", False): ["stats@0 (stat:L@0)"],
    ("shampoo", "inv", "R", True): ["stats@0 (stat:R@0)"],
    ("shampoo", "bcast_inv", "R", True): ["inv.R on source (root:R)"],
    # it overwrites the gradient that the statistics read (and waits for the gradient through them)
    ("shampoo", "precond", None, True): ["stats (grad)"],
    # SOAP's work flows as Shampoo's; its moments are its own previous step's
    ("soap", "stats", None, True): ["gradient (grad)"],
    ("soap", "inv", "L", False): ["stats@0 (stat:L@0)"],
    ("soap", "bcast_inv", "L", True): ["inv.L on source (root:L)"],
    ("soap", "precond", None, True): ["stats (grad)"],
    # its momentum is its own previous step's
    ("muon", "orth", None, True): ["gradient (grad)"],
    # deferred statistics fold the gradient the previous step's update kept: they wait for
    # nothing of their step; the update waits for them (it overwrites what they read)
    ("shampoo+defer", "stats", None, True): [],
    ("shampoo+defer", "inv", "L", False): ["stats@0 (stat:L@0)"],
    ("shampoo+defer", "bcast_inv", "L", True): ["inv.L on source (root:L)"],
    ("shampoo+defer", "precond", None, True): ["gradient (grad)", "stats (kept_grad)"],
    ("soap+defer", "stats", None, False): [],
    ("soap+defer", "inv", "R", True): ["stats@0 (stat:R@0)"],
    ("soap+defer", "bcast_inv", "R", True): ["inv.R on source (root:R)"],
    ("soap+defer", "precond", None, False): ["gradient (grad)", "stats (kept_grad)"],
}


def _declaration(name: str):
    """A built-in declaration, or with "+defer" its deferred-statistics variant."""
    base, _, defer = name.partition("+")
    return declaration(base, defer_stats=bool(defer))


@pytest.mark.parametrize("key", EXPECTED, ids=lambda k: "-".join(map(str, k)))
def test_each_declared_op_waits_for_what_its_reads_and_writes_say(key):
    name, kind, factor, replicas = key
    assert [_text(p) for p in producers(_declaration(name), kind, factor, replicas=replicas)] == EXPECTED[key]


def test_the_list_covers_every_declared_op():
    declared = {(o.name, d.kind) for o in DECLARATIONS.values() for d in o.ops}
    declared |= {(o.name + "+defer", d.kind) for o in DECLARATIONS.values() if o.can_defer_stats for d in o.ops}
    assert declared == {(name, kind) for name, kind, _, _ in EXPECTED}


def test_a_name_nothing_writes_is_refused():
    """A misspelt read would otherwise wait for nothing."""
    from dataclasses import replace

    from pfcompile.formats.optimizers import MUON, STEP, OpDecl

    typo = replace(MUON, name="muon-typo", ops=(OpDecl("orth", STEP, reads=("grads",), writes=("grad",)),))
    with pytest.raises(ValueError, match="muon-typo.*orth reads 'grads', which nothing writes"):
        producers(typo, "orth", replicas=False)


CASES = [
    ("gpipe", dict(stages=2, micro_batches=3)),
    ("gpipe", dict(stages=2, micro_batches=4, replicas=2)),
    ("1f1b", dict(stages=4, micro_batches=5)),
    ("zb-h1", dict(stages=2, micro_batches=4, replicas=2)),
    ("1f1b", dict(stages=2, micro_batches=4, replicas=2)),
    ("interleaved", dict(stages=2, micro_batches=4, virtual_stages=2)),
    ("chimera", dict(stages=4, micro_batches=4)),
    ("zb-h1", dict(stages=4, micro_batches=5)),
    ("zb-v", dict(stages=2, micro_batches=4)),
    ("dualpipev", dict(stages=2, micro_batches=5)),
]


OPTIMIZERS = ("kfac", "shampoo", "soap", "muon", "adamw")


def _profile():
    """The uniform profile with Shampoo's, SOAP's and Muon's per-layer costs too."""
    prof = uniform_profile(blocks=4)
    for layer in prof.covered_layers:
        layer.optimizer_ms.update({"shampoo": {"stats": 0.04, "inv_L": 0.3, "inv_R": 0.2, "precond": 0.05},
                                   "soap": {"stats": 0.04, "inv_L": 0.3, "inv_R": 0.2, "precond": 0.1},
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
         if (kw.get("replicas", 1) > 1 or schedule == "chimera") and opt != "adamw"] + \
        [(schedule, kw, opt + "+defer", precond) for schedule, kw in CASES if schedule in ("1f1b", "chimera", "zb-v")
         for opt in ("shampoo", "soap") for precond in (("all", "layers") if schedule == "chimera" else ("all",))]


@pytest.mark.parametrize("schedule,kw,optimizer,precond", AGREE)
def test_graph_and_replay_dependency_rules_agree(schedule, kw, optimizer, precond):
    prof = _profile()
    optimizer, _, defer = optimizer.partition("+")
    cfg = PipelineConfig(schedule, refresh_steps=1 if optimizer == "muon" else 2, optimizer=optimizer,
                         precond=precond, defer_stats=bool(defer), **kw)
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
