"""An optimizer added as a plugin: its declaration and its math in this one file, and the
whole chain handles it with no other file changed.

The plugin, "one-sided": K-FAC's input side alone. Per micro-batch of the refresh cycle's
first step it adds the layer input's Gram matrix to a statistic D (`dstat`, a kind of its
own); once per cycle it inverts D/rows + λI (`droot`); every step it preconditions the
weight's gradient G ← G (D/rows + λI)⁻¹ (`dprec`) with the inverse of the last cycle, and
SGD-momentum applies it (K-FAC's stage optimizer). It is named "module:attribute" like a
user's model code: `pfcompile plan --optimizer test_optimizer_plugin:ONE_SIDED` and the
runtime import this module and register ONE_SIDED, the runtime entry whose `declaration`
is the compiler's half.

What the chain must do with it, each with real parts: profile its costs, plan it with the
greedy and CP-SAT, refuse a moved op by the rule that names it (the verifier) and replay it,
render it and export the torch CSV, and run it on 2 ranks with torchrun equal to the
single-process trainer (float64, 1e-10).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pfcompile.formats.optimizers import CYCLE, IN, MICRO_BATCH, STEP, OpDecl, Optimizer, StateDecl, unregister
from runtime.optimizers import registry

NAME = f"{__name__}:ONE_SIDED"

# --- the declaration: what the compiler needs ------------------------------------------------------
DECLARATION = Optimizer(
    name=NAME,
    title="One-sided",
    factors=("D",),
    update="dprec",
    step_moments=1,      # SGD's momentum per covered weight
    step_like="kfac",    # its step is K-FAC's: SGD-momentum on the covered weights, AdamW on the rest
    state=(StateDecl("stat:D", (IN, IN)), StateDecl("root:D", (IN, IN), copies=2, owner_only=True)),
    doc="one-sided K-FAC: the inputs' Gram matrix per micro-batch, its damped inverse per cycle, "
        "G D^-1 every step",
    ops=(
        OpDecl("dstat", MICRO_BATCH, text="DS", reads=("input",), writes=("stat:D",), factor="D", cost="dstat",
               flops=lambda m, n, f: 2 * n * n, render=("input statistic (one-sided)", "#7a5195")),
        OpDecl("droot", CYCLE, text="DR", reads=("stat:D",), writes=("root:D",), cost="droot_{factor}",
               flops=lambda m, n, f: n ** 3, render=("inverse (one-sided)", "#ef5675")),
        OpDecl("dprec", STEP, text="DP", reads=("grad", "root:D"), writes=("grad",), cost="dprec",
               flops=lambda m, n, f: 2 * m * n * n, render=("precondition (one-sided)", "#ffa600")),
    ),
)


# --- the math: what the runtime needs ----------------------------------------------------------------
@dataclass
class OneSidedConfig:
    damping: float = 0.1  # relative to the inputs' mean square: a well-conditioned inverse
    refresh_steps: int = 1


class OneSidedLayer:
    """The state of one covered nn.Linear's weight: the inputs kept per micro-batch (captured
    by a forward hook while the runtime says so), the statistic, the inverse in force and the
    pending one (in force from the next cycle, as K-FAC's)."""

    def __init__(self, name: str, linear: torch.nn.Linear, cfg: OneSidedConfig):
        self.name, self.module, self.cfg = name, linear, cfg
        self.covered = (linear.weight,)
        self.capturing, self.mb, self.skip_grad_capture = False, 0, False  # set by the runtime
        self.saved: dict[int, torch.Tensor] = {}
        self.stat, self.rows = None, 0
        self.inverse, self._pending = None, None
        self.raw_grad_sq, self.kl_term = None, None
        linear.register_forward_hook(self._keep_input)

    def _keep_input(self, module, inputs, output):
        if self.capturing:
            self.saved[self.mb] = inputs[0].detach()

    def dstat(self, mb: int, **_) -> None:
        x = self.saved.pop(mb).reshape(-1, self.module.in_features)
        if self.stat is None:
            self.stat = torch.zeros(x.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
        self.stat.addmm_(x.t(), x)
        self.rows += x.shape[0]

    def droot(self, factor: str, **_) -> None:
        d = self.stat.shape[0]
        self._pending = torch.linalg.inv(self.stat / self.rows + self.cfg.damping * torch.eye(d, dtype=self.stat.dtype))
        self.stat.zero_()
        self.rows = 0

    def activate(self) -> None:
        if self._pending is not None:
            self.inverse, self._pending = self._pending, None

    def dprec(self, **_) -> None:
        G = self.module.weight.grad
        self.raw_grad_sq = None if G is None else (G * G).sum()
        if G is not None and self.inverse is not None:
            G.copy_(G @ self.inverse.to(G.dtype))

    def pending(self, factor: str) -> torch.Tensor:
        return self._pending

    def pending_shape(self, factor: str) -> tuple[int, int]:
        return (self.module.in_features, self.module.in_features)

    def set_pending(self, factor: str, tensor: torch.Tensor) -> None:
        self._pending = tensor

    def state_bytes(self) -> int:
        """What the runtime's memory meter counts of this layer's state."""
        return sum(t.numel() * t.element_size() for t in (self.stat, self.inverse, self._pending) if t is not None)

    def kept_bytes(self) -> int:
        """What the meter counts of the inputs kept for `dstat` (until it has run)."""
        return sum(x.numel() * x.element_size() for x in self.saved.values())

    def state_dict(self) -> dict:
        return {k: v.clone() for k, v in (("stat", self.stat), ("inverse", self.inverse), ("pending", self._pending))
                if v is not None} | {"rows": torch.tensor(self.rows)}

    def load_state_dict(self, sd: dict) -> None:
        self.stat, self.inverse, self._pending = sd.get("stat"), sd.get("inverse"), sd.get("pending")
        self.rows = int(sd["rows"])


ONE_SIDED = registry.OptimizerEntry(
    NAME, config=lambda job: OneSidedConfig(refresh_steps=job.kfac.refresh_steps or 1), config_class=OneSidedConfig,
    make_layer=lambda name, linear, cfg, micro_batches: OneSidedLayer(name, linear, cfg),
    captures=True, title="One-sided", refresh_what="inverse", declaration=DECLARATION)


# --- the chain ----------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
TESTS = str(Path(__file__).resolve().parent)
pytestmark = pytest.mark.e2e  # the runtime runs under torchrun, the graph through dot


@pytest.fixture(autouse=True, scope="module")
def _forgotten_afterwards():
    """NAME registers itself (both halves) the first time something resolves it; the other
    test modules of the session must see the built-in optimizers alone again."""
    yield
    unregister(NAME)
    registry.unregister(ONE_SIDED)


def _cli(*args) -> int:
    from pfcompile.cli import main

    return main([str(a) for a in args])


@pytest.fixture(scope="module")
def plugin_profile(tmp_path_factory) -> Path:
    """bert-tiny profiled for the plugin by `pfcompile profile --optimizer NAME`: its ops timed
    as the runtime runs them (the layer its registry entry makes, each op its method), and,
    as a reference profile would, estimated from their declared FLOPs."""
    from pfcompile.formats.profile import load_profile
    from pfcompile.profiler.optimizer_layers import estimated_optimizer_ms

    path = tmp_path_factory.mktemp("plugin") / "bert-tiny-one-sided.json"
    assert _cli("profile", "--model", "bert-tiny", "--optimizer", NAME, "--micro-batch", 2, "--seq-len", 16,
                "--repeats", 3, "--warmup", 1, "--no-comm", "--no-runtime-probe", "--quiet", "-o", path) == 0
    prof = load_profile(str(path))
    assert prof.provenance["optimizers"] == ["kfac", NAME]
    for layer in prof.covered_layers:
        assert set(layer.optimizer_ms[NAME]) == {"dstat", "droot_D", "dprec"}
        assert all(v > 0 for v in layer.optimizer_ms[NAME].values())
        estimate = estimated_optimizer_ms(NAME, layer.in_features, layer.out_features, 1e6)
        assert set(estimate) == set(layer.optimizer_ms[NAME])
    assert f"covered_layers.{prof.covered_layers[0].name}.optimizer_ms.{NAME}.droot_D" in prof.spread
    return path


@pytest.fixture(scope="module", params=["greedy", "cpsat"])
def plugin_plan(request, plugin_profile, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param) / "plan.json"
    assert _cli("plan", plugin_profile, "--schedule", "1f1b", "--stages", 2, "--micro-batches", 4,
                "--optimizer", NAME, *(["--refresh-steps", 2] if request.param == "cpsat" else []),
                "--method", request.param, "--time-limit", 10, "-o", out) == 0
    return out


def test_the_planners_place_the_plugins_ops(plugin_plan, capsys):
    from pfcompile.formats.plan import load_plan

    plan = load_plan(str(plugin_plan))
    assert plan.config.optimizer == NAME
    kinds = {op.kind for q in range(plan.world_size) for t in range(plan.refresh_steps) for op in plan.ops(q, t)}
    assert {"dstat", "droot", "dprec"} <= kinds and not kinds & {"curv_a", "inv", "precond"}
    texts = {str(op) for q in range(plan.world_size) for t in range(plan.refresh_steps) for op in plan.ops(q, t)}
    assert {"DS0.0", "DR0.D", "DP0"} <= texts
    assert _cli("inspect", plugin_plan) == 0  # the replay: the plan's statistics recomputed
    out = capsys.readouterr().out
    assert "DR0.D" in out and "DS0.0" in out


def test_a_moved_plugin_op_is_refused_by_the_rule_that_names_it(plugin_plan, tmp_path, capsys):
    obj = json.loads(plugin_plan.read_text())
    # the first step's first statistic of rank 0, moved before the forward whose input it reads
    for rank in obj["ranks"]:
        ops = rank["steps"][0]
        i = next((i for i, o in enumerate(ops) if o["op"] == "dstat"), None)
        if i is not None:
            ops.insert(0, ops.pop(i))
            break
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(obj))
    assert _cli("inspect", moved) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DS" in err[0] and "rule: dependency" in err[0], err


def test_render_and_the_torch_csv_show_the_plugin(plugin_plan, tmp_path, capsys):
    svg, trace, csv = tmp_path / "graph.svg", tmp_path / "trace.json", tmp_path / "order.csv"
    assert _cli("render", plugin_plan, "--graph", svg, "--trace", trace, "--torch-csv", csv) == 0
    drawn = svg.read_text().replace("&#45;", "-")  # dot escapes the hyphen
    assert "input statistic (one-sided)" in drawn and "DS0.0" in drawn
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"DS0.0", "DR0.D", "DP0"} <= names
    rows = csv.read_text().splitlines()
    assert rows and all("DS" not in r and "DP" not in r for r in rows)  # torch has no such actions
    assert "left out: One-sided ops" in capsys.readouterr().err  # and says so


def test_two_ranks_under_torchrun_equal_the_single_process_trainer(plugin_profile, tmp_path):
    from helpers import assert_same_params, distributed_params, optimizer_reference_params, torchrun

    plan = tmp_path / "plan.json"
    assert _cli("plan", plugin_profile, "--schedule", "1f1b", "--stages", 2, "--micro-batches", 4,
                "--optimizer", NAME, "--refresh-steps", 2, "--time-limit", 10, "-o", plan) == 0
    ckpt, steps = tmp_path / "ckpt", 5  # three refreshes, two of them in force
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), TESTS, os.environ.get("PYTHONPATH")) if p)}
    trace = tmp_path / "trace.json"
    r = torchrun(plan, 2, "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(steps),
                 "--trace", str(trace), env=env)
    assert r.returncode == 0, r.stdout[-3000:]
    ran = {e["name"][:2] for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"}
    assert {"DS", "DR", "DP"} <= ran  # the interpreter ran the plugin's ops, each its layer's method
    initial, want = optimizer_reference_params(plan, steps)
    # 1e-10 relative; a parameter whose gradient is rounding noise alone (attention's key bias:
    # softmax ignores a constant per query, and AdamW scales that noise up) stays near 0 and is
    # compared absolutely, to 1e-12
    assert_same_params(distributed_params(ckpt, steps, plan), want, initial, rtol=1e-10, floor=1e-2)
