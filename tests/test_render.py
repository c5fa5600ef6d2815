"""`pfcompile render`: graph SVG node/edge counts, trace events, timeline pixels, torch CSV.

Plans here are built by a small list-scheduling simulation written in this file (so the
counts can be derived independently, in closed form) and loaded through the real plan
loader; the planner's own plans are used where it is installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import plan_in_process, torch_runtime

from pfcompile.formats.plan import load_plan, plan_from_json
from pfcompile.formats.verify import model_hash
from pfcompile.render import plan_events, render_files
from pfcompile.render.graph import TaskFilter

REPO = Path(__file__).resolve().parents[1]
SVG_NS = "{http://www.w3.org/2000/svg}"
DUR = {"fwd": 1.0, "bwd": 2.0, "curv_a": 0.3, "curv_b": 0.4, "inv": 0.5, "precond": 0.2, "step": 0.1}
P2P_MS = 0.1


# --- a plan built by hand: fixed per-rank compute order, times by simulation -------------

def compute_order(schedule: str, D: int, M: int, v: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per rank: (kind, stage, mb) of its forwards and backwards, in order."""
    orders = []
    for q in range(D):
        if schedule == "gpipe":
            order = [("fwd", q, m) for m in range(M)] + [("bwd", q, m) for m in range(M)]
        elif schedule == "1f1b":
            w = min(D - q - 1, M)
            order = [("fwd", q, m) for m in range(w)]
            for i in range(M - w):
                order += [("fwd", q, w + i), ("bwd", q, i)]
            order += [("bwd", q, m) for m in range(M - w, M)]
        elif schedule == "interleaved":  # breadth-first looped order over the v chunks of a rank
            order = [("fwd", c * D + q, m) for c in range(v) for m in range(M)]
            order += [("bwd", c * D + q, m) for c in reversed(range(v)) for m in range(M)]
        else:
            raise ValueError(schedule)
        orders.append(order)
    return orders


def build_plan(schedule="1f1b", D=2, M=4, v=1, kfac=True, layers_per_stage=2) -> dict:
    S = D * v
    rank_of = lambda s: s % D  # noqa: E731
    layer_stage = [s for s in range(S) for _ in range(layers_per_stage)]
    programs = []
    for q, order in enumerate(compute_order(schedule, D, M, v)):
        prog = []
        for kind, s, m in order:
            if kind == "fwd" and s > 0:
                prog.append({"op": "recv_act", "stage": s - 1, "mb": m, "peer": rank_of(s - 1)})
            if kind == "bwd" and s < S - 1:
                prog.append({"op": "recv_grad", "stage": s + 1, "mb": m, "peer": rank_of(s + 1)})
            prog.append({"op": kind, "stage": s, "mb": m})
            if kfac:
                curv = "curv_a" if kind == "fwd" else "curv_b"
                prog += [{"op": curv, "layer": l, "mb": m} for l, ls in enumerate(layer_stage) if ls == s]
            if kind == "fwd" and s < S - 1:
                prog.append({"op": "send_act", "stage": s, "mb": m, "peer": rank_of(s + 1)})
            if kind == "bwd" and s > 0:
                prog.append({"op": "send_grad", "stage": s, "mb": m, "peer": rank_of(s - 1)})
        for s in range(q, S, D):
            mine = [l for l, ls in enumerate(layer_stage) if ls == s]
            if kfac:
                prog += [{"op": "inv", "layer": l, "factor": f} for l in mine for f in "AB"]
                prog += [{"op": "precond", "layer": l} for l in mine]
            prog.append({"op": "step", "stage": s})
        programs.append(prog)

    # list scheduling: a receive waits for its send, everything else for its rank
    sent: dict[tuple, float] = {}
    clock, pos = [0.0] * D, [0] * D
    while any(pos[q] < len(programs[q]) for q in range(D)):
        progress = False
        for q in range(D):
            while pos[q] < len(programs[q]):
                op = programs[q][pos[q]]
                start = clock[q]
                if op["op"].startswith("recv"):
                    key = (op["op"][5:], op["stage"], op["mb"])
                    if key not in sent:
                        break
                    start = max(start, sent[key])
                dur = P2P_MS if "send" in op["op"] or "recv" in op["op"] else DUR[op["op"]]
                op["start"], op["end"] = start, start + dur
                if op["op"].startswith("send"):
                    sent[(op["op"][5:], op["stage"], op["mb"])] = op["end"]
                clock[q] = op["end"]
                pos[q] += 1
                progress = True
        assert progress, "test schedule deadlocks"
    return {
        "schema": "pfcompile-plan", "schema_version": 1,
        "config": {"schedule": schedule, "stages": D, "virtual_stages": v, "micro_batches": M, "replicas": 1,
                   "world_size": D, "method": "none", "kfac": kfac, "refresh_steps": 1},
        "model": {"name": "tests:toy", "micro_batch": 1, "seq_len": 1},  # user code: parts of its own
        "partition": [[f"block{s}"] for s in range(S)],
        "layers": [f"block{s}.fc{i}" for s in range(S) for i in range(layers_per_stage)],
        "layer_stage": layer_stage,
        "placement": [{"stage": s, "replica": 0, "rank": rank_of(s)} for s in range(S)],
        "micro_batch_replica": [0] * M,
        "ranks": [{"rank": q, "steps": [programs[q]]} for q in range(D)],
        "stats": {"step_time_ms": max(clock)},
        "profile": {"hash": "", "model_hash": model_hash({"name": "tests:toy", "micro_batch": 1, "seq_len": 1}, "")},
    }


def write_plan(tmp_path, obj, name="plan.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return p


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pfcompile", "render", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def svg_groups(path: Path, cls: str) -> list[ET.Element]:
    root = ET.parse(path).getroot()
    return [g for g in root.iter(f"{SVG_NS}g") if g.get("class") == cls]


# --- graph ---------------------------------------------------------------------------------

@pytest.mark.e2e
def test_graph_has_one_node_per_task_and_the_closed_form_edges(tmp_path):
    D, M = 2, 4
    plan = plan_from_json(build_plan("1f1b", D, M, kfac=False))
    out = tmp_path / "g.svg"
    done = render_files(plan, graph=str(out), collapse=False)
    n_tasks = sum(len(ops) for steps in plan.ranks for ops in steps)
    nodes = svg_groups(out, "node")
    assert len(nodes) == n_tasks == done["graph"]["nodes"]
    # per micro-batch: F0->SA, SA->RA, RA->F1, F1->B1, B1->SG, SG->RG, RG->B0, F0->B0;
    # per stage: its step after each of the M backwards
    assert len(svg_groups(out, "edge")) == 8 * M + D * M
    titles = {n.find(f"{SVG_NS}text").text for n in nodes}
    assert {"F0.0", "SA0.0>1", "RA0.0<0", "B1.3", "U0", "U1"} <= titles
    assert len(svg_groups(out, "cluster")) == 2 * D  # a device cluster holding a step cluster each


@pytest.mark.e2e
def test_collapsed_graph_has_one_node_per_stage_microbatch_and_layer(tmp_path):
    D, M, L = 2, 3, 2
    plan = plan_from_json(build_plan("1f1b", D, M, kfac=True, layers_per_stage=L))
    out = tmp_path / "g.svg"
    done = render_files(plan, graph=str(out), collapse=True)
    # forward and backward groups per (stage, mb), one K-FAC group per layer, one update
    # (its preconditioning + step) per stage
    assert len(svg_groups(out, "node")) == 2 * D * M + D * L + D == done["graph"]["nodes"]
    done = render_files(plan, graph=str(out), collapse="stage")
    assert len(svg_groups(out, "node")) == 2 * D * M + D + D == done["graph"]["nodes"]


@pytest.mark.e2e
def test_filters_keep_only_the_chosen_device_and_layers(tmp_path):
    plan = plan_from_json(build_plan("1f1b", 2, 4, kfac=True))
    out = tmp_path / "g.svg"
    render_files(plan, graph=str(out), graph_filter=TaskFilter(ranks={1}), collapse=False)
    assert len(svg_groups(out, "node")) == len(plan.ranks[1][0])
    render_files(plan, graph=str(out), graph_filter=TaskFilter(layers={0}), collapse=False)
    # layer 0 lives on stage 0, alone on rank 0: all of rank 0's ops but those of layer 1
    expected = [p for p in plan.ranks[0][0] if p.op.layer in (None, 0)]
    assert len(svg_groups(out, "node")) == len(expected)


@pytest.mark.e2e
def test_large_plan_is_collapsed_automatically_and_says_so(tmp_path):
    plan_path = write_plan(tmp_path, build_plan("1f1b", 4, 8, kfac=True, layers_per_stage=4))
    assert sum(len(s[0]) for s in load_plan(str(plan_path)).ranks) > 300
    r = cli(plan_path, "--graph", tmp_path / "g.svg", "--json")
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout)
    assert done["graph"]["collapsed"] == "layer"
    assert any("collapsed automatically" in n for n in done["notes"])
    assert len(svg_groups(tmp_path / "g.svg", "node")) == 2 * 4 * 8 + 16 + 4


# --- graph: program order and stubs, on a K-FAC plan made by the planner -----------------------

@pytest.fixture(scope="module")
def kfac_plan(tmp_path_factory):
    """The planner's 1f1b plan of bert-tiny on 2 devices: its refresh spans several steps."""
    path = tmp_path_factory.mktemp("kfac") / "plan.json"
    plan_in_process(REPO / "profiles/bert-tiny-cpu.json", "--schedule", "1f1b", "--stages", 2, "--micro-batches", 4,
                    "-o", path)
    plan = load_plan(str(path))
    assert plan.refresh_steps >= 2
    return plan


DOT_NODE = re.compile(r'^\t+(\w+) \[label=("(?:[^"\\]|\\.)*"|[^ \]]+)([^\]]*)\]$', re.M)  # labels span lines
DOT_EDGE = re.compile(r"^\t+(\w+) -> (\w+)(?: \[(.*)\])?$", re.M)


def dot_parts(source: str):
    """(labels by node id, stub node ids, [(tail, head, attributes)]) of graphviz source."""
    labels = {m[1]: m[2].strip('"') for m in DOT_NODE.finditer(source)}
    stubs = {m[1] for m in DOT_NODE.finditer(source) if "class=stub" in m[3]}
    edges = [(m[1], m[2], m[3] or "") for m in DOT_EDGE.finditer(source)]
    return labels, stubs, edges


def order_chains(edges) -> list[list[str]]:
    """The node ids linked by the invisible order edges, as chains from first to last."""
    nxt = {a: b for a, b, attrs in edges if "style=invis" in attrs}
    assert len(nxt) == len({a for a, b, attrs in edges if "style=invis" in attrs}), "an order edge forks"
    chains = []
    for first in set(nxt) - set(nxt.values()):
        chain = [first]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        chains.append(chain)
    return chains


@pytest.mark.e2e
@pytest.mark.parametrize("collapse", [False, "layer", "stage"])
def test_graph_draws_each_devices_ops_in_the_plans_order(kfac_plan, collapse):
    from pfcompile.render.graph import graph_source

    plan = kfac_plan
    g, nodes, _ = graph_source(plan, collapse=collapse)
    labels, _, edges = dot_parts(g.source)
    chains = order_chains(edges)
    node_of = {n.id: n for n in nodes}
    for q, steps in enumerate(plan.ranks):
        for t, ops in enumerate(steps):
            cluster = {n.id for n in nodes if (n.rank, n.step) == (q, t)}
            chain = next((c for c in chains if c[0] in cluster), [])
            assert set(chain) == cluster  # one chain through all of the device's ops of the step
            listed = [str(p.op) for p in ops]
            if not collapse:
                assert [labels[i] for i in chain] == listed
            else:  # a group sits where its first op is listed
                first = [min(listed.index(str(task.op)) for task in node_of[i].tasks) for i in chain]
                assert first == sorted(first) and len(set(first)) == len(first)


@pytest.mark.e2e
@pytest.mark.parametrize("collapse", [False, "layer"])
def test_inputs_from_another_step_or_device_are_labelled_stubs(kfac_plan, collapse):
    from pfcompile.render.graph import graph_source

    plan = kfac_plan
    g, nodes, _ = graph_source(plan, TaskFilter(steps={1}), collapse=collapse)
    labels, stubs, edges = dot_parts(g.source)
    assert len({labels[s] for s in stubs}) == len(stubs)  # one stub per producer
    fed_by = {(a, b) for a, b, attrs in edges if "style=invis" not in attrs}
    # curvature of step 1 reads the activations (A) or output gradients (B) of step 0's pass
    checked = 0
    for node in nodes:
        for task in node.tasks:
            if task.op.kind in ("curv_a", "curv_b"):
                pass_ = "F" if task.op.kind == "curv_a" else "B"
                producer = f"{pass_}{plan.layer_stage[task.op.layer]}.{task.op.mb} (step 0)"
                assert any(labels[s] == producer and (s, node.id) in fed_by for s in stubs), (task, producer)
                checked += 1
    assert checked >= 4
    # a stub is drawn dashed, without fill, and feeds only ops that are drawn
    assert all(re.search(rf'\t{s} \[.*style="dashed,rounded"', g.source) for s in stubs)
    assert not re.search(r"\ts\d+ \[.*fillcolor", g.source)
    assert all(b in labels and b not in stubs for a, b in fed_by if a in stubs)

    # the other device left out: each receive is fed by a stub naming the send on device 0
    g, nodes, _ = graph_source(plan, TaskFilter(ranks={1}, steps={1}), collapse=False)
    labels, stubs, edges = dot_parts(g.source)
    receives = [n for n in nodes if n.tasks[0].op.kind == "recv_act"]
    assert receives
    for node in receives:
        op = node.tasks[0].op
        send = f"SA{op.stage}.{op.mb}>1 (device 0)"
        assert any(labels[a] == send and b == node.id for a, b, _ in edges if a in stubs)


@pytest.mark.e2e
def test_dot_lays_a_device_step_out_left_to_right_in_program_order(kfac_plan, tmp_path):
    from pfcompile.render.graph import graph_source, render_graph

    plan = kfac_plan
    data, n_nodes, collapsed = render_graph(plan, "svg", TaskFilter(steps={1}), collapse=False)
    assert collapsed is None
    out = tmp_path / "g.svg"
    out.write_bytes(data)
    root = ET.parse(out).getroot()
    x_of, stub_labels = {}, []
    for grp in root.iter(f"{SVG_NS}g"):
        if grp.get("class") in ("node", "node stub"):
            x_of[grp.find(f"{SVG_NS}title").text] = float(grp.find(f"{SVG_NS}text").get("x"))
        if grp.get("class") == "node stub":
            stub_labels.append(grp.find(f"{SVG_NS}text").text)
    _, nodes, _ = graph_source(plan, TaskFilter(steps={1}), collapse=False)
    assert n_nodes == len(nodes) == sum(len(steps[1]) for steps in plan.ranks)
    for q in range(plan.world_size):
        row = [x_of[n.id] for n in nodes if n.rank == q]
        assert [str(n.tasks[0].op) for n in nodes if n.rank == q] == [str(p.op) for p in plan.ranks[q][1]]
        assert all(a < b for a, b in zip(row, row[1:])), f"device {q}'s ops are not left to right"
    assert stub_labels and all(lbl.endswith("(step 0)") for lbl in stub_labels)
    assert "U0 (step 0)" in stub_labels  # the forwards wait on the previous step's update


# --- trace ---------------------------------------------------------------------------------

@pytest.mark.e2e
def test_trace_has_one_complete_event_per_op_with_the_plans_durations(tmp_path):
    plan_path = write_plan(tmp_path, build_plan("1f1b", 2, 4, kfac=True))
    plan = load_plan(str(plan_path))
    out = tmp_path / "t.json"
    r = cli(plan_path, "--trace", out)
    assert r.returncode == 0, r.stderr
    events = json.loads(out.read_text())["traceEvents"]
    ops = [e for e in events if e["ph"] == "X"]
    planned = [(q, p) for q, steps in enumerate(plan.ranks) for p in steps[0]]
    assert len(ops) == len(planned)
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= e.keys()
    for e, (q, p) in zip(ops, planned):
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert e["pid"] == q and e["name"] == str(p.op)
        assert e["ts"] == pytest.approx(p.start * 1000) and e["dur"] == pytest.approx((p.end - p.start) * 1000)
        assert e["args"]["step"] == 0 and e["args"]["op"] == p.op.kind
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    streams = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert streams == {"compute", "p2p"}


# --- timeline ------------------------------------------------------------------------------

@pytest.mark.e2e
def test_timeline_png_shows_forward_backward_and_kfac_colours(tmp_path):
    import numpy as np
    from matplotlib import image

    plan = plan_from_json(build_plan("1f1b", 2, 4, kfac=True))
    render_files(plan, timeline=str(tmp_path / "t.png"), trace=None)
    render_files(plan, timeline=str(tmp_path / "t.svg"))
    ET.parse(tmp_path / "t.svg")  # well-formed
    px = (image.imread(tmp_path / "t.png")[..., :3] * 255).round().astype(int)

    def share(hex_colour):
        rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
        return (np.abs(px - rgb).sum(-1) <= 6).mean()

    from pfcompile.render.style import GROUPS
    fwd, bwd, curv = share(GROUPS["fwd"][1]), share(GROUPS["bwd"][1]), share(GROUPS["curv"][1])
    assert fwd > 0.005 and curv > 0.001
    assert bwd > 1.3 * fwd  # backward takes twice as long as forward in this plan


# --- errors --------------------------------------------------------------------------------

@pytest.mark.e2e
def test_malformed_plan_is_a_one_line_error_and_writes_nothing(tmp_path):
    bad = build_plan("1f1b", 2, 2)
    bad["ranks"][1]["steps"][0][0]["op"] = "fwdd"
    plan_path = write_plan(tmp_path, bad)
    r = cli(plan_path, "--trace", tmp_path / "t.json", "--timeline", tmp_path / "t.png")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(plan_path) in lines[0] and "ranks[1].steps[0][0]" in lines[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "t.png").exists()


@pytest.mark.e2e
def test_bad_output_name_is_rejected_before_anything_is_written(tmp_path):
    plan_path = write_plan(tmp_path, build_plan("1f1b", 2, 2))
    r = cli(plan_path, "--trace", tmp_path / "t.json", "--timeline", tmp_path / "t.gif")
    assert r.returncode == 2 and "--timeline" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.json").exists()
    assert cli(plan_path).returncode == 2  # nothing asked for


@pytest.mark.e2e
def test_missing_dot_says_how_to_install_graphviz(tmp_path):
    plan_path = write_plan(tmp_path, build_plan("1f1b", 2, 2))
    no_dot = tmp_path / "bin"
    no_dot.mkdir()
    env = {**os.environ, "PATH": str(no_dot)}
    r = cli(plan_path, "--trace", tmp_path / "t.json", "--graph", tmp_path / "g.svg", env=env)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "dot" in lines[0] and "apt-get install graphviz" in lines[0]
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "g.svg").exists()


# --- torch.distributed.pipelining CSV --------------------------------------------------------



@pytest.mark.e2e
@pytest.mark.parametrize("schedule,D,M,v", [("gpipe", 2, 4, 1), ("1f1b", 4, 6, 1), ("interleaved", 2, 4, 2)])
def test_torch_csv_loads_and_validates_in_torch(tmp_path, schedule, D, M, v):
    from torch.distributed.pipelining.schedules import _simulate_comms_compute

    plan_path = write_plan(tmp_path, build_plan(schedule, D, M, v, kfac=True))
    out = tmp_path / "order.csv"
    r = cli(plan_path, "--torch-csv", out)
    assert r.returncode == 0, r.stderr
    assert "left out: K-FAC ops" in r.stderr
    text = out.read_text()
    assert not re.search(r"C[AB]|inv|precond", text)

    sched = torch_runtime(D * v, D, M)
    sched._load_csv(str(out), format="compute_comms")  # runs torch's _validate_schedule
    assert sched.stage_index_to_group_rank == {s: s % D for s in range(D * v)}
    rows = [line.split(",") for line in text.strip().splitlines()]
    assert [[str(a) for a in sched.pipeline_order_with_comms[q]] for q in range(D)] == rows
    plan = load_plan(str(plan_path))
    for q in range(D):  # the plan's pipeline order, action by action
        assert len(rows[q]) == sum(p.op.kind in ("fwd", "bwd") or p.op.is_p2p for p in plan.ranks[q][0])
    simulated = _simulate_comms_compute(sched.pipeline_order_with_comms,
                                        lambda s: sched.stage_index_to_group_rank[s], D * v)
    assert sum(a is not None for row in simulated.values() for a in row) == sum(map(len, rows))

    # the compute-only form goes through torch's own send/recv lowering
    r = cli(plan_path, "--torch-csv", tmp_path / "c.csv", "--torch-csv-format", "compute_only")
    assert r.returncode == 0, r.stderr
    sched = torch_runtime(D * v, D, M)
    sched._load_csv(str(tmp_path / "c.csv"))  # raises if torch cannot place the send/recvs
    # torch's simulator knows compute and p2p only; drop the FSDP/grad-reduce markers it lowered in
    lowered = {q: [a for a in row if "SHARD" not in str(a) and "REDUCE" not in str(a)]
               for q, row in sched.pipeline_order_with_comms.items()}
    assert [len(lowered[q]) for q in range(D)] == [len(row) for row in rows]
    _simulate_comms_compute(lowered, lambda s: sched.stage_index_to_group_rank[s], D * v)


def test_torch_csv_rejects_a_plan_order_torch_cannot_run(tmp_path):
    """The check has teeth: a backward before its forward fails torch's validation."""
    obj = build_plan("gpipe", 2, 2, kfac=False)
    prog = obj["ranks"][0]["steps"][0]
    f_idx = next(i for i, o in enumerate(prog) if o["op"] == "fwd" and o["mb"] == 1)
    b_idx = next(i for i, o in enumerate(prog) if o["op"] == "bwd" and o["mb"] == 1)
    prog[f_idx], prog[b_idx] = prog[b_idx], prog[f_idx]
    plan = plan_from_json(obj)
    render_files(plan, torch_csv=str(tmp_path / "o.csv"))
    with pytest.raises(AssertionError, match="without first running Forward"):
        torch_runtime(2, 2, 2)._load_csv(str(tmp_path / "o.csv"), format="compute_comms")


def test_plan_events_carry_op_fields():
    plan = plan_from_json(build_plan("1f1b", 2, 2, kfac=True))
    ev = next(e for e in plan_events(plan) if e.name == "CA0.1")
    assert ev.stream == "compute" and ev.args["layer"] == 0 and ev.args["mb"] == 1 and ev.args["work"] == "curvature"


def test_dependencies_follow_the_op_vocabulary_across_the_refresh_cycle():
    from pfcompile.check.deps import dependencies

    obj = build_plan("1f1b", 2, 2, kfac=True)
    obj["config"]["refresh_steps"] = 2
    for r in obj["ranks"]:  # step 1 repeats the pipeline; layer 0's curvature and the inversions move there
        step0 = r["steps"][0]
        shift = max(o["end"] for o in step0)
        moved = lambda o: (o["op"] == "curv_a" and o["layer"] == 0) or o["op"] == "inv"  # noqa: E731
        step1 = [{**o, "start": o["start"] + shift, "end": o["end"] + shift} for o in step0
                 if not o["op"].startswith("curv") or moved(o)]
        r["steps"] = [[o for o in step0 if not moved(o)], step1]
    plan = plan_from_json(obj)
    deps = {(str(a.op), a.step, str(b.op), b.step) for a, b in dependencies(plan)}
    of = lambda op, step: {(p, ps) for p, ps, c, cs in deps if (c, cs) == (op, step)}  # noqa: E731
    assert of("CA0.1", 1) == {("F0.1", 0)}  # curvature is of step 0's micro-batches
    assert of("I0.A", 1) == {("CA0.0", 1), ("CA0.1", 1), ("CB0.0", 0), ("CB0.1", 0)}  # both factors
    assert of("F1.1", 1) == {("RA0.1<0", 1), ("U1", 0)} and of("RA0.1<0", 1) == {("SA0.1>1", 1)}
    assert of("F1.0", 0) == {("RA0.0<0", 0)}  # the previous step's update is in the previous cycle
    assert of("B0.0", 0) == {("F0.0", 0), ("RG1.0<1", 0)}
    assert of("U0", 1) == {("P0", 1), ("P1", 1)} and of("P0", 1) == {("B0.0", 1), ("B0.1", 1)}


# --- plans made by the planner ----------------------------------------------------------------

PLANNER_CASES = {  # small configurations of each schedule family on the bert-base reference profile
    "gpipe": ["--schedule", "gpipe", "--stages", "2", "--micro-batches", "4"],
    "1f1b": ["--schedule", "1f1b", "--stages", "4", "--micro-batches", "4"],
    "interleaved": ["--schedule", "interleaved", "--stages", "2", "--virtual-stages", "2", "--micro-batches", "4"],
    "chimera": ["--schedule", "chimera", "--stages", "4", "--micro-batches", "4"],
}


@pytest.mark.e2e
@pytest.mark.parametrize("family", list(PLANNER_CASES))
def test_planner_plans_render_and_load_in_torch(tmp_path, family):
    from torch.distributed.pipelining.schedules import _simulate_comms_compute

    plan_path = tmp_path / "plan.json"
    plan_in_process(REPO / "profiles/bert-base-p100-ref.json", *PLANNER_CASES[family], "--method", "greedy",
                    "-o", plan_path)
    plan = load_plan(str(plan_path))
    r = cli(plan_path, "--torch-csv", tmp_path / "o.csv", "--trace", tmp_path / "t.json",
            "--graph", tmp_path / "g.svg", "--steps", "0", "--collapse", "--json")
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout)

    # trace: every op of the cycle, with the plan's durations
    ops = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    planned = [p for steps in plan.ranks for ops_ in steps for p in ops_]
    assert len(ops) == len(planned) == plan.stats["tasks"]
    assert sorted(e["dur"] for e in ops) == pytest.approx(sorted((p.end - p.start) * 1000 for p in planned))

    # graph of step 0, per layer: each forward/backward with its messages, K-FAC per layer, update per stage
    step0 = [(q, p.op) for q, steps in enumerate(plan.ranks) for p in steps[0]]
    refresh_work = {(q, op.layer) for q, op in step0 if op.layer is not None and op.kind != "precond"}
    updates = {(q, op.stage if op.layer is None else plan.layer_stage[op.layer])
               for q, op in step0 if op.kind in ("sync_grad", "precond", "step")}
    groups = sum(op.kind in ("fwd", "bwd") for _, op in step0) + len(refresh_work) + len(updates)
    assert len(svg_groups(tmp_path / "g.svg", "node")) == groups == done["graph"]["nodes"]
    # members of one collective (factor and gradient all-reduce) are linked across devices:
    # only plans with replicated stages have collectives
    dashed = [e for e in svg_groups(tmp_path / "g.svg", "edge")
              if e.find(f"{SVG_NS}path").get("stroke-dasharray")]
    assert bool(dashed) == (len(replicas := sorted({p["replica"] for p in plan.placement})) > 1)

    # torch: one CSV per replica pipeline, each loads, validates and simulates without deadlock
    assert len(done["torch_csv"]["paths"]) == len(replicas)
    S = plan.num_stages
    for replica, path in zip(replicas, done["torch_csv"]["paths"]):
        ranks = sorted({p["rank"] for p in plan.placement if p["replica"] == replica})
        n_mb = plan.micro_batch_replica.count(replica)
        sched = torch_runtime(S, len(ranks), n_mb)
        sched._load_csv(path, format="compute_comms")
        assert {s: ranks[g] for s, g in sched.stage_index_to_group_rank.items()} == \
            {p["stage"]: p["rank"] for p in plan.placement if p["replica"] == replica}
        _simulate_comms_compute(sched.pipeline_order_with_comms, sched.stage_index_to_group_rank.__getitem__, S)


@pytest.mark.e2e
def test_a_filter_that_selects_nothing_fails_before_any_output(tmp_path):
    plan_path = write_plan(tmp_path, build_plan("1f1b", 2, 2))
    r = cli(plan_path, "--trace", tmp_path / "t.json", "--graph", tmp_path / "g.svg", "--ranks", "5")
    # rank 5 of a 2-rank plan: refused by name before anything is drawn
    assert r.returncode == 2 and "--ranks: 5 is not in the plan, which has 2 ranks" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.json").exists()


# --- Shampoo's and Muon's work: named in inspect, drawn in its colours -------------------------

OPTIMIZER_TEXT = {"shampoo": (r"ST\d+", r"I\d+\.L", r"I\d+\.R", r"P\d+"), "muon": (r"O\d+",)}
OPTIMIZER_GROUPS = {"shampoo": ("stats", "inv", "precond"), "muon": ("orth",)}


@pytest.mark.e2e
@pytest.mark.parametrize("optimizer", list(OPTIMIZER_TEXT))
def test_shampoo_and_muon_plans_show_their_ops_in_inspect_timeline_and_graph(tmp_path, optimizer):
    import numpy as np
    from matplotlib import image

    from pfcompile.render.style import GROUPS

    plan_path = tmp_path / "plan.json"
    plan_in_process(REPO / "profiles/bert-base-p100-ref.json", "--schedule", "chimera", "--stages", 4,
                    "--micro-batches", 4, "--optimizer", optimizer, "--method", "greedy", "-o", plan_path)
    plan = load_plan(str(plan_path))

    # inspect: the header names the optimizer; the op lists hold every op of its work, in text form
    shown = subprocess.run([sys.executable, "-m", "pfcompile", "inspect", str(plan_path)], capture_output=True,
                           text=True, cwd=REPO, timeout=120)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert f"optimizer={optimizer}" in lines[0]
    tokens = [tok for line in lines if line.startswith("rank ") for tok in line.split(": ", 1)[1].split()]
    work = [str(p.op) for steps in plan.ranks for ops in steps for p in ops if p.op.kind in OPTIMIZER_GROUPS[optimizer]]
    assert work and sorted(t for t in tokens if t in set(work)) == sorted(work)
    for form in OPTIMIZER_TEXT[optimizer]:
        assert any(re.fullmatch(form, t) for t in tokens), form

    # render: the timeline's legend strip (the bottom of the picture) carries each kind's colour;
    # the collapsed graph puts the per-step work into the stage's update and names the optimizer
    r = cli(plan_path, "--timeline", tmp_path / "t.png", "--graph", tmp_path / "g.svg", "--collapse", "--json")
    assert r.returncode == 0, r.stderr
    px = (image.imread(tmp_path / "t.png")[..., :3] * 255).round().astype(int)
    legend_strip = px[-30:]
    for group in OPTIMIZER_GROUPS[optimizer]:
        rgb = np.array([int(GROUPS[group][1][i:i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(legend_strip - rgb).sum(-1) <= 6).sum() > 20, group
        assert (np.abs(px[:-30] - rgb).sum(-1) <= 6).sum() > 20, group  # and in the bars
    text = " ".join(t.text or "" for t in ET.parse(tmp_path / "g.svg").getroot().iter(f"{SVG_NS}text"))
    assert "K-FAC" not in text
    if optimizer == "shampoo":
        assert "update: gradient sync, statistics, preconditioning, optimizer step" in text
        assert f"Shampoo {plan.layers[0]}" in text and "Shampoo refresh work of one layer" in text
    else:
        assert "update: gradient sync, orthogonalisation, optimizer step" in text
        assert "refresh" not in text and f"Muon {plan.layers[0]}" not in text
