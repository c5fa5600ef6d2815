"""The runtime's optimizer registry: an optimizer declared and registered in this one file
(its own op kinds: a per-micro-batch statistic, a per-cycle refresh, a per-step scaling;
its own config section) is trained by the single-process trainer from its declaration
alone, equal to the same algorithm written out by hand; its section's keys are set as any
key is; it is found by "module:attribute"; the built-in entries describe what the runtime
used to branch on."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pfcompile.formats.errors import InputError
from pfcompile.formats.optimizers import CYCLE, MICRO_BATCH, STEP, OpDecl, Optimizer
from runtime.config import job as job_config
from runtime.config.job import POSITIVE_FINITE, JobConfig, setting
from runtime.io.data import make_stream, split_micro_batches
from runtime.models import build_model, kfac_linears, resolve_config
from runtime.optimizers import registry
from runtime.optimizers.stage import OptimConfig, build_optimizer
from runtime.train import make_optimizer_layers, train_step

M, STEPS, K, EPS = 2, 5, 2, 1e-3


@dataclass
class DiagSettings:  # its own config section, [diag]
    eps: float = setting(EPS, "added to the mean squared gradient", POSITIVE_FINITE)


@dataclass
class DiagConfig:
    eps: float = EPS
    refresh_steps: int = K


class DiagLayer:
    """A diagonal preconditioner refreshed once per cycle: the mean over the cycle's first
    step's micro-batches of the (accumulating) weight gradient squared, 1/sqrt(. + eps)."""

    def __init__(self, name, linear, cfg: DiagConfig):
        self.name, self.module, self.cfg = name, linear, cfg
        self.covered = (linear.weight,)
        self.acc, self.count, self.pending, self.scale = None, 0, None, None
        self.raw_grad_sq = None

    def gsq(self, mb, factor, **_):  # micro-batch op: after the micro-batch's backward
        g = self.module.weight.grad
        self.acc = g * g if self.acc is None else self.acc + g * g
        self.count += 1

    def refresh(self, factor, **_):  # cycle op, per factor
        self.pending = (self.acc / self.count + self.cfg.eps).rsqrt()
        self.acc, self.count = None, 0

    def scale_grad(self, **_):  # step op
        g = self.module.weight.grad
        self.raw_grad_sq = (g * g).sum()
        if self.scale is not None:
            g.mul_(self.scale)

    def activate(self):
        if self.pending is not None:
            self.scale, self.pending = self.pending, None


DECLARATION = Optimizer(
    name="diag-test", factors=("D",), update="scale_grad",
    ops=(OpDecl("gsq", MICRO_BATCH, reads=("output_grad",), writes=("stat:D",), factor="D"),
         OpDecl("refresh", CYCLE, reads=("stat:D",), writes=("root:D",)),
         OpDecl("scale_grad", STEP, reads=("grad", "root:D"), writes=("grad",))))

DIAG = registry.OptimizerEntry(
    "diag-test", config=lambda job: DiagConfig(eps=job.diag.eps), config_class=DiagConfig,
    section="diag", settings=DiagSettings,
    make_layer=lambda name, linear, cfg, n: DiagLayer(name, linear, cfg), declaration=DECLARATION)


@pytest.fixture(autouse=True, scope="module")
def registered():
    """The plugin's one register() call; undone at the module's end, so the other tests of the
    session see the runtime's own optimizers and config sections only."""
    registry.register(DIAG)
    yield
    registry.unregister(DIAG)


def _model():
    return build_model(resolve_config("bert-tiny", seq_len=16), seed=0, dtype=torch.float64)


def test_a_plugin_trains_from_its_declaration_as_written_by_hand():
    cfg, optim = DiagConfig(), OptimConfig(lr=0.05, adam_no_decay="")  # the reference decays all
    stream = make_stream(resolve_config("bert-tiny", seq_len=16).kind, 4, 16, seed=0)
    model = _model()
    layers = make_optimizer_layers(model, "diag-test", cfg, M)
    assert [type(l) for l in layers] == [DiagLayer] * len(kfac_linears(model))
    opt = build_optimizer(model, layers, optim, optimizer="diag-test")
    losses = [train_step(model, layers, opt, stream.batch(t), t, M, cfg) for t in range(STEPS)]

    # by hand: the same algorithm, no registry and no trainer
    ref = _model()
    linears = [lin for _, lin in kfac_linears(ref)]
    covered = {id(lin.weight) for lin in linears}
    sgd = torch.optim.SGD([p for p in ref.parameters() if id(p) in covered], lr=optim.lr, momentum=optim.momentum)
    adamw = torch.optim.AdamW([p for p in ref.parameters() if id(p) not in covered], lr=optim.adam_lr,
                              betas=optim.adam_betas, weight_decay=optim.adam_weight_decay)
    scale, pending, want = {}, {}, []
    for t in range(STEPS):
        refresh = t % K == 0
        if refresh:
            scale.update(pending)
        for o in (sgd, adamw):
            o.zero_grad(set_to_none=True)
        acc = {i: 0 for i in range(len(linears))}
        step_losses = []
        for tokens, targets in split_micro_batches(stream.batch(t), M):
            loss = ref(tokens, targets)
            (loss / M).backward()
            step_losses.append(float(loss.detach()))
            if refresh:
                for i, lin in enumerate(linears):
                    acc[i] = acc[i] + lin.weight.grad ** 2
        if refresh:
            pending = {i: (acc[i] / M + EPS).rsqrt() for i in acc}
        for i, lin in enumerate(linears):
            if i in scale:
                lin.weight.grad.mul_(scale[i])
        sgd.step()
        adamw.step()
        want.append(sum(step_losses) / M)
    assert losses == pytest.approx(want, rel=1e-12, abs=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=name)
    assert any(l.scale is not None for l in layers)  # the refresh came into force


def test_an_optimizer_named_module_attribute_is_imported_on_demand():
    assert registry.entry("test_optimizer_registry:DIAG") is DIAG
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        registry.entry("lion")
    with pytest.raises(ValueError, match="cannot import it"):
        registry.entry("no_such_module_here:ENTRY")


def test_a_plugin_brings_its_own_config_section():
    cfg = job_config.load(overrides=["diag.eps=0.25", "train.steps=3"])
    assert cfg.diag.eps == 0.25 and DIAG.math_config(cfg).eps == 0.25
    assert DIAG.math_config(JobConfig()).eps == EPS  # its default
    assert "[diag]\neps = 0.25" in cfg.to_toml()
    with pytest.raises(InputError, match="unknown key; known: diag.eps"):
        job_config.load(overrides=["diag.nope=1"])
    with pytest.raises(InputError, match="must be"):
        job_config.load(overrides=["diag.eps=-1"])


def test_the_built_in_entries_say_what_the_runtime_branched_on():
    kfac, shampoo, muon, adamw = (registry.entry(n) for n in ("kfac", "shampoo", "muon", "adamw"))
    assert {"kfac", "shampoo", "muon", "adamw"} <= set(registry.names())
    assert kfac.kl_clip and kfac.captures and not shampoo.kl_clip and not shampoo.captures
    assert muon.clip_first and not kfac.clip_first and not shampoo.clip_first
    assert (kfac.base_lr, shampoo.base_lr, muon.base_lr, adamw.base_lr) == \
        ("optimizer.lr", "shampoo.lr", "muon.lr", "optimizer.adam_lr")
    assert adamw.math_config(None) is None and adamw.ops.ops == ()
    # every layer has a method for every op kind of its declaration that is not a collective
    model = _model()
    for e in (kfac, shampoo, muon):
        layers = make_optimizer_layers(model, e.name, e.math_config(JobConfig()), M)
        for d in e.ops.ops:
            assert d.collective or callable(getattr(layers[0], d.kind)), (e.name, d.kind)
        for l in layers if e.captures else ():
            l.detach()  # K-FAC's hooks off the shared model


def test_unregistering_a_plugin_removes_its_section_and_names():
    registry.unregister(DIAG)
    try:
        assert "diag-test" not in registry.names() and "diag" not in job_config.SECTIONS
        assert not hasattr(JobConfig(), "diag")
        with pytest.raises(InputError, match="unknown key"):
            job_config.load(overrides=["diag.eps=0.5"])
    finally:
        registry.register(DIAG)
