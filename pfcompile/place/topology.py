"""Where the family's ranks go on a cluster: keep the heaviest traffic inside nodes.

A pipeline boundary moves an activation and an input gradient per micro-batch; a stage's
replicas all-reduce its gradients every step (and, with K-FAC, its factors and inverses
once per refresh). Inside a node these cross a fast link, between nodes a slow one. The
family fixes which rank talks to which (PipelineConfig.family_rank); this module chooses
the torchrun rank of each family rank, `rank_map`, so that the estimated time of the
traffic crossing nodes per step is least:

    cost(map) = sum over pairs (a, b) of family ranks on different nodes of
                inter.time(bytes_ab) - intra.time(bytes_ab)

by local search from the family's own numbering (swap two ranks on different nodes while
it helps). An estimate for choosing, not the plan's step time: the plan is then made and
replayed on the chosen placement, links and all.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from pfcompile.formats.profile import Cluster, Profile
from pfcompile.graph.costs import Costs
from pfcompile.graph.partition import stage_partition
from pfcompile.graph.schedules import PipelineConfig


def traffic(profile: Profile, cfg: PipelineConfig) -> dict[tuple[int, int], float]:
    """Bytes per step between pairs of family ranks (a < b)."""
    fam = replace(cfg, rank_map=None, cluster=None)
    partition = stage_partition(profile, cfg)
    costs = Costs(profile, partition, cfg.replicas, cfg.inverse, cfg.optimizer)
    out: dict[tuple[int, int], float] = defaultdict(float)

    def add(a: int, b: int, nbytes: float) -> None:
        if a != b:
            out[(min(a, b), max(a, b))] += nbytes

    per_replica = cfg.micro_batches // cfg.replicas
    for r in range(cfg.replicas):
        for s in range(cfg.num_stages - 1):
            a, b = fam.rank_of(s, r), fam.rank_of(s + 1, r)
            add(a, b, per_replica * (costs.out_bytes(s) + costs.grad_message_bytes(s + 1)))
    for s in range(cfg.num_stages):
        ranks = fam.replica_ranks(s)
        if len(ranks) < 2:
            continue
        # a ring all-reduce moves 2(r-1)/r of the bytes over each of its r links
        nbytes = costs.grad_bytes(s)
        # the optimizer's reduced statistics and broadcast refreshes once per cycle: counted
        # as if every step (an upper bound)
        spec = cfg.optimizer_spec
        nbytes += sum((profile.covered_layers[l].factor_bytes(f) if spec.reduces else 0) + costs.root_bytes(l, f)
                      for l in costs.stage_layers[s] for f in spec.factors)
        share = 2 * (len(ranks) - 1) / len(ranks) * nbytes
        for a, b in zip(ranks, ranks[1:] + ranks[:1]):
            add(a, b, share / len(ranks))
    return dict(out)


def crossing_ms(flows: dict[tuple[int, int], float], rank_map: list[int], cluster: Cluster) -> float:
    """Extra milliseconds per step of the traffic that crosses nodes under `rank_map`."""
    total = 0.0
    for (a, b), nbytes in flows.items():
        if cluster.node_of(rank_map[a]) != cluster.node_of(rank_map[b]):
            total += cluster.inter.time_ms(nbytes) - cluster.intra.time_ms(nbytes)
    return total


def choose_rank_map(profile: Profile, cfg: PipelineConfig, search: bool = True) -> tuple[tuple[int, ...], dict]:
    """The torchrun rank of each family rank, and a report for the plan's stats (what was
    chosen, its estimated crossing cost, and the family numbering's). `search=False`: the
    family's numbering itself (a placement that ignores the topology)."""
    cluster = cfg.cluster
    W = cfg.world_size
    flows = traffic(profile, cfg)
    best = list(range(W))
    best_cost = identity_cost = crossing_ms(flows, best, cluster)
    improved = search
    while improved:
        improved = False
        for a in range(W):
            for b in range(a + 1, W):
                if cluster.node_of(best[a]) == cluster.node_of(best[b]):
                    continue
                trial = list(best)
                trial[a], trial[b] = trial[b], trial[a]
                c = crossing_ms(flows, trial, cluster)
                if c < best_cost - 1e-9:
                    best, best_cost, improved = trial, c, True
    inside = sum(n for (a, b), n in flows.items() if cluster.node_of(best[a]) == cluster.node_of(best[b]))
    report = {
        "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
        "rank_map": best,  # rank_map[family rank] = torchrun rank
        "node_of_stage_replica": {f"{s}.{r}": cluster.node_of(best[cfg.family_rank(s, r)])
                                  for s in range(cfg.num_stages) for r in range(cfg.replicas)},
        "crossing_ms_per_step": round(best_cost, 3),
        "crossing_ms_per_step_family_numbering": round(identity_cost, 3),
        "traffic_inside_nodes": round(inside / max(1.0, sum(flows.values())), 4),
        "chosen_by": "search" if search else "family numbering",
        "why": "the placement whose traffic crossing nodes (pipeline boundaries per micro-batch, replica "
               "all-reduces per step) costs the least on the inter-node link, by local search from the "
               "family's numbering",
    }
    return tuple(best), report
