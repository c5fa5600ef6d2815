"""Split backward for the zero-bubble families: B (input gradient) now, W (weight gradients) later.

B runs the stage's backward with `torch.autograd.grad`, asking for the gradients of the
stage input, of the parameters that are not an nn.Linear's, and of every nn.Linear's
OUTPUT. Autograd then computes only what those need: each Linear's input gradient (the
critical path) but not its weight gradient. The Linear inputs (saved by a forward hook)
and the output gradients B returns are kept; W computes each Linear's weight gradient
from them, gW = gᵀx and gb = Σg over tokens, the same products autograd would have
formed: nothing of the backward runs twice. K-FAC's curv_b reads the same output
gradients (its hook holds a reference to the tensor B made, no copy), which is why the
planner lets curv_b run with or after W and counts the tensor once.

The alternative, torch.distributed.pipelining's stage_backward_input/stage_backward_weight,
keeps the autograd graph alive between B and W and walks it again for the weights; here
the graph is freed at the end of B and W is plain matmuls.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn


class WeightPasses:
    """The split backward of one stage module (all its micro-batches in flight)."""

    def __init__(self, module: nn.Module):
        self.linears = [m for m in module.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]
        in_linear = {id(p) for m in self.linears for p in m.parameters()}
        self.others = [p for p in module.parameters() if p.requires_grad and id(p) not in in_linear]
        self._index = {id(m): i for i, m in enumerate(self.linears)}
        self._recording: int | None = None
        self.saved: dict[int, list] = {}  # mb -> per Linear [input, output] from the forward
        self.kept: dict[int, list] = {}  # mb -> per Linear (input, output gradient) for W
        self._hooks = [m.register_forward_hook(self._save) for m in self.linears]

    def _save(self, module, inputs, output):
        if self._recording is not None:
            slot = self.saved[self._recording][self._index[id(module)]]
            if slot is not None:
                raise RuntimeError("an nn.Linear used twice in one forward cannot have a split backward")
            self.saved[self._recording][self._index[id(module)]] = [inputs[0].detach(), output]

    @contextmanager
    def recording(self, mb: int):
        """Keep each Linear's input and output of this micro-batch's forward."""
        self.saved[mb] = [None] * len(self.linears)
        self._recording = mb
        try:
            yield
        finally:
            self._recording = None

    def backward_input(self, mb: int, out: torch.Tensor, grad_out: torch.Tensor | None,
                       x: torch.Tensor | None) -> None:
        """B: x.grad (if x needs one) and the non-Linear parameters' gradients (accumulated);
        keeps what W needs."""
        saved = self.saved.pop(mb)
        used = [i for i, s in enumerate(saved) if s is not None]
        wanted = ([x] if x is not None and x.requires_grad else []) + self.others
        outs = [saved[i][1] for i in used]
        grads = torch.autograd.grad(out, wanted + outs, grad_outputs=grad_out, allow_unused=True)
        for p, g in zip(wanted, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self.kept[mb] = [(self.linears[i], saved[i][0], g) for i, g in zip(used, grads[len(wanted):])]

    def backward_weight(self, mb: int) -> None:
        """W: each Linear's weight (and bias) gradient of the micro-batch, accumulated."""
        for lin, x, g in self.kept.pop(mb):
            if g is None:  # the output did not reach the loss
                continue
            g2 = g.reshape(-1, g.shape[-1])
            # under autocast the Linear ran in g's dtype; the gradient lands in the weight's
            gw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(lin.weight.dtype)
            lin.weight.grad = gw if lin.weight.grad is None else lin.weight.grad + gw
            if lin.bias is not None and lin.bias.requires_grad:
                gb = g2.sum(0).to(lin.bias.dtype)
                lin.bias.grad = gb if lin.bias.grad is None else lin.bias.grad + gb

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
