"""Plans for a cluster of nodes: messages and collectives costed by the link they cross,
and a placement of the family's ranks that keeps the heaviest traffic inside nodes."""

import json

import pytest
from helpers import assert_same_params, distributed_params, reference_params, torchrun

from pfcompile.check.replay import replay
from pfcompile.formats.errors import InputError
from pfcompile.formats.plan import plan_from_json
from pfcompile.formats.profile import Cluster, LinkModel, load_profile
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.graph.taskgraph import build_task_graph
from pfcompile.place.build import build_plan
from pfcompile.place.options import PlanOptions
from pfcompile.place.topology import choose_rank_map, crossing_ms, traffic

PAPER = "profiles/bert-large-p100-ref.json"


@pytest.fixture(scope="module")
def paper():
    return load_profile(PAPER)


def _cluster(prof, nodes, gpus, slower=10.0):
    intra = prof.comm.p2p
    inter = LinkModel(intra.latency_ms * slower, intra.bytes_per_ms / slower)
    return Cluster(nodes, gpus, intra, inter)


def test_one_node_costs_exactly_what_the_profile_link_costs(paper):
    cfg = PipelineConfig("1f1b", stages=4, micro_batches=4)
    plain = build_plan(paper, cfg, PlanOptions("none"))[0]
    # one node whose link is the profile's: every message and all-reduce costs the same
    one = PipelineConfig("1f1b", stages=4, micro_batches=4, cluster=_cluster(paper, 1, 4))
    assert build_plan(paper, one, PlanOptions("none"))[0].stats["step_time_ms"] == pytest.approx(plain.stats["step_time_ms"])


def test_a_boundary_between_nodes_costs_the_inter_node_link(paper):
    # 1F1B D=2 on 2 nodes x 1 GPU: the one pipeline boundary crosses nodes, each message
    # takes the inter-node link's time instead of the profile's
    cl = _cluster(paper, 2, 1, slower=10.0)
    base = build_plan(paper, PipelineConfig("1f1b", stages=2, micro_batches=1, optimizer="adamw"), PlanOptions("none"))[1]
    two = build_plan(paper, PipelineConfig("1f1b", stages=2, micro_batches=1, optimizer="adamw", cluster=cl), PlanOptions("none"))[1]
    costs = build_task_graph(paper, PipelineConfig("1f1b", stages=2, micro_batches=1, optimizer="adamw")).costs
    link = paper.comm.p2p
    # the activation forward and its gradient back are both on the critical path
    extra = sum(cl.inter.time_ms(n) - link.time_ms(n) for n in (costs.out_bytes(0), costs.grad_message_bytes(1)))
    assert two.step_time_ms - base.step_time_ms == pytest.approx(extra, rel=1e-6)


def test_placement_keeps_replica_all_reduces_inside_nodes_and_beats_the_family_numbering(paper):
    cfg = PipelineConfig("chimera", stages=8, micro_batches=8, cluster=_cluster(paper, 2, 4))
    rank_map, report = choose_rank_map(paper, cfg)
    flows = traffic(paper, cfg)
    assert crossing_ms(flows, list(rank_map), cfg.cluster) < crossing_ms(flows, list(range(8)), cfg.cluster)
    node = cfg.cluster.node_of
    for s in range(8):  # the gradient all-reduce of each stage (its heaviest traffic) stays in a node
        assert node(rank_map[cfg.family_rank(s, 0)]) == node(rank_map[cfg.family_rank(s, 1)])
    auto = build_plan(paper, cfg, PlanOptions("greedy"))[0]
    family = build_plan(paper, cfg, PlanOptions("greedy", placement="family"))[0]
    assert auto.stats["placement"]["rank_map"] == list(rank_map)
    assert auto.stats["step_time_ms"] < family.stats["step_time_ms"]
    # the plan's placement is the chosen one, and the replay of the stored plan agrees
    stored = plan_from_json(json.loads(json.dumps(auto.to_json())))
    assert stored.config.cluster.nodes == 2
    assert {(p["stage"], p["replica"]): p["rank"] for p in stored.placement} == {
        (s, r): rank_map[cfg.family_rank(s, r)] for s in range(8) for r in range(2)}
    assert replay(stored, paper).step_time_ms == pytest.approx(auto.stats["step_time_ms"], rel=1e-9)


def test_bad_cluster_in_a_plan_file_is_one_line(paper):
    cfg = PipelineConfig("1f1b", stages=2, micro_batches=2, cluster=_cluster(paper, 2, 1))
    obj = build_plan(paper, cfg, PlanOptions("none"))[0].to_json()
    obj["config"]["cluster"]["nodes"] = 3
    with pytest.raises(InputError) as e:
        plan_from_json(obj, "p.json")
    assert "config.cluster" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(InputError):
        PipelineConfig("1f1b", stages=2, micro_batches=2, cluster=_cluster(paper, 3, 1))


@pytest.mark.e2e
@pytest.mark.full  # CI runs two torchrun nodes in test_runtime's test_two_nodes_equal_one_node
def test_a_two_node_plan_runs_as_two_torchrun_nodes(tmp_path):
    """`pfcompile plan --nodes 2 --gpus-per-node 2` (Chimera D = 4, its ranks placed for a slow
    inter-node link) runs as two torchrun "nodes" of 2 ranks each (c10d rendezvous on
    127.0.0.1): torchrun's rank numbering is the plan's, and the run ends equal to the
    single-process run."""
    import subprocess
    import sys
    from pathlib import Path

    from runtime.pipeline.comm import free_port

    root = Path(__file__).resolve().parents[1]
    plan = tmp_path / "two-nodes.json"
    made = subprocess.run([sys.executable, "-m", "pfcompile", "plan", str(root / "profiles" / "bert-tiny-cpu.json"),
                           "--schedule", "chimera", "--stages", "4", "--micro-batches", "4", "--method", "greedy",
                           "--nodes", "2", "--gpus-per-node", "2", "--inter-link", "0.5,0.01", "-o", str(plan)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    obj = json.loads(plan.read_text())
    assert obj["config"]["cluster"]["nodes"] == 2 and obj["stats"]["placement"]["chosen_by"] == "search"
    assert obj["stats"]["placement"]["rank_map"] != [0, 1, 2, 3]  # not the family's numbering: a real test of it
    steps = obj["config"]["refresh_steps"] + 1
    port = free_port()
    nodes = [torchrun(plan, 2, "--steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt"),
                      "--checkpoint-every", str(steps), "--p2p-tags", "off",
                      launcher=["--nnodes", "2", "--node-rank", str(i), "--rdzv-backend", "c10d",
                                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "plan-two-nodes"], wait=False)
             for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-2000:] for o in outs)
    initial, want = reference_params(plan, steps)
    assert_same_params(distributed_params(tmp_path / "ckpt", steps, plan), want, initial)
