"""Peak memory of one rank, per step, to set against the plan's predicted peak.

On CUDA it is the allocator's own figure: `torch.cuda.max_memory_allocated`, reset at the
start of every step. On CPU there is no allocator to ask, so the runtime counts what the
planner's memory model holds (pfcompile.graph.costs), from its own tensors:

- resident: parameters, gradients (while they exist), optimizer state, and per K-FAC layer
  its accumulators, factors, inverses in force and pending (with their spare slot);
- saved activations: what autograd saves for the backward in a stage's forward (storages
  counted once, parameters excluded, a micro-batch's tokens and targets — views of the
  step's batch — at their own size: the profiler's rule), held from the `fwd` until the
  end of its `bwd`. Shapes are fixed, so each stage is counted on its first forward and
  that count is reused (counting every forward would add a hook call per saved tensor);
- kept K-FAC tensors: each layer's saved inputs / output gradients, until their `curv_*`;
- split backward (zero-bubble families): the output gradients B keeps for W, until W ends;
  the activations stay until W too. A K-FAC output gradient that IS one of W's tensors
  counts once (the planner's rule), and so does a K-FAC kept input that IS the layer input
  W keeps (same storage): it is inside the activations while W holds it, and counts on its
  own only from W's end to its curv_a.

The count is taken after every op; a `bwd` (`bwd_weight`) is sampled before its activations
are released (the model frees them at the op's end, after the op allocated the kept output
gradients); a `bwd_weight` with the kept tensors as they were while it ran (the model's
kept inputs leave the activations at its end), then again after the release.

Counting is the runtime's own work between ops, which the plan does not have. So an op
recounts only its own micro-batch's kept tensors, and once two whole refresh cycles in a
row gave the same peak step by step the meter stops and reports the last cycle's peaks for
the steps after (a count that keeps growing never repeats, so it is counted to the end).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> int:
    """The storage a tensor lives in (views of one tensor share it)."""
    return t.untyped_storage().data_ptr()


def saved_activation_bytes(fn: Callable[[], object], exclude: set[int], inputs=()):
    """Run fn and sum the storages autograd saves for the backward, each storage once;
    storages in `exclude` (the parameters: resident anyway) do not count. A saved tensor in
    the storage of one of `inputs` counts that input's own bytes: a micro-batch's tokens and
    targets are views of the whole step's batch, which the profile counts one micro-batch's
    worth of (its inputs are their own tensors). -> (result, bytes)"""
    seen: dict[int, int] = {}
    own = {_storage(x): nbytes(x) for x in inputs}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = own.get(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def optimizer_state_bytes(optimizer) -> int:
    """Tensors in the state of each torch optimizer inside a runtime.optimizers.stage optimizer."""
    total = 0
    for opt in getattr(optimizer, "optimizers", [optimizer]):
        for state in opt.state.values():
            total += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


# ops that create or change gradients (a backward, or the gradient collectives)
GRAD_KINDS = ("bwd", "bwd_input", "bwd_weight", "sync_grad", "rs_grad", "ag_grad")


def _changed(counts: dict[int, int], layer, nbytes_now: int) -> int:
    """Record one layer's count; returns how much it changed since the last."""
    was = counts.get(id(layer), 0)
    counts[id(layer)] = nbytes_now
    return nbytes_now - was


class MemoryMeter:
    """Peak bytes of one rank within the current step."""

    def __init__(self, stages: dict, device: torch.device):
        self.stages, self.device = stages, device
        self.cuda = device.type == "cuda"
        self.layers = [layer for sr in stages.values() for layer in sr.layers.values()]
        self._params = {s: {_storage(p) for p in sr.module.parameters()}
                        for s, sr in stages.items()}
        # The resident count in parts, so an op recounts only what it can change (this runs
        # after every op): parameters never change size; the optimizer's state only at a step.
        self._opt_bytes = 0
        self._grad_bytes = 0
        self._layer_state_bytes = 0
        # kept tensors per (stage, micro-batch), so an op recounts only its own micro-batch;
        # only K-FAC's layers keep micro-batch captures
        self._stage_layers = {s: [x for x in sr.layers.values() if hasattr(x, "kept_of")]
                              for s, sr in stages.items()}
        self._layer = {i: layer for sr in stages.values() for i, layer in sr.layers.items()}
        self._layer_stage = {i: s for s, sr in stages.items() for i in sr.layers}
        self._kept_mb: dict[tuple[int, int], int] = {}
        # Shapes are fixed, so a micro-batch's kept bytes depend only on which of its tensors
        # exist: each such pattern is counted once, by storage, and the count reused (counting
        # storages after every op would be a visible share of a short step).
        self._kept_memo: dict[tuple, int] = {}
        # the optimizer's micro-batch op kinds (K-FAC's curv_a, curv_b): each consumes its
        # layer's kept captures (the interpreter sets them from the plan's declaration)
        self.micro_batch_kinds: frozenset[str] = frozenset()
        self._state_by: dict[int, int] = {}  # id(layer) -> its state bytes
        # per stage: its parameters, their gradients' bytes, and whether every one has its
        # gradient (then a backward adds into them in place: nothing to recount)
        self._stage_params = {s: list(sr.module.parameters()) for s, sr in stages.items()}
        self._param_bytes = sum(nbytes(p) for params in self._stage_params.values() for p in params)
        self._stage_grads = {s: 0 for s in stages}
        self._grads_whole = {s: False for s in stages}
        self.act_bytes: dict[int, int] = {}        # stage -> bytes one forward saves
        self.acts: dict[tuple[int, int], int] = {}  # (stage, mb) -> bytes held until its bwd ends
        self.resident = 0
        self.held_acts = 0   # sum of self.acts
        self.kept = 0        # K-FAC captures (+ W's output gradients) held now
        self.peak = 0
        self.split: dict = {}  # stage -> runtime.pipeline.split_backward.WeightPasses (zero-bubble families)
        # The plan's refresh cycle. Once two whole cycles in a row gave the same peak step by
        # step, the count is periodic (fixed shapes, the optimizer's state all allocated): the
        # meter stops counting and reports the last cycle's peaks, so the steps after cost
        # nothing the plan does not have. A count that still grows (a leak) never repeats.
        self.cycle = 1
        self.steady = False
        self._peaks: list[tuple[int, int]] = []  # (step, peak) of the steps counted, in order

    # --- the step -------------------------------------------------------------------------------
    def begin_step(self) -> None:
        if self.steady:
            return
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.resident = self._resident()
        self.held_acts = sum(self.acts.values())
        self.kept = self._kept()
        self.peak = self.resident + self.held_acts + self.kept

    def end_step(self, step: int) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.steady:
            return self._peaks[-self.cycle + (step - self._peaks[-1][0] - 1) % self.cycle][1]
        self._peaks.append((step, self.peak))
        last = self._peaks[-2 * self.cycle:]
        self.steady = (len(last) == 2 * self.cycle and last[-1][0] - last[0][0] == 2 * self.cycle - 1
                       and [b for _, b in last[:self.cycle]] == [b for _, b in last[self.cycle:]])
        return self.peak

    # --- ops ------------------------------------------------------------------------------------
    def forward(self, stage: int, mb: int, fn: Callable[[], object], inputs=()):
        """Run a stage's forward, counting its saved activations the first time. `inputs`:
        the micro-batch's tokens / targets (saved_activation_bytes)."""
        if self.cuda or self.steady:
            return fn()
        if stage not in self.act_bytes:
            out, self.act_bytes[stage] = saved_activation_bytes(fn, self._params[stage], inputs)
        else:
            out = fn()
        self.acts[(stage, mb)] = self.act_bytes[stage]
        self.held_acts += self.act_bytes[stage]
        return out

    def after(self, kind: str, stage: int | None = None, mb: int | None = None, layer: int | None = None) -> None:
        """Count after an op; `bwd` before releasing the activations of (stage, mb). `layer`:
        an optimizer op's layer."""
        if self.cuda or self.steady:
            return
        # Recount only what the op can change, and only where: this runs after every op, and
        # recounting everything each time would be a visible share of the step. An op's stage
        # and layer are this rank's: its handler has already run on them.
        if kind == "step":  # zero_grad, the optimizer's state, the inverses coming into force
            self.resident = self._resident()
        elif kind in GRAD_KINDS:  # gradients appear
            if not self._grads_whole[stage]:
                self._recount_grads(stage)
            self.resident = self._sum_resident()
        elif layer is not None and kind not in self.micro_batch_kinds:
            # an optimizer's layer op: a pending inverse or root, statistics, momentum
            x = self._layer[layer]
            self._layer_state_bytes += _changed(self._state_by, x, x.state_bytes())
            self.resident = self._sum_resident()
        consumes = kind in self.micro_batch_kinds
        if consumes or kind in ("fwd", "bwd", "bwd_input"):
            # a forward or backward keeps its micro-batch's tensors; a micro-batch op frees its layer's
            self._recount_kept(self._layer_stage[layer] if consumes else stage, mb)
        self.peak = max(self.peak, self.resident + self.held_acts + self.kept)
        if kind in ("bwd", "bwd_weight"):  # a split backward's W keeps the activations until it ends
            self.held_acts -= self.acts.pop((stage, mb), 0)
        if kind == "bwd_weight":  # its output gradients are gone; its kept inputs stand alone now
            self._recount_kept(stage, mb)
            self.peak = max(self.peak, self.resident + self.held_acts + self.kept)

    # --- counting -------------------------------------------------------------------------------
    def _resident(self) -> int:
        """Parameters, their gradients, optimizer state and the K-FAC layers' state, all recounted."""
        self._opt_bytes = sum(optimizer_state_bytes(sr.optimizer) for sr in self.stages.values())
        self._grad_bytes = self._grads()
        self._layer_state_bytes = self._layer_state()
        return self._sum_resident()

    def _grads(self) -> int:
        for s in self._stage_params:
            self._recount_grads(s, total=False)
        return sum(self._stage_grads.values())

    def _recount_grads(self, stage: int, total: bool = True) -> None:
        grads = [p.grad for p in self._stage_params[stage]]
        b = sum(nbytes(g) for g in grads if g is not None)
        if total:
            self._grad_bytes += b - self._stage_grads[stage]
        self._stage_grads[stage] = b
        self._grads_whole[stage] = all(g is not None for g in grads)

    def _layer_state(self) -> int:
        self._state_by = {id(x): x.state_bytes() for x in self.layers}
        return sum(self._state_by.values())

    def _sum_resident(self) -> int:
        return self._param_bytes + self._grad_bytes + self._opt_bytes + self._layer_state_bytes

    def _recount_kept(self, stage: int, mb: int) -> None:
        was = self._kept_mb.get((stage, mb), 0)
        self._kept_mb[(stage, mb)] = now = self._kept_of(stage, mb)
        self.kept += now - was

    def _kept(self) -> int:
        """Everything kept now, recounted per (stage, micro-batch)."""
        held = {(s, m) for s, layers in self._stage_layers.items() for layer in layers
                for m in layer.kept_micro_batches()}
        held |= {(s, m) for s, wp in self.split.items() for m in (*wp.saved, *wp.kept)}
        self._kept_mb = {sm: self._kept_of(*sm) for sm in held}
        return sum(self._kept_mb.values())

    def _kept_of(self, stage: int, mb: int) -> int:
        """One micro-batch's kept tensors: its K-FAC captures and, split backward, W's output
        gradients. A K-FAC kept input that IS a layer input W holds (same storage) is inside
        the activations, and an output gradient both keep counts once (module doc)."""
        captured = [layer.kept_of(mb) for layer in self._stage_layers.get(stage, ())]
        wp = self.split.get(stage)
        saved, kept = (wp.saved.get(mb), wp.kept.get(mb)) if wp is not None else (None, None)
        key = (stage, tuple((a is not None, b is not None) for a, b in captured), saved is not None,
               kept is not None)
        if key not in self._kept_memo:
            self._kept_memo[key] = _count_kept(captured, saved or [], kept or [])
        return self._kept_memo[key]


def _count_kept(captured: list, saved: list, kept: list) -> int:
    """MemoryMeter._kept_of's count, by storage. captured: per K-FAC layer (input, output
    gradient) or None; saved: W's per-Linear [input, output] before B; kept: W's per-Linear
    (module, input, output gradient) after B."""
    held_inputs = {_storage(s[0]) for s in saved if s is not None} | {_storage(x) for _, x, _ in kept}
    total = sum(nbytes(a) for a, _ in captured if a is not None and _storage(a) not in held_inputs)
    total += sum(nbytes(b) for _, b in captured if b is not None)
    shared = {_storage(b) for _, b in captured if b is not None}
    return total + sum(nbytes(g) for _, _, g in kept if g is not None and _storage(g) not in shared)
