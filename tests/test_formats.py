"""The contracts: op vocabulary text form, profile and plan loaders, atomic writes."""

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pfcompile.formats.errors import InputError
from pfcompile.formats.jsonio import canonical_hash, read_json, write_json
from pfcompile.formats.ops import OP_KINDS, Op, parse_op
from pfcompile.formats.plan import plan_from_json
from pfcompile.formats.profile import load_profile, profile_from_json

PROFILE = os.path.join(os.path.dirname(__file__), "..", "profiles", "bert-base-p100-ref.json")

nat = st.integers(min_value=0, max_value=999)


@st.composite
def ops(draw):
    kind = draw(st.sampled_from(sorted(OP_KINDS)))
    need = OP_KINDS[kind][1]
    fields = {f: draw(nat) for f in need if f != "factor"}
    if "factor" in need:
        fields["factor"] = draw(st.sampled_from(["A", "B"]))
    return Op(kind, **fields)


@given(ops())
def test_op_text_and_dict_round_trip(op):
    assert parse_op(str(op)) == op
    assert Op.from_dict(op.to_dict()) == op
    assert Op.from_dict(json.loads(json.dumps(op.to_dict()))) == op


def test_op_text_examples():
    assert str(Op("fwd", stage=3, mb=5)) == "F3.5"
    assert str(Op("send_grad", stage=3, mb=5, peer=1)) == "SG3.5>1"
    assert str(Op("bcast_inv", layer=7, factor="A", peer=2)) == "BI7.A<2"
    assert str(Op("step", stage=0)) == "U0"


@pytest.mark.parametrize("bad", ["X1", "F3", "SA3.5<2", "I7.C", "CA7.A", "", "F-1.2"])
def test_parse_op_rejects(bad):
    with pytest.raises(ValueError):
        parse_op(bad)


def test_op_rejects_wrong_fields():
    with pytest.raises(ValueError):
        Op("fwd", stage=1)  # no mb
    with pytest.raises(ValueError):
        Op("fwd", stage=1, mb=0, layer=3)  # layer not a fwd field
    with pytest.raises(ValueError):
        Op("inv", layer=1, factor="C")


def test_write_json_is_atomic_and_readable(tmp_path):
    p = tmp_path / "sub" / "x.json"
    write_json(p, {"a": [1, 2]})
    assert read_json(p) == {"a": [1, 2]}
    assert [f.name for f in p.parent.iterdir()] == ["x.json"]  # no temp file left behind
    assert oct(p.stat().st_mode & 0o777) != oct(0o600)


def test_canonical_hash_ignores_key_order():
    assert canonical_hash({"a": 1, "b": [1, 2]}) == canonical_hash({"b": [1, 2], "a": 1})
    assert canonical_hash({"a": 1}) != canonical_hash({"a": 2})


def test_committed_reference_profile_loads_with_valid_hash():
    prof = load_profile(PROFILE)
    assert prof.source == "reference"
    assert len(prof.covered_layers) == 12 * 6


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("parts"), "parts"),
    (lambda d: d["parts"][2].__setitem__("fwd_ms", "fast"), "parts[2].fwd_ms"),
    (lambda d: d["covered_layers"][0].__setitem__("part", "nowhere"), "covered_layers[0].part"),
    (lambda d: d["covered_layers"][1]["optimizer_ms"]["kfac"].pop("inv_A.eigen"),
     "covered_layers[1].optimizer_ms.kfac.inv_A.eigen"),
    (lambda d: d.__setitem__("schema_version", 99), "schema_version"),
    (lambda d: d.__setitem__("schema", "pfcompile-plan"), "schema"),
    (lambda d: d["comm"]["p2p"].__setitem__("bytes_per_ms", 0), "comm.p2p.bytes_per_ms"),
    (lambda d: d["parts"][1].__setitem__("fwd_ms", 1e6), "hash"),  # edited by hand (a valid time)
    (lambda d: d["parts"][1].__setitem__("fwd_ms", 1e9), "parts[1].fwd_ms"),  # more than a day: refused first
])
def test_profile_loader_names_the_field(mutate, field):
    d = read_json(PROFILE)
    mutate(d)
    with pytest.raises(InputError) as e:
        profile_from_json(d, "p.json")
    msg = str(e.value)
    assert msg.startswith(f"p.json: {field}:"), msg
    assert "\n" not in msg


def small_plan():
    op = lambda kind, s, **kw: {**Op(kind, **kw).to_dict(), "start": s, "end": s + 1.0}  # noqa: E731
    return {
        "schema": "pfcompile-plan", "schema_version": 1,
        "config": {"schedule": "gpipe", "stages": 2, "micro_batches": 1, "replicas": 1, "world_size": 2,
                   "method": "none", "kfac": False, "refresh_steps": 1},
        "model": {"name": "bert-tiny"},
        "partition": [["embed", "block0"], ["block1", "head"]],
        "layers": [], "layer_stage": [],
        "placement": [{"stage": 0, "replica": 0, "rank": 0}, {"stage": 1, "replica": 0, "rank": 1}],
        "micro_batch_replica": [0],
        "ranks": [
            {"rank": 0, "steps": [[op("fwd", 0, stage=0, mb=0), op("send_act", 1, stage=0, mb=0, peer=1),
                                   op("recv_grad", 4, stage=1, mb=0, peer=1), op("bwd", 5, stage=0, mb=0),
                                   op("step", 6, stage=0)]]},
            {"rank": 1, "steps": [[op("recv_act", 1, stage=0, mb=0, peer=0), op("fwd", 2, stage=1, mb=0),
                                   op("bwd", 3, stage=1, mb=0), op("send_grad", 4, stage=1, mb=0, peer=0),
                                   op("step", 5, stage=1)]]},
        ],
    }


def test_plan_loader_accepts_and_derives_views():
    plan = plan_from_json(small_plan(), "x.json")
    assert plan.world_size == 2 and plan.refresh_steps == 1
    assert plan.stages_of(1) == [(1, 0)]
    assert plan.replica_ranks(0) == [0]
    assert [str(o) for o in plan.ops(0, 7)] == ["F0.0", "SA0.0>1", "RG1.0<1", "B0.0", "U0"]


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["config"].__setitem__("world_size", 3), "ranks"),
    (lambda d: d["config"].__setitem__("schedule", "zigzag"), "config.schedule"),
    (lambda d: d["ranks"][1]["steps"][0][1].__setitem__("op", "fwdd"), "ranks[1].steps[0][1]"),
    (lambda d: d["ranks"][0]["steps"][0][0].__setitem__("stage", 9), "ranks[0].steps[0][0].stage"),
    (lambda d: d["ranks"][0]["steps"][0][1].__setitem__("peer", 5), "ranks[0].steps[0][1].peer"),
    (lambda d: d["ranks"][0]["steps"][0][0].__setitem__("end", -1), "ranks[0].steps[0][0].end"),
    (lambda d: d["placement"].pop(), "placement"),
    (lambda d: d["config"].__setitem__("refresh_steps", 2), "ranks[0].steps"),
])
def test_plan_loader_names_the_field(mutate, field):
    d = small_plan()
    mutate(d)
    with pytest.raises(InputError) as e:
        plan_from_json(d, "x.json")
    msg = str(e.value)
    assert msg.startswith(f"x.json: {field}"), msg
    assert "\n" not in msg


def test_text_a_file_brings_prints_on_one_line():
    """Errors escape what a terminal would not show as itself and cut echoed values with a
    marker; tables escape it and cut over-long words."""
    from pfcompile.formats.errors import InputError, echo, printable_table
    from pfcompile.formats.ops import Op

    for bad in ("\ud800", "a\x1b[2J\nb", "\u202eevil\u202c", "\u200f", "x" * 100_000, "\U0001f600" * 50):
        with pytest.raises(ValueError) as e:
            Op.from_dict({"op": bad, "stage": 0, "mb": 0})
        msg = str(InputError("p.json", "ranks[0].steps[0][0]", str(e.value)))
        assert msg.isprintable() and len(msg) < 400, msg[:200]
        msg.encode("utf-8")  # nothing an encoder cannot write
        if len(bad) > 40:
            assert "more chars]" in msg
    assert echo("\ud800") == "'\\ud800'" and echo("\u200f") == "'\\u200f'"
    table = printable_table("part  " + "é" * 1000 + "  1.0\nnext \x1b[31m \u202e line")
    assert all(line.isprintable() for line in table.split("\n")) and len(table) < 300


def test_a_registered_optimizer_joins_the_vocabulary_and_leaves_it_when_unregistered():
    from pfcompile.formats.ops import COMPUTE_KINDS, OP_KINDS
    from pfcompile.formats.optimizers import CYCLE, STEP, OpDecl, Optimizer, optimizer, register, unregister

    spec = Optimizer(name="tests:vocab", factors=("Q",), ops=(
        OpDecl("qroot", CYCLE, text="QR", reads=("grad",), writes=("root:Q",)),
        OpDecl("precond", STEP, text="P", reads=("grad", "root:Q"), writes=("grad",))))
    register(spec)
    try:
        assert optimizer("tests:vocab") is spec and OP_KINDS["qroot"] == ("QR", ("layer", "factor"))
        assert str(parse_op("QR3.Q")) == "QR3.Q" and "qroot" in COMPUTE_KINDS
        for taken in ("P", "F", "QR"):  # an optimizer's, the pipeline's, this one's
            with pytest.raises(ValueError, match="text prefixes of their own"):
                register(Optimizer(name="tests:clash", ops=(OpDecl("other", STEP, text=taken, reads=("grad",),
                                                                   writes=()),)))
        with pytest.raises(ValueError, match="another text form"):  # a shared kind keeps its text
            register(Optimizer(name="tests:clash", ops=(OpDecl("precond", STEP, text="PP", reads=("grad",),
                                                               writes=("grad",)),)))
    finally:
        unregister("tests:vocab")
    assert "qroot" not in OP_KINDS and "precond" in OP_KINDS
    with pytest.raises(ValueError, match="not an op"):
        parse_op("QR3.Q")
    with pytest.raises(ValueError, match="unknown optimizer 'tests:vocab'"):
        optimizer("tests:vocab")
