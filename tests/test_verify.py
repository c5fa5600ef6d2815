"""The plan verifier (pfcompile.formats.verify): every planner's output passes it, every
class of hand edit that used to train silently wrong, crash or hang is refused by the
runtime before training with the rule named, and the NCCL per-pair message order holds.

Runtime refusals are checked through runtime.config.cli.prepare, the function every rank runs
before joining the process group (one subprocess run shows the exit status and the line).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import uniform_profile

from pfcompile.formats.errors import InputError
from pfcompile.formats.plan import plan_from_json
from pfcompile.formats.profile import load_profile
from pfcompile.formats.verify import verify_plan
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.place.build import build_plan
from pfcompile.place.options import PlanOptions

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "profiles" / "bert-tiny-cpu.json"


# --- every planner emits only plans the verifier accepts (incl. the per-pair order) ----------

def _families(D: int) -> list[dict]:
    out = [dict(schedule="gpipe", stages=D, micro_batches=D), dict(schedule="1f1b", stages=D, micro_batches=D + 1),
           dict(schedule="1f1b", stages=D, micro_batches=2 * D, replicas=2),
           dict(schedule="interleaved", stages=D, micro_batches=D, virtual_stages=2),
           dict(schedule="zb-h1", stages=D, micro_batches=D + 1),
           dict(schedule="zb-v", stages=D, micro_batches=D, virtual_stages=2),
           dict(schedule="dualpipev", stages=D, micro_batches=2 * D, virtual_stages=2)]
    if D % 2 == 0:
        out.append(dict(schedule="chimera", stages=D, micro_batches=D))
    return out


def _check(kw: dict, method: str, **opts) -> None:
    prof = uniform_profile(blocks=kw["stages"] * kw.get("virtual_stages", 1), curv=0.3, inv=0.7)
    plan, _, _ = build_plan(prof, PipelineConfig(**kw), PlanOptions(method, **opts))
    # what the file says, read back as the runtime reads it
    verify_plan(plan_from_json(plan.to_json()), profile_model=prof.model)


@pytest.mark.parametrize("D", [2, 3, 4, 8])
def test_every_family_none_and_greedy_pass_on_2_to_16_ranks(D):
    for kw in _families(D):
        for method in ("none", "greedy"):
            _check(kw, method, time_limit=1)  # bounds only the stats' first-order CP-SAT plan


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-order", "free-order"])
@pytest.mark.parametrize("kw", [dict(schedule="gpipe", stages=2, micro_batches=2),
                                dict(schedule="1f1b", stages=3, micro_batches=4),
                                dict(schedule="1f1b", stages=2, micro_batches=4, replicas=2),
                                dict(schedule="interleaved", stages=2, micro_batches=2, virtual_stages=2),
                                dict(schedule="zb-h1", stages=2, micro_batches=3),
                                dict(schedule="chimera", stages=4, micro_batches=4)],
                         ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_every_family_cpsat_passes(kw, fixed):
    _check(kw, "cpsat", time_limit=2, fixed_order=fixed)


# --- hand edits, refused by the runtime before training, with the rule named ------------------------

@pytest.fixture(scope="module")
def plan_obj() -> dict:
    """A real planner output the runtime can build (bert-tiny, 1F1B on 2 ranks, K-FAC placed
    by the greedy over a refresh cycle of several steps)."""
    plan, _, _ = build_plan(load_profile(str(TINY)), PipelineConfig("1f1b", 2, 4), PlanOptions("greedy"))
    assert plan.refresh_steps >= 2
    return plan.to_json()


def _ops(obj, q, t):
    return obj["ranks"][q]["steps"][t]


def _find(ops, **want):
    return next(i for i, d in enumerate(ops) if all(d.get(k) == v for k, v in want.items()))


def _where_kfac(obj, kind):
    """(rank, step, index) of the first op of a kind."""
    for q, r in enumerate(obj["ranks"]):
        for t, ops in enumerate(r["steps"]):
            for i, d in enumerate(ops):
                if d["op"] == kind:
                    return q, t, i
    raise AssertionError(kind)


def curv_after_inversion(o):
    q, t, i = _where_kfac(o, "inv")
    layer, f = _ops(o, q, t)[i]["layer"], _ops(o, q, t)[i]["factor"]
    kind = "curv_a" if f == "A" else "curv_b"
    for tt in range(len(o["ranks"][q]["steps"])):
        ops = _ops(o, q, tt)
        j = next((j for j, d in enumerate(ops) if d["op"] == kind and d["layer"] == layer), None)
        if j is not None:
            curv = ops.pop(j)
            q2, t2, i2 = next((q, t, k) for t in range(len(o["ranks"][q]["steps"]))
                              for k, d in enumerate(_ops(o, q, t)) if d["op"] == "inv" and d["layer"] == layer
                              and d["factor"] == f)
            _ops(o, q2, t2).insert(i2 + 1, curv)
            return


def inversion_deleted(o):
    q, t, i = _where_kfac(o, "inv")
    del _ops(o, q, t)[i]


def precond_duplicated(o):
    q, t, i = _where_kfac(o, "precond")
    _ops(o, q, t).insert(i, dict(_ops(o, q, t)[i]))


def step_skipped(o):
    ops = _ops(o, 1, 1)
    del ops[_find(ops, op="step")]


def kfac_removed_from_rank(o):
    kinds = {"curv_a", "curv_b", "sync_curv", "inv", "bcast_inv", "precond"}
    for steps in o["ranks"][0]["steps"]:
        steps[:] = [d for d in steps if d["op"] not in kinds]


def fwd_bwd_swapped(o):
    ops = _ops(o, 0, 0)
    i, j = _find(ops, op="fwd", stage=0, mb=0), _find(ops, op="bwd", stage=0, mb=0)
    ops[i], ops[j] = ops[j], ops[i]


def step_reversed(o):
    _ops(o, 1, 0).reverse()


def receive_deleted(o):
    ops = _ops(o, 1, 0)
    del ops[_find(ops, op="recv_act", mb=1)]


def receive_moved_to_next_step(o):
    ops = _ops(o, 1, 0)
    _ops(o, 1, 1).insert(0, ops.pop(_find(ops, op="recv_act", mb=1)))


def send_micro_batch_changed(o):
    ops = _ops(o, 0, 0)
    ops[_find(ops, op="send_act", mb=1)]["mb"] = 2


def kfac_off_with_kfac_ops(o):
    o["config"]["optimizer"] = "adamw"


def other_optimizers_ops(o):  # Shampoo's plan listing K-FAC's curvature
    o["config"]["optimizer"] = "shampoo"


def step_before_last_backward(o):
    ops = _ops(o, 0, 0)
    u = ops.pop(_find(ops, op="step"))
    ops.insert(_find(ops, op="bwd", mb=3), u)


def micro_batch_changed(o):
    o["model"]["micro_batch"] = 16


def hidden_changed(o):
    o["model"]["hidden"] = 128


def start_far_negative(o):
    _ops(o, 0, 0)[0]["start"] = -1e12


def receives_swapped(o):
    """RA0.1 moved in front of RA0.0 on rank 1: both arrive before their consumers, so only
    the order of the pair's messages is wrong; under NCCL the receive meant for micro-batch
    1's activation would get micro-batch 0's (same shape: silently wrong)."""
    ops = _ops(o, 1, 0)
    r1 = ops.pop(_find(ops, op="recv_act", mb=1))
    ops.insert(_find(ops, op="recv_act", mb=0), r1)


MUTATIONS = [
    (curv_after_inversion, "rule: dependency"), (inversion_deleted, "rule: complete"),
    (precond_duplicated, "rule: once"), (step_skipped, "rule: complete"), (kfac_removed_from_rank, "rule: complete"),
    (fwd_bwd_swapped, "rule: dependency"), (step_reversed, "rule: dependency"),
    (receive_deleted, "rule: dependency"), (receive_moved_to_next_step, "rule: once"),
    (send_micro_batch_changed, "rule: "), (kfac_off_with_kfac_ops, "rule: ops"), (other_optimizers_ops, "rule: ops"),
    (step_before_last_backward, "rule: dependency"), (micro_batch_changed, "rule: model"),
    (hidden_changed, "rule: model"), (start_far_negative, "rule: times"),
    (receives_swapped, "rule: pair order"),
]


def _prepare(path: Path, *flags: str, world_size: int = 2):
    from runtime.config.cli import build_parser, prepare

    return prepare(build_parser().parse_args([str(path), *flags]), 0, world_size)


@pytest.mark.parametrize("mutate,rule", MUTATIONS, ids=[m.__name__ for m, _ in MUTATIONS])
def test_each_mutation_is_refused_by_the_runtime_before_training(tmp_path, plan_obj, mutate, rule):
    obj = copy.deepcopy(plan_obj)
    mutate(obj)
    path = tmp_path / "mutated.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(InputError) as e:
        _prepare(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)) and rule in msg, msg


def test_the_unmutated_plan_and_a_pulled_forward_receive_are_accepted(tmp_path, plan_obj):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_obj))
    _prepare(path)
    obj = copy.deepcopy(plan_obj)  # RA0.1 received right after RA0.0: the send order, only earlier
    ops = _ops(obj, 1, 0)
    r1 = ops.pop(_find(ops, op="recv_act", mb=1))
    i = _find(ops, op="recv_act", mb=0) + 1
    r1["start"] = r1["end"] = ops[i - 1]["end"]  # re-timed as taking no time there: times stay ordered
    ops.insert(i, r1)
    path.write_text(json.dumps(obj))
    _prepare(path)


@pytest.mark.e2e
def test_swapped_receives_are_refused_naming_the_pair(tmp_path, plan_obj):
    obj = copy.deepcopy(plan_obj)
    receives_swapped(obj)
    path = tmp_path / "swapped.json"
    path.write_text(json.dumps(obj))
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2"}
    r = subprocess.run([sys.executable, "-m", "runtime", str(path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert "messages from rank 0 to rank 1 in step 0 do not match in order" in r.stderr
    assert "send #1 SA0.0>1" in r.stderr and "receive #1 RA0.1<0" in r.stderr


# --- Shampoo's and Muon's ops: refused as K-FAC's are ----------------------------------------------

def _tiny_with_optimizer_costs():
    """bert-tiny's profile with Shampoo's and Muon's per-layer costs estimated (the committed
    profile has none; a plan's timing does not matter here, only its ops)."""
    from pfcompile.profiler.optimizer_layers import estimated_optimizer_ms

    prof = load_profile(str(TINY))
    for layer in prof.covered_layers:
        for opt in ("shampoo", "muon"):
            layer.optimizer_ms.setdefault(opt, estimated_optimizer_ms(opt, layer.in_features, layer.out_features, 1e6))
    return prof


@pytest.fixture(scope="module")
def shampoo_plan_obj() -> dict:
    """Shampoo on bert-tiny, 1F1B on 2 ranks, CP-SAT with a refresh cycle of 2 steps."""
    cfg = PipelineConfig("1f1b", 2, 4, optimizer="shampoo")
    plan, _, _ = build_plan(_tiny_with_optimizer_costs(), cfg, PlanOptions("cpsat", time_limit=10, refresh_steps=2))
    return plan.to_json()


@pytest.fixture(scope="module")
def muon_plan_obj() -> dict:
    """Muon on bert-tiny, Chimera on 2 ranks, each layer's work on the replica that owns it."""
    cfg = PipelineConfig("chimera", 2, 4, optimizer="muon")
    plan, _, _ = build_plan(_tiny_with_optimizer_costs(), cfg, PlanOptions("greedy", precond="layers"))
    assert plan.config.precond_division == "layers"
    return plan.to_json()


def _listed(o, kind, **want):
    """(rank, step, index) of every op of a kind (with the fields asked for)."""
    return [(q, t, i) for q, r in enumerate(o["ranks"]) for t, ops in enumerate(r["steps"])
            for i, d in enumerate(ops) if d["op"] == kind and all(d.get(k) == v for k, v in want.items())]


def shampoo_root_deleted(o):  # a layer's L root never computed
    q, t, i = _listed(o, "inv", factor="L")[0]
    del _ops(o, q, t)[i]


def shampoo_root_before_its_statistics(o):
    """The cycle's step-0 `stats` of a layer moved after the `inv` that reads its snapshot
    (the inv put in step 0 in front of it)."""
    q, t, i = _listed(o, "inv", factor="R")[0]
    inv = _ops(o, q, t).pop(i)
    _, _, j = _listed(o, "stats", layer=inv["layer"])[0]
    assert _listed(o, "stats", layer=inv["layer"])[0][:2] == (q, 0)
    _ops(o, q, 0).insert(j, inv)


def shampoo_stats_moved_to_next_step(o):  # step 0's statistics of a layer listed in step 1 instead
    q, t, i = _listed(o, "stats")[0]
    assert t == 0
    _ops(o, q, 1).insert(0, _ops(o, q, 0).pop(i))


def shampoo_with_kfac_curvature(o):  # K-FAC's curv_a listed in a Shampoo plan
    q, t, i = _listed(o, "stats")[0]
    _ops(o, q, t).insert(i, {**_ops(o, q, t)[i], "op": "curv_a", "mb": 0})


def muon_orth_deleted(o):
    q, t, i = _listed(o, "orth")[0]
    del _ops(o, q, t)[i]


def muon_orth_on_the_other_replica(o):
    """A layer's orth listed also on the rank of the stage's replica that does not own it."""
    q, t, i = _listed(o, "orth")[0]
    layer = _ops(o, q, t)[i]["layer"]
    stage = o["layer_stage"][layer]
    other = next(p["rank"] for p in o["placement"] if p["stage"] == stage and p["rank"] != q)
    assert next(p["replica"] for p in o["placement"] if p["rank"] == q and p["stage"] == stage) == \
        o["config"]["precond_owner"][layer]
    ops = _ops(o, other, t)
    ops.insert(_find(ops, op="step", stage=stage), dict(_ops(o, q, t)[i]))


def muon_with_shampoo_statistics(o):  # Shampoo's stats listed in a Muon plan
    q, t, i = _listed(o, "orth")[0]
    _ops(o, q, t).insert(i, {**_ops(o, q, t)[i], "op": "stats"})


OPTIMIZER_MUTATIONS = [
    ("shampoo", shampoo_root_deleted, "rule: complete"),
    ("shampoo", shampoo_root_before_its_statistics, "rule: dependency"),
    ("shampoo", shampoo_stats_moved_to_next_step, "rule: complete"),
    ("shampoo", shampoo_with_kfac_curvature, "rule: ops"),
    ("muon", muon_orth_deleted, "rule: complete"),
    ("muon", muon_orth_on_the_other_replica, "rule: ops"),
    ("muon", muon_with_shampoo_statistics, "rule: ops"),
]


@pytest.mark.parametrize("optimizer,mutate,rule", OPTIMIZER_MUTATIONS, ids=[m.__name__ for _, m, _ in OPTIMIZER_MUTATIONS])
def test_each_optimizer_mutation_is_refused_by_the_verifier_and_the_runtime(tmp_path, request, optimizer, mutate,
                                                                            rule):
    obj = copy.deepcopy(request.getfixturevalue(f"{optimizer}_plan_obj"))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(obj))
    _prepare(path)  # the plan as made is accepted
    mutate(obj)
    path.write_text(json.dumps(obj))
    with pytest.raises(InputError) as by_verifier:
        verify_plan(plan_from_json(obj, str(path)), str(path))
    with pytest.raises(InputError) as by_runtime:
        _prepare(path)
    for e in (by_verifier, by_runtime):
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(str(path)) and rule in msg, msg
# --- one definition of a valid plan: what the runtime refuses, inspect refuses ----------------

def _rehash(o):
    from pfcompile.formats.verify import model_hash

    o["profile"]["model_hash"] = model_hash(o["model"], o["profile"]["hash"])  # a plan made for the edited spec


def part_not_in_model(o):
    o["partition"][1][0] = "\u00e9"  # the fuzzer's 'é'


def parts_out_of_order(o):
    o["partition"][0], o["partition"][1] = o["partition"][1], o["partition"][0]


def part_missing(o):
    o["partition"][1].pop()  # the head


def layer_on_a_stage_without_its_part(o):
    o["layer_stage"][0] = 1  # block0's layer on the stage holding block1, head


def layer_not_covered(o):
    o["layers"][0] = "head.proj"


def layer_twice(o):
    o["layers"][1] = o["layers"][0]


def built_in_resized(o):
    o["model"]["layers"] = 3
    _rehash(o)


def dtype_not_run(o):
    o["model"]["dtype"] = "float16"
    _rehash(o)


def user_model_parts_differ(o):
    o["model"]["name"] = "pkg.mod:model"
    _rehash(o)
    o["partition"][1][0] = "other"  # the profile recorded block1


AGREE = [part_not_in_model, parts_out_of_order, part_missing, layer_on_a_stage_without_its_part, layer_not_covered,
         layer_twice, built_in_resized, dtype_not_run, user_model_parts_differ]


@pytest.mark.parametrize("mutate", AGREE, ids=[m.__name__ for m in AGREE])
def test_inspect_refuses_what_the_runtime_refuses_with_the_same_line(tmp_path, plan_obj, capsys, mutate):
    from pfcompile.cli import main as pfcompile_main

    obj = copy.deepcopy(plan_obj)
    mutate(obj)
    path = tmp_path / "mutated.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(InputError) as e:
        _prepare(path, *(["--model-code", obj["model"]["name"]] if ":" in obj["model"]["name"] else []))
    msg = str(e.value)
    assert "rule: model" in msg and "\n" not in msg, msg
    assert pfcompile_main(["inspect", str(path)]) == 2
    assert capsys.readouterr().err == f"pfcompile inspect: error: {msg}\n"


def test_the_runtime_refuses_user_code_whose_parts_are_not_the_plans(plan_obj, monkeypatch):
    """What only the runtime can check: the parts of the user model's code. A plan whose
    recorded parts (and cut) the verifier accepts is refused in one line when the code
    imported by --model-code has other parts."""
    from runtime.config.cli import _check_plan_fits_model
    from runtime.models import resolve_model

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    spec = resolve_model("my_model:build")  # embed, block0..block2, head
    plan = plan_from_json(copy.deepcopy(plan_obj), "<plan>")  # bert-tiny's: embed, block0, block1, head
    with pytest.raises(InputError) as e:
        _check_plan_fits_model(plan, spec, "plan.json")
    msg = str(e.value)
    assert msg.startswith("plan.json: partition: ") and "does not cut the model's parts" in msg and "\n" not in msg
    assert "'block2'" in msg


def test_a_plan_of_a_model_without_code_is_checked_against_its_profiles_parts(tmp_path, plan_obj, capsys):
    """Planning needs no model code: a plan of a model that is neither built in nor user
    code (a reference or synthetic profile) passes the verifier and inspect, its partition
    and layers checked against the parts its profile recorded; the runtime alone refuses
    it, in one line, as a model it cannot build."""
    from pfcompile.cli import main as pfcompile_main
    from pfcompile.formats.rules import PlanError

    obj = copy.deepcopy(plan_obj)
    obj["model"]["name"] = "bert-tiny-synthetic"
    _rehash(obj)
    path = tmp_path / "synthetic.json"
    path.write_text(json.dumps(obj))
    verify_plan(plan_from_json(obj, str(path)), str(path))
    assert pfcompile_main(["inspect", str(path)]) == 0
    assert "bert-tiny-synthetic" in capsys.readouterr().out
    with pytest.raises(InputError) as e:
        _prepare(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: model.name: unknown model 'bert-tiny-synthetic'") and "\n" not in msg, msg

    def refused(edit, field: str) -> str:
        bad = copy.deepcopy(obj)
        edit(bad)
        with pytest.raises(PlanError) as e:
            verify_plan(plan_from_json(bad, str(path)), str(path))
        msg = str(e.value)
        assert msg.startswith(f"{path}: {field}: ") and "rule: model" in msg and "\n" not in msg, msg
        return msg

    assert "'block1'" in refused(lambda o: o["partition"][1].__setitem__(0, "block7"), "partition[1][0]")
    refused(lambda o: o["layer_stage"].__setitem__(0, 1), "layers[0]")  # block0's layer on block1's stage
    assert "lies past the model's last part 'block1'" in refused(lambda o: o["profile"]["parts"].pop(), "partition[1][1]")
    refused(lambda o: o["profile"].pop("parts"), "profile.parts")  # nothing to check it against
    refused(lambda o: o["profile"].__setitem__("parts", "embed"), "profile.parts")


def test_a_synthetic_profile_plans_and_verifies():
    """A profile of a model without code, as benchmarks/planner.py's scaling makes one
    (BERT-Large's block costs, more blocks, its own name), plans and verifies."""
    prof = uniform_profile(blocks=4)
    prof.model = {**prof.model, "name": "uniform-4-blocks"}
    prof.to_json()
    plan, _, _ = build_plan(prof, PipelineConfig("1f1b", 4, 4), PlanOptions("greedy"))
    verify_plan(plan_from_json(plan.to_json()), profile_model=prof.model, profile_hash=prof.hash)


def test_a_spec_edited_after_planning_is_refused_naming_the_field(plan_obj, tmp_path, capsys):
    """The plan binds its spec to the hash of the profile it was costed from: a micro-batch
    edited with the spec's own hash recomputed is refused from the file alone; edited
    with the binding recomputed too, by a reader that holds the profile (pfcompile plan,
    `pfcompile inspect PLAN --profile PROFILE`), naming the field; and a plan that names
    another profile, naming its hash."""
    from pfcompile.cli import main as pfcompile_main
    from pfcompile.formats.jsonio import canonical_hash
    from pfcompile.formats.rules import PlanError

    tiny = load_profile(str(TINY))
    obj = copy.deepcopy(plan_obj)
    verify_plan(plan_from_json(obj), profile_model=tiny.model, profile_hash=tiny.hash)  # as made
    obj["model"]["micro_batch"] = 3
    obj["profile"]["model_hash"] = canonical_hash(obj["model"])
    with pytest.raises(PlanError) as e:
        verify_plan(plan_from_json(obj, "p.json"), "p.json")
    assert str(e.value).startswith("p.json: model: differs from the spec") and "rule: model" in str(e.value)
    _rehash(obj)
    verify_plan(plan_from_json(obj, "p.json"), "p.json")  # consistent in itself: the profile tells
    with pytest.raises(PlanError) as e:
        verify_plan(plan_from_json(obj, "p.json"), "p.json", profile_model=tiny.model, profile_hash=tiny.hash)
    assert str(e.value).startswith("p.json: model.micro_batch: 3 but the profile's is 8"), str(e.value)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(obj))
    assert pfcompile_main(["inspect", str(path)]) == 0
    capsys.readouterr()
    assert pfcompile_main(["inspect", str(path), "--profile", str(TINY)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pfcompile inspect: error: {path}: model.micro_batch: 3 but the profile's is 8")
    assert err.count("\n") == 1
    other = copy.deepcopy(plan_obj)
    other["profile"]["hash"] = "sha256:" + "0" * 64
    _rehash(other)
    with pytest.raises(PlanError) as e:
        verify_plan(plan_from_json(other, "p.json"), "p.json", profile_model=tiny.model, profile_hash=tiny.hash)
    assert str(e.value).startswith("p.json: profile.hash: 'sha256:000") and "another profile" in str(e.value)


def test_a_plan_records_its_profiles_parts():
    """What the verifier checks a user model's partition against."""
    prof = uniform_profile(blocks=2)
    plan, _, _ = build_plan(prof, PipelineConfig("1f1b", 2, 2), PlanOptions("none"))
    assert plan.profile["parts"] == [p.name for p in prof.parts]


# --- the paper setting: Chimera D=8 passes the per-pair check ------------------------------------

def test_paper_setting_greedy_passes_the_per_pair_check():
    prof = load_profile(str(ROOT / "profiles" / "bert-large-p100-ref.json"))
    plan, _, _ = build_plan(prof, PipelineConfig("chimera", 8, 8), PlanOptions("greedy"))
    verify_plan(plan_from_json(plan.to_json()), profile_model=prof.model)
