"""The plan file: the only contract between compiler and runtime.

Imports no torch, networkx or ortools: the runtime loads plans through `load_plan` alone.

    {
      "schema": "pfcompile-plan", "schema_version": 1,
      "config": {
        "schedule": "gpipe"|"1f1b"|"interleaved"|"chimera"|"zb-h1"|"zb-v"|"dualpipev",
        "stages": D,                 # pipeline depth (devices per pipeline)
        "virtual_stages": v,         # model chunks per device (interleaved), else 1
        "micro_batches": N,          # micro-batches per step, all replicas together
        "replicas": R,               # copies of each stage (chimera: 2; data parallel: R)
        "world_size": W,
        "method": "none"|"greedy"|"cpsat",
        "optimizer": "kfac"|"shampoo"|"muon"|"adamw",  # whose extra work the ops hold (adamw: none);
                                     # plans without it have "kfac": bool (true: "kfac", false: "adamw")
        "refresh_steps": k,          # the cycle: curvature of step 0, inverses in force from step k
        "inverse": "cholesky"|"eigen",
        "fixed_order": bool,
        "memory_limit_bytes": int|null,
        "inversion": "balanced"|"pipefisher"|"all",
        "precond": "all"|"split",    # split: each layer preconditioned by one replica (rs_grad/ag_grad)
        "precond_owner": [replica|null per K-FAC layer]   # with "split": null = every replica
      },
      "model": {...},                # the profile's model spec (name, sizes, micro_batch, seq_len, dtype)
      "partition": [["embed","block0"], ["block1","head"]],   # parts of each model stage
      "layers": ["block0.attn.q", ...],                       # K-FAC layers; ops refer by index
      "layer_stage": [0, 0, ..., 1],                          # model stage of each K-FAC layer
      "placement": [{"stage": s, "replica": r, "rank": q}],   # every (stage, replica) once
      "micro_batch_replica": [r of mb 0, r of mb 1, ...],     # which replica runs each mb
      "ranks": [{"rank": q, "steps": [[{"op": "fwd", "stage": 0, "mb": 0,
                                         "start": ms, "end": ms}, ...],   # step 0 of the cycle
                                        ...]}],                            # k lists
                                      # a `step` op also "between_ms": of its span, the runtime's
                                      # work between steps (and the activation ending a cycle)
      "stats": {"utilization", "utilization_pipefisher": [per step], "utilization_pipefisher_mean",
                "utilization_strict", "step_time_ms" (steady state), "step_time_from_idle_ms",
                "baseline_step_time_ms", "tight_baseline_step_time_ms", "step_overhead",
                "step_overhead_tight", "refresh_steps", "expected_step_time_ms",
                "expected_baseline_step_time_ms", "expected_step_overhead" (with the
                profile's op-time spread), "expected_step_replay_steps" (their replay's steps),
                "refresh_steps_lower_bound", "solver_status", "gap", "solve_seconds",
                "tasks", "peak_memory_bytes": [per rank], "runtime_op_ms" (the runtime's
                dispatch inside every op's span), ...},
      "profile": {"name", "hash", "source", "device_type",
                  "model_hash",              # of the model spec and "hash" (pfcompile.formats.verify.model_hash)
                  "parts": [the profile's part names, in order]}
    }

Times are milliseconds from the start of the cycle (step 0's start). The runtime runs
step t with `ranks[rank].steps[t % k]`. An op's span holds the runtime's own work around it
(pfcompile.graph.costs.Costs.runtime_ms), which a run times apart from the op:
`Plan.own_ms` is the op alone, what a measured op compares with.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pfcompile.formats.errors import InputError
from pfcompile.formats.jsonio import Fields, read_json, write_json
from pfcompile.formats.ops import FLOATING_KINDS, Op
from pfcompile.formats.optimizers import NAMES as OPTIMIZER_NAMES
from pfcompile.formats.optimizers import optimizer as optimizer_decl
from pfcompile.formats.optimizers import optimizer as optimizer_spec
from pfcompile.formats.profile import Cluster, LinkModel

SCHEMA = "pfcompile-plan"
SCHEMA_VERSION = 1
SCHEDULES = ("gpipe", "1f1b", "interleaved", "chimera", "zb-h1", "zb-v", "dualpipev")
METHODS = ("none", "greedy", "cpsat")
INVERSES = ("cholesky", "eigen")
INVERSION_POLICIES = ("balanced", "pipefisher", "all")
PRECOND_DIVISIONS = ("all", "split", "layers")


@dataclass(frozen=True)
class PlanConfig:
    """The plan file's `config`: what the plan was made for, read and written by this format.

    `precond` says who preconditions what ("split": `precond_owner[layer]` is the replica
    that does, None every replica); `precond_division` is how the planner chose the owners
    (PRECOND_DIVISIONS), kept for the reader. Frozen: a plan's configuration is fixed once
    planned; `dataclasses.replace` makes an edited copy."""

    schedule: str
    stages: int
    micro_batches: int
    replicas: int
    world_size: int
    method: str
    optimizer: str
    refresh_steps: int
    virtual_stages: int = 1
    inverse: str = "cholesky"
    inversion: str = "balanced"
    precond: str = "all"
    precond_division: str | None = None
    precond_owner: tuple[int | None, ...] | None = None
    memory_limit_bytes: int | None = None
    fixed_order: bool = True
    cluster: Cluster | None = None
    defer_stats: bool = False  # the statistics fold the previous step's kept gradient (Optimizer.with_deferred_stats)

    @property
    def optimizer_spec(self):
        """The optimizer's declaration (pfcompile.formats.optimizers.Optimizer)."""
        return optimizer_decl(self.optimizer, defer_stats=self.defer_stats)

    @property
    def optimizer_work(self) -> bool:
        """Whether the plan holds an optimizer's extra work (every optimizer but AdamW)."""
        return self.optimizer_spec.has_work

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schedule": self.schedule, "stages": self.stages, "virtual_stages": self.virtual_stages,
            "micro_batches": self.micro_batches, "replicas": self.replicas, "world_size": self.world_size,
            "optimizer": self.optimizer, "refresh_steps": self.refresh_steps, "inverse": self.inverse,
            "inversion": self.inversion, "precond": self.precond, "memory_limit_bytes": self.memory_limit_bytes}
        if self.cluster is not None:
            out["cluster"] = self.cluster.to_json()
        out["method"] = self.method
        out["fixed_order"] = self.fixed_order
        if self.precond_division is not None:
            out["precond_division"] = self.precond_division
        if self.precond_owner is not None:
            out["precond_owner"] = list(self.precond_owner)
        if self.defer_stats:
            out["defer_stats"] = True
        return out


class Task(NamedTuple):
    """One op on one rank in one step of the refresh cycle; `step` is None for floating
    K-FAC work (FLOATING_KINDS), which is one task of the cycle whatever step lists it.
    The task type of the task graph, the dependency rules and the replay."""

    step: int | None
    rank: int
    op: Op

    def __str__(self) -> str:
        where = f"step {self.step}" if self.step is not None else "cycle"
        return f"rank {self.rank} {where} {self.op}"


def task_at(step: int, rank: int, op: Op) -> Task:
    """The task of `op` listed in `step` on `rank` (floating work: the cycle's one task)."""
    return Task(None if op.kind in FLOATING_KINDS else step, rank, op)


class Layout:
    """Where each (stage, replica) runs and which replica runs each micro-batch, as
    queries: the one stage -> rank lookup of the planner (from PipelineConfig.placement),
    a plan file and the replay.

    `placement`: [{"stage", "replica", "rank"}]; `micro_batch_replica[m]`: m's replica."""

    def __init__(self, placement: list[dict[str, int]], micro_batch_replica: list[int]):
        self.rank: dict[tuple[int, int], int] = {(p["stage"], p["replica"]): p["rank"] for p in placement}
        self.held: dict[int, dict[int, int]] = defaultdict(dict)  # rank -> {stage: replica}
        for (s, r), q in sorted(self.rank.items()):
            self.held[q][s] = r
        self.micro_batch_replica = list(micro_batch_replica)
        self._mbs: dict[int, list[int]] = {}
        for m, r in enumerate(self.micro_batch_replica):
            self._mbs.setdefault(r, []).append(m)
        self._groups: dict[int, list[int]] = {}
        for (s, _r), q in sorted(self.rank.items()):  # by replica index
            self._groups.setdefault(s, []).append(q)

    def rank_of(self, stage: int, replica: int) -> int:
        return self.rank[(stage, replica)]

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """(stage, replica) pairs held by a rank, in stage order."""
        return sorted(self.held.get(rank, {}).items())

    def replica_ranks(self, stage: int) -> list[int]:
        """Ranks holding a replica of the stage, by replica index: the stage's process group."""
        return list(self._groups.get(stage, []))

    def mbs_of(self, replica: int) -> list[int]:
        """The micro-batches a replica runs, ascending."""
        return list(self._mbs.get(replica, []))


@dataclass
class PlannedOp:
    op: Op
    start: float
    end: float
    between_ms: float = 0.0  # of the span, the runtime's work between steps a `step` op carries

    def to_dict(self) -> dict[str, Any]:
        d = {**self.op.to_dict(), "start": round(self.start, 6), "end": round(self.end, 6)}
        return {**d, "between_ms": round(self.between_ms, 6)} if self.between_ms > 0 else d


@dataclass
class Plan:
    config: PlanConfig
    model: dict[str, Any]
    partition: list[list[str]]
    layers: list[str]
    layer_stage: list[int]
    placement: list[dict[str, int]]
    micro_batch_replica: list[int]
    ranks: list[list[list[PlannedOp]]]  # ranks[q][step] -> ops in execution order
    stats: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)

    # --- derived views -------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def refresh_steps(self) -> int:
        return self.config.refresh_steps

    @property
    def num_stages(self) -> int:
        return len(self.partition)

    @property
    def layout(self) -> Layout:
        """The placement as queries (built afresh: a plan's fields may be edited)."""
        return Layout(self.placement, self.micro_batch_replica)

    def rank_of(self, stage: int, replica: int) -> int:
        return self.layout.rank_of(stage, replica)

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """(stage, replica) pairs held by a rank, in stage order."""
        return self.layout.stages_of(rank)

    def replica_ranks(self, stage: int) -> list[int]:
        """Ranks holding a replica of the stage, by replica index: the stage's process group."""
        return self.layout.replica_ranks(stage)

    def ops(self, rank: int, step: int) -> list[Op]:
        return [p.op for p in self.ranks[rank][step % self.refresh_steps]]

    def own_ms(self, po: PlannedOp) -> float:
        """The op's planned time alone: its span less the runtime's work inside it (its
        dispatch, `stats.runtime_op_ms`, and a step op's `between_ms`), as a run times it. A
        plan made before these were recorded gives its span."""
        return max(0.0, po.end - po.start - float(self.stats.get("runtime_op_ms") or 0.0) - po.between_ms)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "config": self.config.to_json(),
            "model": self.model,
            "partition": self.partition,
            "layers": self.layers,
            "layer_stage": self.layer_stage,
            "placement": self.placement,
            "micro_batch_replica": self.micro_batch_replica,
            "ranks": [{"rank": q, "steps": [[p.to_dict() for p in step] for step in steps]}
                      for q, steps in enumerate(self.ranks)],
            "stats": self.stats,
            "profile": self.profile,
        }

    def save(self, path: str) -> None:
        write_json(path, self.to_json())


def _nonneg_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _config_from_json(cfg: Fields) -> PlanConfig:
    """The plan's `config`, each field checked (keys this version does not know are ignored)."""
    positive = dict(check=lambda v: v > 0, why="must be a positive integer")

    def one_of(options: tuple[str, ...]) -> dict:
        return dict(check=lambda v: v in options, why=f"must be one of {', '.join(options)}")

    schedule = cfg.req("schedule", str, **one_of(SCHEDULES))
    method = cfg.req("method", str, **one_of(METHODS))
    stages, micro_batches, replicas, world, k = (
        cfg.req(key, int, **positive) for key in ("stages", "micro_batches", "replicas", "world_size", "refresh_steps"))
    virtual_stages = cfg.opt("virtual_stages", int, 1, **positive)
    # plans before Shampoo and Muon said only whether they held K-FAC's work ("kfac": bool)
    if "optimizer" in cfg.obj or "kfac" not in cfg.obj:
        optimizer = cfg.req("optimizer", str, check=_known_optimizer,
                            why=f"must be one of {', '.join(OPTIMIZER_NAMES)} or a plugin's package.module:name")
    else:
        optimizer = "kfac" if cfg.req("kfac", bool) else "adamw"
    inverse = cfg.opt("inverse", str, "cholesky", **one_of(INVERSES))
    inversion = cfg.opt("inversion", str, "balanced", **one_of(INVERSION_POLICIES))
    memory_limit = cfg.opt("memory_limit_bytes", int, None, check=lambda v: v > 0, why="must be positive")
    precond = cfg.opt("precond", str, "all", check=lambda s: s in ("all", "split"), why="must be 'all' or 'split'")
    division = cfg.opt("precond_division", str, None, **one_of(PRECOND_DIVISIONS))
    fixed_order = cfg.opt("fixed_order", bool, True)
    defer_stats = cfg.opt("defer_stats", bool, False)
    if defer_stats:
        try:
            optimizer_spec(optimizer, defer_stats=True)
        except ValueError as e:
            raise cfg.fail("defer_stats", str(e)) from None
    owners = None
    if precond == "split":
        owners = cfg.req("precond_owner", list)
        if not all(o is None or (isinstance(o, int) and not isinstance(o, bool) and 0 <= o < replicas) for o in owners):
            raise cfg.fail("precond_owner", f"must list a replica (0..{replicas - 1}) or null per K-FAC layer")
        owners = tuple(owners)
    cluster = None
    if cfg.obj.get("cluster") is not None:  # messages costed by the link they cross (Cluster)
        clu = cfg.sub("cluster")
        n = clu.req("nodes", int, **positive)
        g = clu.req("gpus_per_node", int, **positive)
        if n * g != world:
            raise clu.fail(None, f"{n} nodes x {g} GPUs per node is not config.world_size {world}")
        links = []
        for name in ("intra", "inter"):
            link = clu.sub(name)
            links.append(LinkModel(
                latency_ms=float(link.req("latency_ms", float, check=lambda v: v >= 0, why="must be >= 0")),
                bytes_per_ms=float(link.req("bytes_per_ms", float, check=lambda v: v > 0, why="must be positive"))))
        cluster = Cluster(n, g, *links)
    return PlanConfig(schedule=schedule, stages=stages, micro_batches=micro_batches, replicas=replicas,
                      world_size=world, method=method, optimizer=optimizer, refresh_steps=k, virtual_stages=virtual_stages,
                      inverse=inverse, inversion=inversion, precond=precond, precond_division=division,
                      precond_owner=owners, memory_limit_bytes=memory_limit, fixed_order=fixed_order,
                      cluster=cluster, defer_stats=defer_stats)


def load_plan(path: str) -> Plan:
    """Read and validate a plan file; any problem is an InputError naming the file and field."""
    return plan_from_json(read_json(path), str(path))


def _known_optimizer(name: str) -> bool:
    try:
        optimizer_spec(name)
    except ValueError:
        return False
    return True


def plan_from_json(obj: Any, where: str = "<plan>") -> Plan:
    top = Fields(obj, where)
    top.schema(SCHEMA, SCHEMA_VERSION, "plan")

    config = _config_from_json(top.sub("config"))
    world, k = config.world_size, config.refresh_steps

    model = top.req("model", dict)
    top.sub("model").req("name", str)

    partition = top.req("partition", list, check=lambda v: len(v) > 0, why="must list at least one stage")
    for s, parts in enumerate(partition):
        if not isinstance(parts, list) or not parts or not all(isinstance(p, str) for p in parts):
            raise top.fail(f"partition[{s}]", "must be a non-empty list of part names")
    n_stages = len(partition)

    layers = top.req("layers", list)
    if not all(isinstance(l, str) for l in layers):
        raise top.fail("layers", "must be a list of layer names")
    layer_stage = top.req("layer_stage", list)
    if len(layer_stage) != len(layers) or not all(_nonneg_int(s) and s < n_stages for s in layer_stage):
        raise top.fail("layer_stage", f"must give a stage in 0..{n_stages - 1} for each of the {len(layers)} layers")
    if config.precond_owner is not None and len(config.precond_owner) != len(layers):
        raise InputError(where, "config.precond_owner", f"must give an owner (or null) for each of the {len(layers)} layers")

    placement = top.req("placement", list)
    seen = set()
    for i, p in enumerate(placement):
        f = Fields(p, where, f"placement[{i}]")
        s = f.req("stage", int, check=lambda v: 0 <= v < n_stages, why=f"must be in 0..{n_stages - 1}")
        r = f.req("replica", int, check=lambda v: v >= 0, why="must be >= 0")
        f.req("rank", int, check=lambda v: 0 <= v < world, why=f"must be in 0..{world - 1}")
        if (s, r) in seen:
            raise f.fail(None, f"stage {s} replica {r} placed twice")
        seen.add((s, r))
    for s in range(n_stages):
        if not any(st == s for st, _ in seen):
            raise top.fail("placement", f"stage {s} is placed on no rank")

    mbr = top.req("micro_batch_replica", list)
    if not all(_nonneg_int(r) for r in mbr) or len(mbr) == 0:
        raise top.fail("micro_batch_replica", "must be a non-empty list of replica indices")

    ranks_raw = top.req("ranks", list)
    if len(ranks_raw) != world:
        raise top.fail("ranks", f"lists {len(ranks_raw)} ranks but config.world_size is {world}")
    ranks: list[list[list[PlannedOp]]] = []
    for q, rr in enumerate(ranks_raw):
        rf = Fields(rr, where, f"ranks[{q}]")
        if rf.req("rank", int) != q:
            raise rf.fail("rank", f"expected {q} (ranks are listed in order)")
        steps = rf.req("steps", list)
        if len(steps) != k:
            raise rf.fail("steps", f"has {len(steps)} steps but config.refresh_steps is {k}")
        rank_steps = []
        for j, step in enumerate(steps):
            if not isinstance(step, list):
                raise rf.fail(f"steps[{j}]", "must be a list of ops")
            ops = []
            for i, d in enumerate(step):
                name = f"ranks[{q}].steps[{j}][{i}]"
                try:
                    op = Op.from_dict(d)
                except ValueError as e:
                    raise InputError(where, name, str(e)) from None
                of = Fields(d, where, name)
                start = of.req("start", float)
                end = of.req("end", float, check=lambda v, start=start: v >= start, why="must be >= start")
                if op.stage is not None and op.stage >= n_stages:
                    raise InputError(where, f"{name}.stage", f"{op.stage} is not a stage (0..{n_stages - 1})")
                if op.layer is not None and op.layer >= len(layers):
                    raise InputError(where, f"{name}.layer", f"{op.layer} is not a layer (0..{len(layers) - 1})")
                if op.peer is not None and op.peer >= world:
                    raise InputError(where, f"{name}.peer", f"{op.peer} is not a rank (0..{world - 1})")
                if op.mb is not None and op.mb >= len(mbr):
                    raise InputError(where, f"{name}.mb", f"{op.mb} is not a micro-batch (0..{len(mbr) - 1})")
                # an annotation of the span (Plan.own_ms clamps): a tool that re-times ops may leave it
                between = of.opt("between_ms", float, 0.0, check=lambda v: 0 <= v < float("inf"),
                                 why="must be a finite number >= 0")
                ops.append(PlannedOp(op, float(start), float(end), float(between)))
            rank_steps.append(ops)
        ranks.append(rank_steps)

    return Plan(
        config=config, model=model, partition=partition, layers=layers, layer_stage=layer_stage,
        placement=placement, micro_batch_replica=mbr, ranks=ranks,
        stats=top.opt("stats", dict, {}), profile=top.opt("profile", dict, {}),
    )
