"""A model's parts timed as the runtime runs them: each part is `runtime.models.Stage` over
that one part with its K-FAC hooks attached; forward, backward, the split backward's B and W
(runtime.pipeline.split_backward), and the optimizer step (runtime.pipeline.build.Update),
with the bytes each keeps. The pipeline ops are timed with the hooks idle (a step that does
not refresh, and every step of the other optimizers) and capturing (K-FAC's refresh step):
the difference is the part's `capture_ms`."""

from __future__ import annotations

import torch

from pfcompile.formats.profile import Part
from pfcompile.profiler.clocks import Clock, Timing
from pfcompile.profiler.settings import SEED

# one definition with the runtime's memory count, so the planner's model and the run count
# the same bytes
from runtime.observe.memory import nbytes, saved_activation_bytes


class PartBench:
    """One part built as the runtime builds a stage, with its K-FAC layers attached."""

    def __init__(self, spec, name: str, micro_batch: int, seq_len: int, device, dtype):
        from runtime.config.precision import precision
        from runtime.models import Stage, kfac_linears
        from runtime.optimizers import kfac

        self.name, self.cfg = name, spec.cfg
        # bfloat16 is mixed precision as the runtime runs it: float32 parameters and K-FAC
        # state, autocast forward, bf16 activations between parts (runtime.config.precision)
        self.precision = precision(str(dtype).removeprefix("torch."))
        self.device_type = torch.device(device).type
        dtype = self.precision.compute_dtype
        self.stage = Stage(spec, [name], seed=SEED, dtype=self.precision.param_dtype).to(device)
        self.is_first, self.is_last = name == spec.part_names[0], name == spec.part_names[-1]
        self.kfac = kfac.make_layers(kfac_linears(self.stage), kfac.KfacConfig(), loss_divisor=1.0)
        self._capturing = kfac.capturing
        g = torch.Generator().manual_seed(SEED)
        shape = (micro_batch, seq_len)
        if self.is_first:
            self.x = torch.randint(self.cfg.vocab, shape, generator=g).to(device)
        else:
            self.x = torch.randn(*shape, self.cfg.hidden, generator=g).to(device=device, dtype=dtype)
        self.targets = torch.randint(self.cfg.vocab, shape, generator=g).to(device) if self.is_last else None
        self.out = None
        self.grad_out = None
        self.capture = True  # the hooks save inputs and output gradients (a K-FAC refresh step)

    def capturing(self):
        return self._capturing(self.kfac, 0, on=self.capture)

    def forward(self):
        x = self.x if self.is_first else self.x.detach().requires_grad_(True)
        self.last_input = x  # the split backward's B asks for its gradient
        with self.capturing(), self.precision.autocast(self.device_type):
            self.out = self.stage(x, self.targets) if self.is_last else self.precision.boundary(self.stage(x))
        return self.out

    def backward(self):
        with self.capturing():
            if self.is_last:
                torch.autograd.backward(self.out)
            else:
                torch.autograd.backward(self.out, self.grad_out)
        self.out = None

    def param_storages(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self.stage.parameters()}


def measure_part(bench: PartBench, clock: Clock, optimizers: tuple[str, ...] = ()) -> tuple[Part, dict[str, Timing]]:
    out, act = saved_activation_bytes(bench.forward, bench.param_storages())
    out_bytes = 0 if bench.is_last else nbytes(out)
    if not bench.is_last:
        g = torch.Generator().manual_seed(SEED + 1)
        bench.grad_out = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    timed: dict[bool, dict[str, Timing]] = {}
    for capture in (False, True) if bench.kfac else (False,):  # a part without K-FAC layers captures nothing
        bench.capture = capture
        timed[capture] = measure_passes(bench, clock)
    params = list(bench.stage.parameters())
    grad_bytes = sum(nbytes(p.grad) for p in params if p.grad is not None)
    steps = measure_step(bench, clock, optimizers)
    own, hooked = timed[False], timed.get(True, timed[False])
    # what capturing adds, alone: K-FAC's hooks saving the tensors (a run adds holding them,
    # which the runtime probe fits); below the two medians' noise it is 0
    capture = {key.removesuffix("_ms"): max(0.0, hooked[key].median - t.median) for key, t in own.items()}
    part = Part(name=bench.name, fwd_ms=own["fwd_ms"].median, bwd_ms=own["bwd_ms"].median, act_bytes=act,
                param_bytes=sum(nbytes(p) for p in params), grad_bytes=grad_bytes, out_bytes=out_bytes,
                step_ms={k: t.median for k, t in steps.items()},
                bwd_input_ms=own["bwd_input_ms"].median, bwd_weight_ms=own["bwd_weight_ms"].median,
                wgrad_bytes=weight_pass_kept_bytes(bench), capture_ms=capture)
    return part, {**own, **{f"step_ms.{k}": t for k, t in steps.items()}}


def weight_pass_kept_bytes(bench: PartBench) -> int:
    """What the part's W keeps besides its activations after B: every nn.Linear's output
    gradient (runtime.pipeline.split_backward.WeightPasses.kept), counted as runtime.observe.memory counts it."""
    from runtime.pipeline.split_backward import WeightPasses

    split = WeightPasses(bench.stage)
    try:
        with split.recording(0):
            bench.forward()
        split.backward_input(0, bench.out, None if bench.is_last else bench.grad_out,
                             None if bench.is_first else bench.last_input)
        bench.out = None
        return sum(nbytes(g) for _, _, g in split.kept.pop(0) if g is not None)
    finally:
        split.close()
        split.saved.clear()
        split.kept.clear()


def measure_passes(bench: PartBench, clock: Clock) -> dict[str, Timing]:
    """The part's forward, its backward and the zero-bubble families' split backward, as the
    runtime's interpreter runs it (runtime.pipeline.split_backward.WeightPasses): the forward
    recorded for the split, B (`backward_input`: input gradient, non-Linear parameters', Linear
    output gradients kept) and W (`backward_weight`: each Linear's weight gradient from the
    kept tensors), with K-FAC's hooks capturing or idle as `bench.capture` says. Each timed run
    starts from its own forward (and B). The four are timed in turn (Clock.time_in_turn):
    the planner compares a plan with B and W against one with the whole backward, so B + W
    over bwd must not carry the machine's drift between two timings."""
    from runtime.pipeline.split_backward import WeightPasses

    split = WeightPasses(bench.stage)
    x = None

    def forward():
        nonlocal x
        with split.recording(0):
            bench.forward()
        x = bench.last_input

    def backward_input():
        with bench.capturing():
            split.backward_input(0, bench.out, None if bench.is_last else bench.grad_out,
                                 None if bench.is_first else x)
        bench.out = None

    def backward_weight():
        split.backward_weight(0)

    def forward_and_b():
        forward()
        backward_input()

    try:
        return clock.time_in_turn({"fwd_ms": (bench.forward, None), "bwd_ms": (bench.backward, bench.forward),
                                   "bwd_input_ms": (backward_input, forward),
                                   "bwd_weight_ms": (backward_weight, forward_and_b)})
    finally:
        split.close()
        split.saved.clear()
        split.kept.clear()


def measure_step(bench: PartBench, clock: Clock, optimizers: tuple[str, ...] = ()) -> dict[str, Timing]:
    """The `step` op over this part's parameters, as runtime.pipeline.build.Update runs it (the
    gradient norm's share, the KL clip where the optimizer's entry clips, its stage optimizer),
    for K-FAC (SGD-momentum on its layers, AdamW on the rest), the first-order baseline's AdamW
    and each other optimizer in `optimizers` (its registry entry's layers on the part's covered
    Linears: Muon's scaled add, Shampoo's SGD). Each run starts from the gradients of a real
    backward, each covered layer holding what its update op leaves (the replaced gradient's
    norm; for the KL clip, a preconditioned-gradient term); the optimizers' state exists from
    the warm-up on, as in every step after the first. The parameters are restored afterwards."""
    from runtime.config.job import JobConfig
    from runtime.optimizers import registry
    from runtime.optimizers.stage import build_optimizer
    from runtime.pipeline.build import Update
    from runtime.pipeline.interpreter import StageReplica

    params = list(bench.stage.parameters())
    saved = [p.detach().clone() for p in params]
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    job = JobConfig()

    out = {}
    for name in dict.fromkeys(("kfac", "adamw", *optimizers)):
        entry = registry.entry(name)
        math_cfg = entry.math_config(job)
        if name == "kfac":
            layers = bench.kfac
        elif name == "adamw":
            layers = []
        else:
            layers = [entry.layer(l.name, l.module, math_cfg, 1) for l in bench.kfac]
        replica = StageReplica(stage=0, replica=0, module=bench.stage, layers=dict(enumerate(layers)),
                               optimizer=build_optimizer(bench.stage, layers, optimizer=name), group=None,
                               is_first=bench.is_first, is_last=bench.is_last)
        update = Update(entry, math_cfg)

        def fresh(layers=layers, update=update):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            for l in layers:
                w = l.module.weight.grad
                l.raw_grad_sq = (w * w).sum()
                if update.kl_clip is not None:
                    l.kl_term = l.raw_grad_sq

        def step(replica=replica, update=update):
            update(replica)
            update.norm_sq = 0.0

        out[name] = clock.time(step, setup=fresh)
    with torch.no_grad():
        for p, v, g in zip(params, saved, grads):
            p.copy_(v)
            p.grad = g
    for l in bench.kfac:
        l.kl_term = l.raw_grad_sq = None
    return out
