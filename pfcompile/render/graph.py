"""The task graph drawn by graphviz `dot`: one cluster per device and step, edges for dependencies.

A device's ops read left to right in execution order (the order of its op list in the
plan; a group in the collapsed view sits at its first op), held there by invisible,
heavily weighted edges between consecutive nodes (and one `group` per row). An input whose producer is not drawn
(another step, device or layer left out by the filter) is a dashed, unfilled stub naming
that producer and where it runs, one per producer (per producer group when collapsed),
so no op is drawn without its inputs.

Large plans (BERT-Large has 144 covered layers: thousands of tasks) are unreadable task by
task, so a collapsed view merges each stage's forward (or backward) of one micro-batch
with its sends and receives, the optimizer's refresh work of one layer (K-FAC: curvature,
factor sync, inversion, broadcast; Shampoo: inverse roots, broadcast), and each stage's
update (gradient sync, the optimizer's per-step work of its layers: K-FAC's
preconditioning, Shampoo's statistics and preconditioning, Muon's orthogonalisation;
optimizer step). When even that is too many nodes for `dot` (its layout time grows much
faster than the node count), the refresh work is grouped per stage instead.
"""

from __future__ import annotations

import shutil
from collections import defaultdict
from dataclasses import dataclass, field

from pfcompile.check.deps import collective_peers, dependencies, planned_times, tasks_of
from pfcompile.formats.errors import InputError
from pfcompile.formats.ops import stage_served
from pfcompile.formats.optimizers import optimizer as optimizer_spec
from pfcompile.formats.plan import Plan, Task
from pfcompile.render.style import GROUPS, color_of, group_of, label_of, legend_groups, optimizer_title, style_of

AUTO_COLLAPSE_ABOVE = 300  # tasks: beyond this `dot` output stops being readable
AUTO_STAGE_ABOVE = 400  # nodes after grouping per layer: beyond this, group the refresh work per stage
COLLAPSE_LEVELS = ("layer", "stage")
ORDER_WEIGHT = "1000"  # holds a device's consecutive ops in one straight row against the dependency edges


@dataclass
class TaskFilter:
    ranks: set[int] | None = None
    steps: set[int] | None = None
    layers: set[int] | None = None

    def keep(self, plan: Plan, task: Task) -> bool:
        if self.ranks is not None and task.rank not in self.ranks:
            return False
        if self.steps is not None and task.step not in self.steps:
            return False
        if self.layers is not None:
            op = task.op
            if op.layer is not None:
                return op.layer in self.layers
            # pipeline work is kept where it feeds the chosen layers: on their stages
            return stage_served(op) in {plan.layer_stage[l] for l in self.layers if l < len(plan.layer_stage)}
        return True


@dataclass
class Node:
    id: str
    rank: int
    step: int
    label: str
    color: str
    start: float
    position: int  # its first op's place in the plan's op lists (rank, step, list order)
    tasks: list[Task] = field(default_factory=list)


def _collapsed_key(task: Task, plan: Plan, level: str) -> tuple:
    """The group a task joins in the collapsed view (its kind letter and index)."""
    op = task.op
    k = op.kind
    if k in ("fwd", "send_act", "recv_act"):  # a receive joins the forward it feeds
        return ("F", stage_served(op), op.mb)
    if k in ("bwd", "bwd_input", "send_grad", "recv_grad"):
        return ("B", stage_served(op), op.mb)
    if k == "bwd_weight":
        return ("W", op.stage, op.mb)
    if k in optimizer_spec(plan.config.optimizer).step_kinds:
        # every step's update, not the refresh's work: keeps the groups acyclic
        return ("U", plan.layer_stage[op.layer])
    if op.layer is not None:
        return ("K", op.layer) if level == "layer" else ("KS", plan.layer_stage[op.layer])
    return ("U", op.stage)


def _collapsed_label(key: tuple, plan: Plan) -> tuple[str, str]:
    kind = key[0]
    if kind == "F":
        return f"F{key[1]}.{key[2]}", GROUPS["fwd"][1]
    if kind == "B":
        return f"B{key[1]}.{key[2]}", GROUPS["bwd"][1]
    if kind == "W":
        return f"W{key[1]}.{key[2]}", GROUPS["bwd_weight"][1]
    title = optimizer_title(plan.config.optimizer)
    if kind == "K":
        return f"{title} {plan.layers[key[1]]}", GROUPS["curv"][1]
    if kind == "KS":
        return f"{title} stage {key[1]}", GROUPS["curv"][1]
    return f"update stage {key[1]}", GROUPS["step"][1]


def _node_key(task: Task, plan: Plan, collapse: str | None) -> tuple:
    """(rank, step, what): one node per task, or per group at level `collapse`."""
    return (task.rank, task.step) + (_collapsed_key(task, plan, collapse) if collapse else (task.op,))


def _node_label(key: tuple, plan: Plan, collapse: str | None) -> tuple[str, str]:
    return _collapsed_label(key[2:], plan) if collapse else (str(key[2]), color_of(key[2].kind))


def build_nodes(plan: Plan, tasks: list[Task], collapse: str | None,
                times: dict[Task, tuple[float, float]] | None = None) -> tuple[list[Node], dict[Task, Node]]:
    """Nodes for the kept tasks (one per task, or per group at level `collapse`), each
    device's and step's in program order, and the map task -> its node. `times`: the
    plan's (start, end) of each task."""
    times = planned_times(plan) if times is None else times
    position = {t: i for i, t in enumerate(tasks_of(plan))}
    nodes: dict[tuple, Node] = {}
    of_task: dict[Task, Node] = {}
    for task in sorted(tasks, key=position.__getitem__):
        key = _node_key(task, plan, collapse)
        node = nodes.get(key)
        if node is None:
            label, color = _node_label(key, plan, collapse)
            node = nodes[key] = Node(f"n{len(nodes)}", task.rank, task.step, label, color, times[task][0],
                                     position[task])
        node.tasks.append(task)
        of_task[task] = node
    for node in nodes.values():
        if collapse and len(node.tasks) > 1:
            node.label += f"\n{len(node.tasks)} ops"
    return list(nodes.values()), of_task


@dataclass
class Stub:
    """A producer that is not drawn, standing in for it at the edges into drawn ops."""
    id: str
    rank: int
    step: int
    name: str
    consumers: set[str] = field(default_factory=set)  # node ids

    def label(self, nodes: dict[str, Node], several_steps: bool) -> str:
        """Its name, and what sets it apart from the ops it feeds: device, step, or neither
        (then the --layers filter left it out). The step is named whenever several are
        drawn, so that no two stubs read alike."""
        where = []
        if any(nodes[c].rank != self.rank for c in self.consumers):
            where.append(f"device {self.rank}")
        if several_steps or any(nodes[c].step != self.step for c in self.consumers):
            where.append(f"step {self.step}")
        return f"{self.name} ({', '.join(where) or 'not drawn'})"


def build_stubs(plan: Plan, all_tasks: list[Task], kept: set[Task], of_task: dict[Task, Node],
                collapse: str | None) -> list[Stub]:
    """One stub per producer outside `kept` (per producer group when collapsed) that a kept
    task depends on, with the nodes it feeds."""
    stubs: dict[tuple, Stub] = {}
    for producer, consumer in dependencies(plan, all_tasks):
        if consumer in kept and producer not in kept:
            key = _node_key(producer, plan, collapse)
            stub = stubs.get(key)
            if stub is None:
                name = _node_label(key, plan, collapse)[0]
                stub = stubs[key] = Stub(f"s{len(stubs)}", producer.rank, producer.step, name)
            stub.consumers.add(of_task[consumer].id)
    return list(stubs.values())


def require_dot() -> None:
    if shutil.which("dot") is None:
        raise InputError("--graph", None, "graphviz's `dot` program is not on PATH: install graphviz "
                                          "(apt-get install graphviz, or brew install graphviz)")


def graph_source(plan: Plan, flt: TaskFilter | None = None, collapse: str | bool | None = None):
    """The graphviz Digraph of the plan's tasks; returns (digraph, nodes, collapse level or None).

    `collapse`: None picks by size; False/None-level draws every task; True or "layer"
    groups the refresh work per layer, "stage" per stage."""
    import graphviz  # noqa: PLC0415 (only this output needs it)

    all_tasks = tasks_of(plan)
    times = planned_times(plan)
    flt = flt or TaskFilter()
    kept = [t for t in all_tasks if flt.keep(plan, t)]
    if not kept:
        raise InputError("--ranks/--steps/--layers", None, "select no task of the plan")
    if collapse is True:
        collapse = "layer"
    if collapse is None:
        collapse = "layer" if len(kept) > AUTO_COLLAPSE_ABOVE else False
        if collapse and len(build_nodes(plan, kept, "layer", times)[0]) > AUTO_STAGE_ABOVE:
            collapse = "stage"
    if collapse and collapse not in COLLAPSE_LEVELS:
        raise ValueError(f"collapse level must be one of {COLLAPSE_LEVELS}, got {collapse!r}")
    collapse = collapse or None
    nodes, of_task = build_nodes(plan, kept, collapse, times)
    kept_keys = set(kept)

    cfg = plan.config
    title = (f"{plan.model.get('name', 'model')}: {cfg.schedule} D={cfg.stages} N={cfg.micro_batches} "
             f"method={cfg.method}" + (f" (collapsed, {optimizer_title(cfg.optimizer)} refresh per {collapse})"
                                       if collapse and optimizer_spec(cfg.optimizer).refreshes
                                       else " (collapsed)" if collapse else ""))
    g = graphviz.Digraph("plan", graph_attr={"rankdir": "LR", "label": title, "labelloc": "t",
                                             "fontname": "Helvetica", "newrank": "true"},
                         node_attr={"shape": "box", "style": "filled,rounded", "fontname": "Helvetica",
                                    "fontsize": "10", "fontcolor": "white"},
                         edge_attr={"color": "#555555", "arrowsize": "0.6"})
    by_cluster: dict[tuple[int, int], list[Node]] = defaultdict(list)
    for node in nodes:  # in program order (build_nodes)
        by_cluster[(node.rank, node.step)].append(node)
    by_id = {n.id: n for n in nodes}
    stubs = build_stubs(plan, all_tasks, kept_keys, of_task, collapse)
    # a stub sits in the innermost cluster holding all the ops it feeds, so it is drawn beside them
    stubs_in: dict[tuple, list[Stub]] = defaultdict(list)  # (rank, step), (rank,) or () for the top
    for stub in stubs:
        fed = {(by_id[c].rank, by_id[c].step) for c in stub.consumers}
        ranks = {r for r, _ in fed}
        where = next(iter(fed)) if len(fed) == 1 else (next(iter(ranks)),) if len(ranks) == 1 else ()
        stubs_in[where].append(stub)

    several_steps = len({n.step for n in nodes}) > 1

    def draw_stubs(where, key: tuple) -> None:
        for stub in stubs_in[key]:
            where.node(stub.id, stub.label(by_id, several_steps), style="dashed,rounded", color="#777777",
                       fontcolor="#333333", _attributes={"class": "stub"})

    for rank in sorted({r for r, _ in by_cluster}):
        with g.subgraph(name=f"cluster_rank{rank}") as dev:
            stages = ", ".join(f"stage {s} (replica {r})" for s, r in plan.stages_of(rank))
            dev.attr(label=f"device {rank}: {stages}", style="rounded", color="#333333")
            for step in sorted(s for r, s in by_cluster if r == rank):
                with dev.subgraph(name=f"cluster_rank{rank}_step{step}") as box:
                    box.attr(label=f"step {step} of {plan.refresh_steps}", style="dashed", color="#999999")
                    for node in by_cluster[(rank, step)]:
                        box.node(node.id, node.label, fillcolor=node.color, group=f"r{rank}s{step}")
                    draw_stubs(box, (rank, step))
            draw_stubs(dev, (rank,))
    draw_stubs(g, ())
    for row in by_cluster.values():  # execution order: each node one column right of the one before
        for a, b in zip(row, row[1:]):
            g.edge(a.id, b.id, style="invis", weight=ORDER_WEIGHT)

    # a dependency against the drawing order (a collapsed group's inputs may come after its
    # first op) does not place nodes: program order wins and the layout stays acyclic
    order = {n.id: (n.start, n.rank, n.step, n.position) for n in nodes}
    edges = set()
    for producer, consumer in dependencies(plan, all_tasks):
        if producer in kept_keys and consumer in kept_keys:
            a, b = of_task[producer], of_task[consumer]
            if a is not b:
                edges.add((a.id, b.id, producer.rank != consumer.rank))
    for a_id, b_id, cross in sorted(edges):
        g.edge(a_id, b_id, **({"color": "#c0392b", "style": "bold"} if cross else {}),
               **({} if order[a_id] < order[b_id] else {"constraint": "false"}))
    for stub in stubs:
        for consumer in sorted(stub.consumers):
            g.edge(stub.id, consumer, style="dashed", color="#777777")
    peers = {(of_task[a].id, of_task[b].id) for a, b in collective_peers(plan, kept)}
    for a_id, b_id in sorted(peers):
        g.edge(a_id, b_id, style="dashed", dir="none", constraint="false", color="#b07aa1")
    _legend(g, plan, {group_of(t.op.kind) for t in kept}, collapse, bool(stubs))
    return g, nodes, collapse


def _legend(g, plan: Plan, groups: set[str], collapse: str | None, stubs: bool) -> None:
    if collapse:
        spec = optimizer_spec(plan.config.optimizer)
        per_step = [label_of(group_of(k)).split(" (")[0] for k in spec.step_kinds]
        rows = [("forward (+ its send/recv)", GROUPS["fwd"][1]), ("backward (+ its send/recv)", GROUPS["bwd"][1]),
                *([(label_of("bwd_weight"), GROUPS["bwd_weight"][1])] if "bwd_weight" in groups else []),
                *([(f"{optimizer_title(plan.config.optimizer)} refresh work of one {collapse}", GROUPS["curv"][1])]
                  if spec.refreshes else []),
                ("update: " + ", ".join(["gradient sync", *per_step, "optimizer step"]), GROUPS["step"][1])]
    else:
        rows = [style_of(gr) for gr in legend_groups(groups)]
    cells = "".join(f'<TR><TD BGCOLOR="{c}" WIDTH="14"> </TD><TD ALIGN="LEFT">{lbl}</TD></TR>' for lbl, c in rows)
    cells += '<TR><TD><FONT COLOR="#c0392b">&#8594;</FONT></TD><TD ALIGN="LEFT">between devices</TD></TR>'
    if stubs:
        cells += ('<TR><TD><FONT COLOR="#777777">&#8674;</FONT></TD>'
                  '<TD ALIGN="LEFT">from an op not drawn (dashed box: it, and its step or device)</TD></TR>')
    g.node("legend", f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0">{cells}</TABLE>>',
           shape="plaintext", style="", fontcolor="black", _attributes={"class": "legend"})


def render_graph(plan: Plan, fmt: str, flt: TaskFilter | None = None, collapse: str | bool | None = None):
    """The picture's bytes plus (node count, collapse level or None); requires `dot`."""
    require_dot()
    g, nodes, collapsed = graph_source(plan, flt, collapse)
    return g.pipe(format=fmt, engine="dot"), len(nodes), collapsed
