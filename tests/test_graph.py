"""The task graph: structure, edges with lags, buffers, collectives, inversion policy."""

import networkx as nx
import pytest
from helpers import uniform_profile

from pfcompile.formats.ops import Op
from pfcompile.graph.schedules import PipelineConfig, compute_orders
from pfcompile.graph.taskgraph import Task, build_task_graph


def test_graph_is_a_dag_with_every_pass_once_per_step():
    prof = uniform_profile(blocks=4)
    cfg = PipelineConfig("1f1b", stages=4, micro_batches=6, refresh_steps=2)
    tg = build_task_graph(prof, cfg)
    assert nx.is_directed_acyclic_graph(tg.g)
    for t in range(2):
        for s in range(4):
            for m in range(6):
                for kind in ("fwd", "bwd"):
                    assert Task(t, s, Op(kind, stage=s, mb=m)) in tg.g
    # step t+1's forward waits for step t's optimizer update of that stage
    assert tg.g.has_edge(Task(0, 2, Op("step", stage=2)), Task(1, 2, Op("fwd", stage=2, mb=0)))
    # curvature is of step 0's micro-batches and floats (step None)
    ca = Task(None, 1, Op("curv_a", layer=2, mb=3))
    assert tg.g.nodes[ca]["floating"] and tg.g.has_edge(Task(0, 1, Op("fwd", stage=1, mb=3)), ca)
    # inversion of either factor needs both factors' curvature (pi-corrected damping)
    inv_a = Task(None, 1, Op("inv", layer=2, factor="A"))
    assert tg.g.has_edge(Task(None, 1, Op("curv_b", layer=2, mb=5)), inv_a)
    # per step: 4 ranks x (6 fwd + 6 bwd + 2 precond + step) + 3 links x 6 mbs x (send+recv) x 2 ways
    stepped = sum(1 for t in tg.g if t.step is not None)
    assert stepped == sum(len(s) for steps in tg.canonical.values() for s in steps)
    assert stepped == 2 * (4 * (12 + 2 + 1) + 3 * 6 * 4)


def test_send_recv_edges_carry_the_message_time():
    prof = uniform_profile(blocks=2, out_bytes=500_000, latency_ms=0.25)
    tg = build_task_graph(prof, PipelineConfig("gpipe", stages=2, micro_batches=2, optimizer="adamw"))
    send = Task(0, 0, Op("send_act", stage=0, mb=1, peer=1))
    recv = Task(0, 1, Op("recv_act", stage=0, mb=1, peer=0))
    assert tg.g.edges[send, recv]["lag"] == pytest.approx(0.25 + 500_000 / 1e6)
    assert tg.g.nodes[send]["duration"] == 0.0 and tg.g.nodes[send]["stream"] == "p2p"
    assert tg.g.has_edge(Task(0, 0, Op("fwd", stage=0, mb=1)), send)
    assert tg.g.has_edge(recv, Task(0, 1, Op("fwd", stage=1, mb=1)))


def test_buffers_pair_allocation_and_free():
    prof = uniform_profile(blocks=2, act_bytes=777)
    tg = build_task_graph(prof, PipelineConfig("1f1b", stages=2, micro_batches=2, refresh_steps=2))
    acts = [b for b in tg.buffers if b.key[0] == "act"]
    assert len(acts) == 2 * 2 * 2  # steps x stages x micro-batches
    assert all(b.alloc.op.kind == "fwd" and b.free.op.kind == "bwd" and b.nbytes == 777 for b in acts)
    kept = [b for b in tg.buffers if b.key[0].startswith("kept")]
    # kept tensors only for step 0's micro-batches: 2 stages x 2 layers x 2 mbs x 2 factors
    assert len(kept) == 16 and all(b.alloc.step == 0 and b.free.op.kind.startswith("curv") for b in kept)
    # resident: params + grads (100 + 100), AdamW's two moments (the synthetic factors are
    # too small to cover a weight, so no parameter is K-FAC's), and per K-FAC layer the
    # accumulator + factor and the in-force + pending inverse of A and B (4 bytes each)
    assert tg.resident_bytes[0] == 200 + 2 * 100 + 2 * (2 * (4 + 4) + 2 * (4 + 4))


def test_chimera_layout_and_collectives():
    prof = uniform_profile(blocks=4)
    cfg = PipelineConfig("chimera", stages=4, micro_batches=4)
    assert cfg.replicas == 2 and cfg.world_size == 4
    assert [cfg.rank_of(s, 1) for s in range(4)] == [3, 2, 1, 0]
    tg = build_task_graph(prof, cfg)
    members = tg.collectives[(0, Op("sync_grad", stage=1))]
    assert sorted(t.rank for t in members) == [1, 2]
    # one replica inverts each factor, balanced: each rank of a pair gets half the inversions
    for s in range(4):
        ranks = cfg.replica_ranks(s)
        layers = tg.costs.stage_layers[s]
        counts = {q: sum(1 for l in layers for f in "AB" if tg.inverters[(l, f)] == [q]) for q in ranks}
        assert sorted(counts.values()) == [2, 2]
    bc = [t for t in tg.g if t.op.kind == "bcast_inv"]
    assert len(bc) == 4 * 2 * 2 * 2  # stages x layers x factors x members


def test_inversion_policy_all_has_no_broadcast():
    prof = uniform_profile(blocks=4)
    tg = build_task_graph(prof, PipelineConfig("1f1b", stages=2, micro_batches=4, replicas=2, inversion="all"))
    assert not any(t.op.kind == "bcast_inv" for t in tg.g)
    assert sum(1 for t in tg.g if t.op.kind == "inv") == 8 * 2 * 2


def test_interleaved_order_is_megatrons():
    cfg = PipelineConfig("interleaved", stages=2, micro_batches=4, virtual_stages=2)
    order = compute_orders(cfg)
    # device 0 holds stages 0 and 2; warm-up of (D-d-1)*2 + (v-1)*D = 4 forwards
    assert order[0][:4] == [("fwd", 0, 0), ("fwd", 0, 1), ("fwd", 2, 0), ("fwd", 2, 1)]
    assert order[0][4:6] == [("fwd", 0, 2), ("bwd", 2, 0)]
    assert sorted(order[0]) == sorted((k, s, m) for k in ("fwd", "bwd") for s in (0, 2) for m in range(4))


def test_interleaved_with_one_chunk_is_1f1b():
    for D, N in ((4, 8), (3, 6)):
        one = compute_orders(PipelineConfig("1f1b", stages=D, micro_batches=N))
        assert compute_orders(PipelineConfig("interleaved", stages=D, micro_batches=N, virtual_stages=1)) == one


def test_pipefisher_inversion_split_counts_where_each_factor_is_inverted():
    """PipeFisher's division (pipe-fisher main_bert.py): a stage of B blocks gives floor(B/R)
    blocks to each replica, the B mod R left over are inverted on every replica. Chimera
    D=4 on 12 blocks: 3 blocks a stage, R=2: block 0 of the stage on replica 0, block 1 on
    replica 1, block 2 on both; counted in a replayed plan."""
    from collections import Counter

    from pfcompile.place.build import build_plan
    from pfcompile.place.options import PlanOptions

    prof = uniform_profile(blocks=12)
    cfg = PipelineConfig("chimera", stages=4, micro_batches=4, inversion="pipefisher")
    plan, _, _ = build_plan(prof, cfg, PlanOptions("greedy"))
    where = Counter()
    for q, steps in enumerate(plan.ranks):
        for ops in steps:
            for po in ops:
                if po.op.kind == "inv":
                    where[(po.op.layer, po.op.factor, q)] += 1
    for l, layer in enumerate(prof.covered_layers):
        s = plan.layer_stage[l]
        j = int(layer.part[len("block"):]) - 3 * s  # the block's place in its stage
        ranks = {cfg.rank_of(s, 0): j in (0, 2), cfg.rank_of(s, 1): j in (1, 2)}
        for f in ("A", "B"):
            for q, inverts in ranks.items():
                assert where[(l, f, q)] == (1 if inverts else 0), (l, f, q)
    # a split factor's inverse reaches the other replica by broadcast; the rest need none
    bcasts = {(po.op.layer, po.op.factor) for steps in plan.ranks for ops in steps for po in ops
              if po.op.kind == "bcast_inv"}
    assert bcasts == {(l, f) for l, layer in enumerate(prof.covered_layers) for f in ("A", "B")
                      if (int(layer.part[len("block"):]) - 3 * plan.layer_stage[l]) != 2}


def test_split_preconditioning_divisions():
    """--precond split (PipeFisher's blocks: floor(B/R) each, the rest on every replica) and
    layers (each layer to the least loaded replica): a stage of 3 blocks x 2 layers on 2
    replicas; the plan lists each layer's precond where its owner is, rs_grad/ag_grad once
    per stage replica and step, and an owned layer is inverted by its owner only."""
    from collections import Counter

    from pfcompile.graph.costs import Costs, precond_share
    from pfcompile.place.build import build_plan
    from pfcompile.place.options import PlanOptions

    prof = uniform_profile(blocks=12)
    for mode, per_replica in (("split", 2), ("layers", 3)):
        cfg = PipelineConfig("chimera", stages=4, micro_batches=4, precond=mode)
        plan, _, _ = build_plan(prof, cfg, PlanOptions("greedy"))
        owner = plan.config.precond_owner
        assert plan.config.precond == "split" and plan.config.precond_division == mode
        for s in range(4):
            ls = [l for l, st in enumerate(plan.layer_stage) if st == s]
            counts = Counter(owner[l] for l in ls)
            if mode == "split":  # block 0 to replica 0, block 1 to replica 1, block 2 to both
                assert counts == {0: 2, 1: 2, None: 2}
            else:
                assert counts == {0: per_replica, 1: per_replica}
        costs = Costs(prof, plan.partition, 2, "cholesky", "kfac")
        assert tuple(precond_share(costs, 2, mode)) == owner
        listed = Counter((q, po.op.kind, po.op.layer) for q, steps in enumerate(plan.ranks) for po in steps[0])
        for l, o in enumerate(owner):
            s = plan.layer_stage[l]
            for r in (0, 1):
                q = cfg.rank_of(s, r)
                assert listed[(q, "precond", l)] == (1 if o in (None, r) else 0)
                invs = sum(1 for st in plan.ranks[q] for po in st if po.op.kind == "inv" and po.op.layer == l)
                assert invs == (2 if o == r else 0) or o is None
        for kind in ("rs_grad", "ag_grad"):  # 4 stages x 2 replicas, once per step
            assert sum(n for (q, kk, _), n in listed.items() if kk == kind) == 8
