"""The op interpreter: one rank executes its plan's op lists, in order, step after step.

Each pipeline op kind has one handler (`_fwd`, `_recv_act`, `_sync_grad`, ...). An op kind of
the plan's optimizer (its declaration, pfcompile.formats.optimizers) is the layer's method of
that name (`curv_a`, `inv`, `stats`, `orth`, `precond`, ...: runtime.optimizers.registry),
called with the op's micro-batch, factor and the step's place in the refresh cycle; its
collectives (sync_curv, bcast_inv) are generic: they move a layer's statistic or pending
root. The interpreter holds, per stage this rank runs, the stage module, its optimizer's
layers and its stage optimizer, and per micro-batch the stage's input and output until the
backward has used them.

What keeps the run equal to a single process (runtime.train.train_step):
- step t of the global run uses the global batch of step t; micro-batch m is slice m of
  it, wherever it runs;
- the last stage back-propagates loss_m / N (N = all micro-batches of all replicas), and
  sync_grad SUMS the replicas' gradients: together the gradient of the mean loss;
- K-FAC accumulators are sums over micro-batches; sync_curv sums them over replicas,
  so the factor is the same full-batch factor the single process computes;
- KL-clip and the optimizer work per stage, the grouping the reference uses too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from pfcompile.formats.ops import SPLIT_BACKWARD_SCHEDULES, Op
from pfcompile.formats.plan import Plan
from runtime.config.precision import Precision, precision
from runtime.observe.measure import Timeline
from runtime.observe.memory import MemoryMeter
from runtime.optimizers import kfac, registry
from runtime.optimizers.registry import OpContext
from runtime.optimizers.stage import covered_parameters
from runtime.pipeline import comm
from runtime.pipeline.split_backward import WeightPasses


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element is finite, as a 0-d bool tensor. For float32/bfloat16 the sum in
    float64 is finite exactly when every element is (a NaN or inf propagates; finite float32
    values cannot overflow a float64 sum): one reduction, cheaper than isfinite(t).all(),
    which materialises a bool tensor first and runs after every forward."""
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return torch.isfinite(t.sum(dtype=torch.float64))
    return torch.isfinite(t).all()


# gloo's default: every receive of the step posted ahead (up to 64). A send moves its data only
# once its receive is posted; with fewer posted, a sender whose receiver is busy with bubble work
# waits for it, a delay the plan does not have (posting all: bert-tiny 1F1B with K-FAC 7% faster).
RECV_AHEAD_GLOO = 64


def posting_order(receives: list, tags: bool) -> list:
    """The order to post a batch of receives in. Without tags a pair matches its messages in
    issue order: the plan's. With tags each matches its own send whatever the order, and
    the one needed last goes first: the first one's send is often posted already, so its
    data moves in as soon as its receive is posted, and gloo's thread reading it holds the
    pair that every later post on it waits for."""
    return list(reversed(receives)) if tags else list(receives)


class NonFiniteError(RuntimeError):
    """The run diverged: a stage's forward produced inf or NaN, or a K-FAC factor could not
    be inverted. Raised on every rank at once, with the same message (Interpreter.agree)."""


# What went non-finite, as one integer every rank can MIN-reduce: the smallest is reported
# (the earliest stage's forward before any factor). NO_DIVERGENCE: nothing did.
NO_DIVERGENCE = 2**62
_FACTOR_BASE = 2**40
_PARAMS_BASE = 2**41


def divergence_code(stage: int | None = None, layer: int | None = None, factor: str | None = None,
                    params: bool = False, factors: tuple[str, ...] = ("A", "B")) -> int:
    """A forward of `stage` went non-finite (`params`: the stage's parameters did), or factor
    `factor` of `layer`, one of its optimizer's `factors` (its declaration's), did (a factor
    of None or not among them: a layer op without a factor did)."""
    if stage is not None:
        return _PARAMS_BASE + stage if params else stage
    return _FACTOR_BASE + (len(factors) + 1) * layer + (factors.index(factor) if factor in factors else len(factors))


def divergence_message(code: int, step: int, plan: Plan) -> str:
    """The one line every rank prints for the code: the step, the stage and the value."""
    if code < _FACTOR_BASE:
        what = "loss" if code == plan.num_stages - 1 else "activation (its forward's output)"
        return (f"step {step}: stage {code} produced a non-finite {what}; the run diverged "
                "(a smaller --lr?)")
    if code >= _PARAMS_BASE:
        return (f"step {step}: stage {code - _PARAMS_BASE}'s parameters are non-finite after its update; the run "
                "diverged, and the checkpoint of this step is not written (a smaller --lr?)")
    entry = registry.entry(plan.config.optimizer)
    factors = entry.ops.factors
    layer, f = divmod(code - _FACTOR_BASE, len(factors) + 1)
    what = f"factor {factors[f]}" if f < len(factors) else "state"
    return (f"step {step}: {entry.title} {what} of layer {plan.layers[layer]} (stage "
            f"{plan.layer_stage[layer]}) is non-finite or not positive definite, its {entry.refresh_what} "
            "failed; the run diverged (a smaller --lr or a larger damping?)")


@dataclass
class StageReplica:
    """What one rank holds of one model stage."""
    stage: int
    replica: int
    module: nn.Module
    layers: dict[int, object]        # plan layer index -> the optimizer's layer (KfacLayer, ShampooLayer, MuonLayer)
    optimizer: object                # runtime.optimizers.stage optimizer of this stage
    group: object | None             # process group of the stage's replicas (None: one replica)
    is_first: bool
    is_last: bool
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)   # mb -> input (requires grad)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # mb -> output or loss/N


class Interpreter:
    def __init__(self, plan: Plan, world: comm.World, stages: dict[int, StageReplica],
                 act_shape: tuple[int, ...], dtype: torch.dtype | Precision, update, timeline: Timeline,
                 tags: bool | None = None, recv_ahead: int | None = None):
        self.plan, self.world, self.stages = plan, world, stages
        # float32/float64 throughout, or bf16 autocast with float32 state (runtime.config.precision)
        self.precision = dtype if isinstance(dtype, Precision) else precision(str(dtype).removeprefix("torch."))
        self.act_shape, self.dtype = act_shape, self.precision.compute_dtype  # messages' shape and dtype
        self.update = update            # update(stage_replica): KL-clip + optimizer step of a stage
        self.timeline = timeline
        self.memory = MemoryMeter(stages, world.device)
        self.capturing = False          # K-FAC hooks save inputs/grads (refresh steps only)
        self.step_index = 0             # the global step run_step is executing
        self.N = plan.config.micro_batches
        self.k = plan.refresh_steps
        self.mailbox = comm.Mailbox(world, tags)  # tags None: on for gloo, off for NCCL
        # receives posted ahead of the op that completes them (runtime.pipeline.comm): gloo only
        self.recv_ahead = (0 if world.backend == "nccl" else RECV_AHEAD_GLOO) if recv_ahead is None else recv_ahead
        self.upcoming: list[Op] = []  # this step's receive ops not yet posted, in order
        self.unreceived = 0  # this step's receives not yet completed
        self.following: list[Op] = []  # the next step's receives, posted once this step's are in
        self.received: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, stage, mb) -> tensor
        self.tokens: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self.loss_sum = 0.0  # sum over this rank's last-stage micro-batches of loss_m / N
        self.finite: dict[int, torch.Tensor] = {}  # stage -> all its forwards' outputs finite this step
        self.factor_failed: int = NO_DIVERGENCE  # divergence_code of the first failed inversion this step
        self.verdict: tuple[int, comm.InFlight] | None = None  # (step, its divergence check in flight)
        # plan layer index -> the optimizer's layer, over all stages of this rank
        self.layers = {i: layer for sr in stages.values() for i, layer in sr.layers.items()}
        self.optimizer = registry.entry(plan.config.optimizer)
        # the layers whose hooks capture inputs and output gradients (K-FAC's), per stage
        self.capture = {s: list(sr.layers.values()) if self.optimizer.captures else [] for s, sr in stages.items()}
        # the per-step layer ops the update runs itself (clipping first: Update.defers)
        self.deferred_kinds = getattr(update, "defers", frozenset())
        # zero-bubble families: each stage's backward split into B and W (runtime.pipeline.split_backward)
        self.split = {s: WeightPasses(sr.module) for s, sr in stages.items()} \
            if plan.config.schedule in SPLIT_BACKWARD_SCHEDULES else {}
        self.memory.split = self.split  # W's kept output gradients count too
        self.memory.cycle = self.k
        self.memory.micro_batch_kinds = frozenset(d.kind for d in self.optimizer.ops.micro_batch_ops)
        self.handlers = {
            "fwd": self._fwd, "bwd": self._bwd, "bwd_input": self._bwd_input, "bwd_weight": self._bwd_weight,
            "send_act": self._send, "send_grad": self._send,
            "recv_act": self._recv, "recv_grad": self._recv,
            "sync_grad": self._sync_grad, "step": self._step,
            "rs_grad": self._sync_grad, "ag_grad": self._ag_grad,
        }
        collectives = {"sync_curv": self._sync_curv, "bcast_inv": self._bcast_inv}
        for d in self.optimizer.ops.ops:
            if d.collective and d.kind not in collectives:
                raise ValueError(f"optimizer {self.optimizer.name!r}: collective op {d.kind!r} has no handler "
                                 f"(the runtime's: {', '.join(collectives)})")
            self.handlers[d.kind] = collectives[d.kind] if d.collective else self._layer_op
        # split preconditioning: the replica that preconditions each K-FAC layer (None: all)
        self.precond_owner = plan.config.precond_owner if plan.config.precond == "split" else None
        self.rank_of = {(p["stage"], p["replica"]): p["rank"] for p in plan.placement}


    # --- the loop ---------------------------------------------------------------------------
    def run_step(self, step: int, tokens: list[torch.Tensor], targets: list[torch.Tensor],
                 then: int | None = None) -> float:
        """Execute this rank's ops of global step `step`; returns its share of the step's loss.

        `then`: the step the caller runs right after this one (None: an evaluation, another
        plan or the end comes first). On gloo its receives are posted as soon as this step's
        last receive is in, not at its start: gloo moves a message when the sender's network
        thread has seen the receive posted, and that thread runs when its rank waits
        (runtime.config.network_threads). Posted a step early, the next step's first sends
        find their receives known and go out at once, instead of at the sender's next wait."""
        self.tokens, self.targets, self.loss_sum = tokens, targets, 0.0
        self.step_index = step
        refresh = step % self.k == 0
        tl, mem = self.timeline, self.memory
        activating = [(i, layer) for i, layer in self.layers.items() if hasattr(layer, "activate")]
        if refresh and step > 0 and activating:
            with tl.span(step, "activate"):
                for i, layer in activating:  # the inverses or roots of the last cycle come into force
                    try:
                        layer.activate()
                    except kfac.NonFiniteFactorError:  # the step after a divergence (agree): it stops at the end
                        self.factor_failed = min(self.factor_failed, divergence_code(
                            layer=i, factors=self.optimizer.ops.factors))
        self.capturing = refresh
        mem.begin_step()
        # Marks are host instants on CPU, CUDA events on the current stream on CUDA (read by
        # end_step, never a synchronise per op: see runtime.observe.measure).
        step_start = tl.mark()
        ops = self.plan.ops(self.world.rank, step)
        receives = self._receives(step)
        self.upcoming = [op for op in receives if not self._posted(op)]  # the rest came with the last step
        self.unreceived = len(receives)
        self.following = self._receives(then) if then is not None else []
        if self.upcoming or (self.following and not receives):
            with tl.span(step, "post_recv"):
                if not receives:  # no receive to wait for: the next step's may go now
                    self.upcoming, self.following = self.following, []
                self._post_ahead()
        for op in ops:
            start = tl.mark()
            self.handlers[op.kind](op)
            tl.record(step, str(op), op.kind, start, tl.mark())
            mem.after(op.kind, op.stage, op.mb, op.layer)
            if self.following and not self.unreceived:
                with tl.span(step, "post_recv"):  # this step's receives are all in: the next step's
                    self.upcoming, self.following = self.following, []
                    self._post_ahead()
        with tl.span(step, "drain"):
            self.mailbox.drain()
        self.upcoming, self.following = [], []
        tl.end_step(step, step_start, tl.mark(), mem.end_step(step))
        with tl.span(step, "verdict"):
            self.agree(step)
        return float(self.loss_sum)

    def run_forward(self, tokens: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
        """Evaluation: only this rank's fwd ops and activation messages of the plan, in plan
        order (a sub-order of a deadlock-free order is deadlock-free), without gradients or
        K-FAC capture; returns this rank's share of the loss, like run_step."""
        self.tokens, self.targets, self.loss_sum = tokens, targets, 0.0
        self.capturing = False
        with torch.no_grad():
            for op in self.plan.ops(self.world.rank, 0):
                if op.kind in ("fwd", "send_act", "recv_act"):
                    self.handlers[op.kind](op)
            self.mailbox.drain()
        for sr in self.stages.values():
            sr.inputs.clear()
            sr.outputs.clear()
        self.memory.acts.clear()  # no backward will release what these forwards registered
        return float(self.loss_sum)

    def agree(self, step: int) -> None:
        """Every rank learns in the same step whether any diverged: this rank's verdict (one
        host read of the flags the forwards set without waiting, see _fwd, and the first
        failed inversion) goes into one all-reduce (MIN) of one integer over the world, and
        every rank raises the same NonFiniteError. A diverged rank alone stopping would
        leave the others waiting on it until the timeout.

        The all-reduce is posted here and read at the end of the next step (or at `settle`):
        waiting for it here would make every rank wait for the last one at every step's end,
        a barrier the plan does not have (it places a rank's next step after its own last op,
        and fills one rank's tail with work while the other starts the next step). So a
        divergence stops the run one step after it, every rank in the same step, naming the
        step it happened in; `settle` runs before anything reads the parameters."""
        flags, self.finite = self.finite, {}
        code, self.factor_failed = self.factor_failed, NO_DIVERGENCE
        if flags and not bool(torch.stack([ok for _, ok in sorted(flags.items())]).all()):
            code = min(code, divergence_code(stage=min(s for s, ok in flags.items() if not bool(ok))))
        self.settle()
        self._post_verdict(code, step)

    def settle(self) -> None:
        """Read the divergence check in flight (agree) and raise if any rank diverged: before
        an evaluation, a checkpoint or the model file, and at the end of the run."""
        if self.verdict is None:
            return
        (step, pending), self.verdict = self.verdict, None
        code = int(pending.wait())
        if code != NO_DIVERGENCE:
            raise NonFiniteError(divergence_message(code, step, self.plan))

    def agree_parameters(self, step: int) -> None:
        """As `agree`, for the parameters after the update of `step` (before a checkpoint
        or the model file is written: what is saved is always finite), once the step's own
        check is settled."""
        self.settle()
        code = min((divergence_code(stage=s, params=True) for s, sr in sorted(self.stages.items())
                    if not all(bool(all_finite(p.detach())) for p in sr.module.parameters())), default=NO_DIVERGENCE)
        self._post_verdict(code, step)
        self.settle()

    def _post_verdict(self, code: int, step: int) -> None:
        verdict = torch.tensor([code], dtype=torch.int64, device=self.world.device)
        self.verdict = (step, comm.post_all_reduce(verdict, f"the divergence check of step {step}",
                                                   self.world.timeout, op=comm.MIN, group=self.world.control))

    # --- pipeline ops -------------------------------------------------------------------------
    def _fwd(self, op: Op) -> None:
        sr = self.stages[op.stage]
        m = op.mb
        if sr.is_first:
            x = self.tokens[m]
        else:
            x = self._take(("act", op.stage - 1, m)).requires_grad_(True)
        with kfac.capturing(self.capture[op.stage], m, on=self.capturing), self._recording(op.stage, m):
            batch_views = ([x] if sr.is_first else []) + ([self.targets[m]] if sr.is_last else [])
            out = self.memory.forward(op.stage, m, lambda: self._stage_forward(sr, x, m), batch_views)
        if sr.is_last:  # a tensor sum, read after the step: no host wait on CUDA here
            self.loss_sum = self.loss_sum + out.detach()
        # a flag tensor per stage, read once after the step (no host wait per op)
        ok = all_finite(out.detach())
        self.finite[op.stage] = ok if op.stage not in self.finite else self.finite[op.stage] & ok
        sr.inputs[m], sr.outputs[m] = x, out

    def _stage_forward(self, sr: StageReplica, x: torch.Tensor, m: int) -> torch.Tensor:
        with self.precision.autocast(self.world.device.type):
            if sr.is_last:
                return sr.module(x, self.targets[m]) / self.N
            return self.precision.boundary(sr.module(x))

    def _bwd(self, op: Op) -> None:
        sr = self.stages[op.stage]
        m = op.mb
        out = sr.outputs.pop(m)
        with kfac.capturing(self.capture[op.stage], m, on=self.capturing):
            if sr.is_last:
                torch.autograd.backward(out)
            else:
                torch.autograd.backward(out, self._take(("grad", op.stage + 1, m)))
        x = sr.inputs.pop(m)
        if not sr.is_first:
            # Kept for the send (or, if the previous stage is on this rank, its backward).
            self.received[("grad", op.stage, m)] = x.grad

    def _recording(self, stage: int, m: int):
        split = self.split.get(stage)
        return split.recording(m) if split is not None else contextlib.nullcontext()

    def _bwd_input(self, op: Op) -> None:
        """B: the input gradient (and non-Linear parameters'); the Linear weights wait for W."""
        sr = self.stages[op.stage]
        m = op.mb
        out = sr.outputs.pop(m)
        grad = None if sr.is_last else self._take(("grad", op.stage + 1, m))
        x = sr.inputs.pop(m)
        with kfac.capturing(self.capture[op.stage], m, on=self.capturing):
            self.split[op.stage].backward_input(m, out, grad, None if sr.is_first else x)
        if not sr.is_first:
            self.received[("grad", op.stage, m)] = x.grad

    def _bwd_weight(self, op: Op) -> None:
        self.split[op.stage].backward_weight(op.mb)

    def _send(self, op: Op) -> None:
        kind, stage, m = op.message_key()
        if kind == "act":
            tensor = self.stages[stage].outputs[m]
        else:
            tensor = self.received.pop(("grad", stage, m))
        self.mailbox.send(str(op), tensor, op.peer, comm.message_tag(kind, stage, m, self.N))

    def _recv(self, op: Op) -> None:
        kind, stage, m = op.message_key()
        self.received[(kind, stage, m)] = self.mailbox.recv(
            str(op), self.act_shape, self.dtype, op.peer, comm.message_tag(kind, stage, m, self.N))
        self.unreceived -= 1
        self._post_ahead()

    def _receives(self, step: int) -> list[Op]:
        """The receive ops of this rank's `step` (none where receives are not posted ahead)."""
        if not self.recv_ahead:
            return []
        return [op for op in self.plan.ops(self.world.rank, step) if op.kind in ("recv_act", "recv_grad")]

    def _posted(self, op: Op) -> bool:
        kind, stage, m = op.message_key()
        return (op.peer, comm.message_tag(kind, stage, m, self.N)) in self.mailbox.posted

    def _post_ahead(self) -> None:
        """Keep the next `recv_ahead` receives of the step posted (in posting_order)."""
        batch = []
        while self.upcoming and len(self.mailbox.posted) + len(batch) < self.recv_ahead:
            batch.append(self.upcoming.pop(0))
        for op in posting_order(batch, self.mailbox.tags):
            kind, stage, m = op.message_key()
            self.mailbox.post(self.act_shape, self.dtype, op.peer, comm.message_tag(kind, stage, m, self.N))

    def _take(self, key: tuple[str, int, int]) -> torch.Tensor:
        """A received message, or the local producer's tensor when both stages are on this rank."""
        if key in self.received:
            return self.received.pop(key)
        kind, stage, m = key
        if kind == "act" and stage in self.stages:
            return self.stages[stage].outputs[m].detach()
        raise RuntimeError(f"rank {self.world.rank}: no {kind} of stage {stage} micro-batch {m} "
                           f"(the plan runs its consumer before its receive)")

    # --- the optimizer's ops (its declaration: pfcompile.formats.optimizers) ----------------------
    def _layer_op(self, op: Op) -> None:
        """The layer's method named by the op kind; a factor that cannot be refreshed (not
        finite, not positive definite) is recorded, and its pending slot filled with NaN."""
        if op.kind in self.deferred_kinds:
            return
        layer = self.layers[op.layer]
        try:
            getattr(layer, op.kind)(**OpContext(op.mb, op.factor, self.step_index % self.k).keywords())
        except kfac.NonFiniteFactorError:
            # the step runs on (its messages and collectives are awaited by other ranks)
            # with a NaN inverse, and every rank stops at its end (agree)
            code = divergence_code(layer=op.layer, factor=op.factor, factors=self.optimizer.ops.factors)
            self.factor_failed = min(self.factor_failed, code)
            if op.factor is not None:
                layer.set_pending(op.factor, torch.full(layer.pending_shape(op.factor), float("nan"),
                                                        dtype=self.precision.param_dtype, device=self.world.device))

    def _sync_curv(self, op: Op) -> None:
        group = self.stages[self.plan.layer_stage[op.layer]].group
        comm.all_reduce_sum([self.layers[op.layer].accumulator(op.factor)], group,
                            self.world.timeout, str(op))

    def _bcast_inv(self, op: Op) -> None:
        layer = self.layers[op.layer]
        group = self.stages[self.plan.layer_stage[op.layer]].group
        if self.world.rank == op.peer:
            tensor = layer.pending(op.factor)
        else:
            tensor = torch.empty(layer.pending_shape(op.factor), dtype=self.precision.param_dtype,
                                 device=self.world.device)
        comm.broadcast(tensor, op.peer, group, self.world.timeout, str(op))
        if self.world.rank != op.peer:
            layer.set_pending(op.factor, tensor)

    # --- gradients and the update ----------------------------------------------------------------
    def _sync_grad(self, op: Op) -> None:
        sr = self.stages[op.stage]
        for p in sr.module.parameters():  # every replica must contribute the same tensors
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in sr.module.parameters()]
        comm.all_reduce_sum(grads, sr.group, self.world.timeout, str(op))

    def _ag_grad(self, op: Op) -> None:
        """All-gather of divided work: each owned layer's update direction (K-FAC's and
        Shampoo's preconditioned gradient, Muon's orthogonalised one; with K-FAC its KL-clip
        term too) from the replica that made it, to the others. (rs_grad runs as the
        all-reduce of sync_grad: gloo has no reduce-scatter, and every replica then holds the
        summed gradient, a superset of its share.)"""
        sr = self.stages[op.stage]
        for l in sorted(sr.layers):
            owner = self.precond_owner[l]
            if owner is None:
                continue
            layer, src = sr.layers[l], self.rank_of[(op.stage, owner)]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in covered_parameters(layer)]
            like = grads[0]
            n = sum(g.numel() for g in grads)
            if self.world.rank == src:
                kl = getattr(layer, "kl_term", None)
                tail = torch.tensor([0.0 if kl is None else 1.0, 0.0 if kl is None else float(kl)], dtype=like.dtype,
                                    device=like.device)
                buf = torch.cat([g.reshape(-1) for g in grads] + [tail])
            else:
                buf = torch.empty(n + 2, dtype=like.dtype, device=like.device)
            comm.broadcast(buf, src, sr.group, self.world.timeout, str(op))
            if self.world.rank != src:
                at = 0
                for p, g in zip(covered_parameters(layer), grads):
                    p.grad = buf[at:at + g.numel()].reshape(g.shape).clone()
                    at += g.numel()
                if hasattr(layer, "kl_term"):
                    layer.kl_term = buf[-1].clone() if float(buf[-2]) else None

    def _step(self, op: Op) -> None:
        sr = self.stages[op.stage]
        if self.deferred_kinds:  # the update runs the layers' per-step ops: it needs the cycle's place
            self.update(sr, OpContext(cycle_step=self.step_index % self.k))
        else:
            self.update(sr)
