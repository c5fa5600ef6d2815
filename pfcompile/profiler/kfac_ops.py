"""A part's K-FAC layers timed as the runtime runs them: curvature, inversion (Cholesky and
eigen) and preconditioning are `runtime.optimizers.kfac.KfacLayer.curv_a/curv_b/invert/precondition`,
fed the layer's real input and output gradient of one micro-batch."""

from __future__ import annotations

import torch

from pfcompile.formats.optimizers import KFAC
from pfcompile.formats.profile import CoveredLayer
from pfcompile.profiler.clocks import Clock, Timing
from pfcompile.profiler.parts import PartBench
from runtime.observe.memory import nbytes


def capture_layer_tensors(bench: PartBench) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each K-FAC layer's real input and output gradient of one micro-batch (for re-saving
    before every timed curvature op, which consumes what was saved)."""
    got: dict[str, list] = {l.name: [None, None] for l in bench.kfac}
    handles = []
    for l in bench.kfac:
        def hook(module, inputs, output, name=l.name):
            got[name][0] = inputs[0].detach()
            output.register_hook(lambda gy: got[name].__setitem__(1, gy.detach()))
        handles.append(l.module.register_forward_hook(hook))
    bench.forward()
    bench.backward()
    for h in handles:
        h.remove()
    return {n: (x, gy) for n, (x, gy) in got.items()}


def measure_kfac_layer(layer, part: str, x: torch.Tensor, gy: torch.Tensor,
                       clock: Clock) -> tuple[CoveredLayer, dict[str, Timing]]:
    from runtime.optimizers.kfac import KfacConfig

    t: dict[str, Timing] = {}
    t["curv_a"] = clock.time(lambda: layer.curv_a(0), setup=lambda: layer.save_input(0, x))
    t["curv_b"] = clock.time(lambda: layer.curv_b(0), setup=lambda: layer.save_grad(0, gy))
    # An inversion EMA-updates its own factor first (runtime.optimizers.kfac: once per cycle): timed
    # with it, in the steady state (a previous cycle's factor exists, updated in place).
    layer.update_factors()
    inverse_bytes = {"A": 0, "B": 0}
    for method in ("cholesky", "eigen"):
        layer.cfg = KfacConfig(inverse=method)
        for f in ("A", "B"):
            t[f"inv_{f}.{method}"] = clock.time(lambda f=f: layer.invert(f),
                                                            setup=lambda f=f: layer.undo_update_mark(f))
            # the larger of the two methods' inverses (eigen packs [Q | eigenvalues]):
            # the memory a plan needs whichever method it picks
            inverse_bytes[f] = max(inverse_bytes[f], nbytes(layer.pending(f)))
    # preconditioning with Cholesky inverses in force (the runtime's default method)
    layer.cfg = KfacConfig(inverse="cholesky")
    layer.invert("A")
    layer.invert("B")
    layer.activate()
    w, b = layer.module.weight, layer.module.bias
    w_grad = w.grad.detach().clone()
    b_grad = b.grad.detach().clone() if b is not None else None

    def fresh_grads():  # precondition() replaces the gradients: start each run from the same ones
        w.grad = w_grad.clone()
        if b is not None:
            b.grad = b_grad.clone()

    t["precond"] = clock.time(layer.precondition, setup=fresh_grads)
    fresh_grads()
    lin = layer.module
    entry = CoveredLayer(
        name=layer.name, part=part, in_features=lin.in_features, out_features=lin.out_features,
        bias=lin.bias is not None,
        # K-FAC's cost keys (pfcompile.formats.optimizers.KFAC.cost_keys), in their order
        optimizer_ms={"kfac": {k: t[k].median for k in KFAC.cost_keys()}},
        kept_a_bytes=nbytes(x), kept_b_bytes=nbytes(gy),
        factor_a_bytes=nbytes(layer.factors["A"]), factor_b_bytes=nbytes(layer.factors["B"]),
        inverse_a_bytes=inverse_bytes["A"], inverse_b_bytes=inverse_bytes["B"],
    )
    return entry, t
