"""An optimizer declared in one place (pfcompile.formats.optimizers) flows through the profile
format, the costs and memory, calibration, inspect's tables and the render's colours, with no
optimizer's name in those modules: a toy optimizer, declared here only, is read by each."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from pfcompile.calibrate.fit import calibrate
from pfcompile.calibrate.measured import MeasuredOp, MeasuredTrace
from pfcompile.formats.errors import InputError
from pfcompile.formats.ops import Op
from pfcompile.formats.optimizers import BROADCAST, CYCLE, IN, OPTIMIZERS, OUT, STEP, OpDecl, Optimizer, StateDecl
from pfcompile.formats.profile import format_profile, load_profile, profile_from_json
from pfcompile.graph.costs import Costs
from pfcompile.render.style import FALLBACK_COLOUR, color_of, group_of, label_of, legend_groups

ROOT = Path(__file__).resolve().parents[1]

# one factor (R, in x in) refreshed per cycle and broadcast; a per-step statistic and update;
# a kind of its own that the renderer has no colour for (`toy_probe`, drawn as declared)
TOY = Optimizer(
    name="toy", title="Toy", factors=("R",), update="precond", step_moments=1, step_like="kfac",
    state=(StateDecl("stat:R", (IN, IN), copies=2), StateDecl("root:R", (IN, IN), owner_only=True),
           StateDecl("stat:R@0", (IN, IN), owner_only=True, multi_step=True), StateDecl("velocity", (OUT, IN))),
    ops=(
        OpDecl("stats", STEP, reads=("grad",), writes=("stat:R",), cost="gram"),
        OpDecl("inv", CYCLE, reads=("stat:R",), writes=("root:F",), divide=True, cost="root_{factor}"),
        OpDecl("bcast_inv", CYCLE, reads=("root:F",), writes=("root:F",), collective=True, transfer=BROADCAST),
        OpDecl("precond", STEP, reads=("grad", "root:R"), writes=("grad",), divide=True, cost="apply"),
        OpDecl("toy_probe", STEP, reads=("grad",), writes=(), render=("probe (Toy)", "#123456")),
        OpDecl("toy_plain", STEP, reads=("grad",), writes=()),
    ),
)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(OPTIMIZERS, "toy", TOY)
    prof = load_profile(str(ROOT / "profiles" / "bert-tiny-cpu.json"))
    for i, layer in enumerate(prof.covered_layers):
        layer.optimizer_ms["toy"] = {"gram": 0.01 * (i + 1), "root_R": 0.5 + i, "apply": 0.002 * (i + 1)}
    prof.to_json()
    return prof


def test_declared_cost_keys_are_the_profiles_entries_and_are_checked_on_load(toy, tmp_path):
    assert TOY.cost_keys() == ("gram", "root_R", "apply")
    path = tmp_path / "toy.json"
    toy.save(str(path))
    again = load_profile(str(path))
    assert [l.optimizer_ms["toy"] for l in again.covered_layers] == [l.optimizer_ms["toy"] for l in toy.covered_layers]
    obj = json.loads(path.read_text())
    del obj["covered_layers"][3]["optimizer_ms"]["toy"]["root_R"]
    with pytest.raises(InputError, match=r"covered_layers\[3\]\.optimizer_ms\.toy\.root_R"):
        profile_from_json(obj, str(path), check_hash=False)
    text = format_profile(again)
    table = text.split("\nToy per layer")[1].split("\n\n")[0].splitlines()
    assert table[1].split() == ["layer", "gram", "root_R", "apply"]
    assert table[3].split() == [toy.covered_layers[0].name, "0.010", "0.500", "0.002"]


def test_costs_and_memory_follow_the_declaration(toy):
    parts = [p.name for p in toy.parts]
    costs = Costs(toy, [parts[:2], parts[2:]], replicas=2, optimizer="toy", refresh_steps=2)
    layer = toy.covered_layers[4]
    runtime = toy.runtime.op_ms
    assert costs.duration(Op("stats", layer=4)) == pytest.approx(layer.optimizer_ms["toy"]["gram"] + runtime)
    assert costs.duration(Op("inv", layer=4, factor="R")) == pytest.approx(layer.optimizer_ms["toy"]["root_R"] + runtime)
    assert costs.duration(Op("precond", layer=4)) == pytest.approx(layer.optimizer_ms["toy"]["apply"] + runtime)
    # the broadcast moves one copy of what it writes: root:R, in x in at float32
    root = layer.in_features ** 2 * 4
    assert costs.root_bytes(4, "R") == root
    assert costs.duration(Op("bcast_inv", layer=4, factor="R", peer=0)) == pytest.approx(toy.comm.bcast_ms(root, 2) + runtime)
    with pytest.raises(ValueError, match="no cost"):
        costs.duration(Op("orth", layer=4))  # not a toy op
    # state: 2 statistics on every replica and the velocity; the root and the snapshot (k > 1) where it works
    weights = layer.in_features * layer.out_features * 4
    assert costs.layer_state_bytes(4, does_its_work=False) == 2 * root + weights
    assert costs.layer_state_bytes(4, does_its_work=True) == 2 * root + weights + root + root
    k1 = Costs(toy, [parts[:2], parts[2:]], replicas=2, optimizer="toy", refresh_steps=1)
    assert k1.layer_state_bytes(4, does_its_work=True) == 2 * root + weights + root
    # its step: the declared step_like's entry; one moment per covered weight (no bias)
    assert costs.step_ms(0) == pytest.approx(sum(toy.part(p).step_ms["kfac"] for p in parts[:2]))
    covered = sum(l.weight_elements * 4 for l in toy.covered_layers if l.part in parts[:2])
    assert costs.optimizer_state_bytes(0) == covered + 2 * max(0, costs.param_bytes(0) - covered)
    # nothing kept per micro-batch: no micro-batch op reads a pass
    assert costs.allocates(Op("fwd", stage=0, mb=0), refresh=True) == [(("act", 0, 0), costs.act_bytes(0))]


def test_calibration_fits_the_declared_entries(toy):
    parts = [p.name for p in toy.parts]
    layout = {"partition": [parts], "optimizer": "toy", "inverse": "cholesky"}
    meta = {"plan_sha256": "sha256:test", "plan_profile": {"hash": toy.hash}, "plan_model": {"name": toy.name},
            "plan_layout": layout, "warmup_steps": 0}
    ops, t = [], 0.0
    for step in range(3):  # each op 1 ms apart, on one rank
        for op, ms in ((Op("stats", layer=2), 0.25), (Op("inv", layer=2, factor="R"), 0.75), (Op("precond", layer=2), 0.5)):
            ops.append(MeasuredOp(0, step, op, t, t + ms))
            t += ms + 0.01
    fitted, counts = calibrate(copy.deepcopy(toy), [MeasuredTrace("toy-trace.json", meta, ops)])
    got = fitted.covered_layers[2].optimizer_ms["toy"]
    assert got == pytest.approx({"gram": 0.25, "root_R": 0.75, "apply": 0.5}, abs=1e-9)
    assert counts["stats"] == counts["inv"] == counts["precond"] == 1
    assert fitted.covered_layers[3].optimizer_ms["toy"] == toy.covered_layers[3].optimizer_ms["toy"]  # not traced: kept


def test_render_draws_a_kind_it_has_no_colour_for_as_declared(toy):
    assert group_of("toy_probe") == "toy_probe"
    assert color_of("toy_probe") == "#123456" and label_of("toy_probe") == "probe (Toy)"
    assert color_of("toy_plain") == FALLBACK_COLOUR and label_of("toy_plain") == "toy_plain"
    assert color_of("precond") != FALLBACK_COLOUR  # a shared kind keeps its own group
    assert legend_groups({"toy_probe", "fwd", "step"}) == ["fwd", "step", "toy_probe"]
    with pytest.raises(ValueError, match="no colour for op kind 'nothing'"):
        group_of("nothing")
