"""`pfcompile profile` and the profile format: measured entries, memory figures against
closed forms from the tensor shapes, the CSV-derived reference profiles against the CSV,
and one-line errors for bad input through the CLI."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY_OPTIMIZERS_BEFORE_OWN_STEP, cli, one_line_error

from pfcompile.formats.errors import InputError
from pfcompile.formats.optimizers import KFAC
from pfcompile.formats.profile import fit_link, format_profile, load_profile, profile_from_json
from pfcompile.profiler.reference import reference_profile

ROOT = Path(__file__).resolve().parents[1]
CSV_DIR = ROOT / "pfcompile" / "data" / "pipe-fisher-prof"
MIB = 2**20

# the measured test profile: bert-tiny (2 blocks, hidden 64, 2 heads, ffn 256, vocab 100)
MB, SEQ = 2, 16
H, HEADS, FFN, VOCAB, BLOCKS = 64, 2, 256, 100, 2
F32, I64 = 4, 8




@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """bert-tiny measured through the real CLI and profiler (with the 2-rank gloo comm)."""
    out = tmp_path_factory.mktemp("prof") / "bert-tiny.json"
    tmp = tmp_path_factory.mktemp("tmpdir")
    r = cli("profile", "--model", "bert-tiny", "--micro-batch", str(MB), "--seq-len", str(SEQ),
            "--repeats", "3", "--warmup", "1", "--quiet", "-o", str(out), env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    # the runtime probe's torchrun made its torchelastic_* folder in a TMPDIR of the probe's own
    assert not list(tmp.glob("torchelastic_*")), list(tmp.iterdir())
    return load_profile(str(out))


# --- measured profile ------------------------------------------------------------------------
@pytest.mark.e2e
def test_measured_profile_has_every_entry_positive(measured):
    assert measured.source == "measured"
    assert [p.name for p in measured.parts] == ["embed", "block0", "block1", "head"]
    for p in measured.parts:
        assert p.fwd_ms > 0 and p.bwd_ms > 0 and p.act_bytes > 0 and p.param_bytes > 0, p
        # the split backward, measured (schema 3): B everywhere, W where a part has Linears
        assert p.split_measured and p.bwd_input_ms > 0 and p.bwd_weight_ms >= 0, p
        assert p.bwd_weight_ms > 0 or p.name == "embed", p
        # what W keeps: the output gradient of every Linear of the part (a block: q, k, v, out, fc1, fc2)
        linear_outs = {"embed": 0, "head": VOCAB}.get(p.name, 4 * H + FFN + H)
        assert p.wgrad_bytes == MB * SEQ * linear_outs * F32, p
    names = [f"block{b}.{n}" for b in range(BLOCKS) for n in ("attn.q", "attn.k", "attn.v", "attn.out", "ffn.fc1", "ffn.fc2")]
    assert [l.name for l in measured.covered_layers] == names
    for l in measured.covered_layers:
        assert l.part == l.name.split(".")[0]
        assert list(l.optimizer_ms["kfac"]) == list(KFAC.cost_keys()), l
        assert all(t > 0 for t in l.optimizer_ms["kfac"].values()), l
    # every timed entry has its spread, and the median lies inside it
    flat = {f"parts.{p.name}.{k}": getattr(p, k) for p in measured.parts
            for k in ("fwd_ms", "bwd_ms", "bwd_input_ms", "bwd_weight_ms")}
    flat.update({f"parts.{p.name}.step_ms.{k}": v for p in measured.parts for k, v in p.step_ms.items()})
    assert all(set(p.step_ms) == {"kfac", "adamw"} and min(p.step_ms.values()) > 0 for p in measured.parts)
    for l in measured.covered_layers:
        flat.update({f"covered_layers.{l.name}.optimizer_ms.kfac.{k}": v for k, v in l.optimizer_ms["kfac"].items()})
    assert set(flat) == set(measured.spread)
    # the entries are their in-run times (the probe runs); divided by the factor in-run / alone
    # the provenance records, each lies inside its spread timed alone
    in_run = measured.provenance["in_run"]
    assert any(k.endswith(".fwd_ms") for k in in_run) and any(".optimizer_ms.kfac." in k for k in in_run), in_run
    # an op's or an optimizer's in-run time is positive; a capture's may fit to 0 (none measurable)
    assert all(f > 0 if ".capture_ms." not in k else f >= 0 for k, f in in_run.items()), in_run
    assert not any(k.startswith("parts.embed.capture_ms.") for k in in_run), in_run  # no K-FAC layer there
    for key, entry in flat.items():
        median = entry / in_run.get(key, 1.0)
        p10, p90 = measured.spread[key]
        assert p10 <= median * (1 + 1e-6) and median <= p90 * (1 + 1e-6), key
    pv = measured.provenance
    assert pv["threads"] == 1 and pv["repeats"] == 3 and pv["warmup"] == 1 and pv["dtype"] == "float32"
    for k in ("device", "torch", "host", "date", "pfcompile", "wall_s"):
        assert pv.get(k), k


@pytest.mark.e2e
def test_measured_comm_is_a_real_two_rank_fit(measured):
    c = measured.comm
    assert c.method == "measured-gloo"
    assert c.act_bytes == MB * SEQ * H * F32
    for link in (c.p2p, c.allreduce):
        assert link.latency_ms >= 0 and link.bytes_per_ms > 0
    sizes = [s["bytes"] for s in measured.provenance["comm_samples"]]
    assert c.act_bytes in sizes and len(sizes) >= 4
    assert all(s["p2p_ms"] > 0 and s["allreduce_ms"] > 0 for s in measured.provenance["comm_samples"])
    assert all(s["send_ms"] > 0 and s["recv_ms"] > 0 for s in measured.provenance["comm_samples"])


@pytest.mark.e2e
def test_p2p_latency_is_the_runtime_probes_and_the_ping_pong_is_kept(measured):
    """The plan's messages cost what the probe run's did: its receives posted before their
    send ended (rank 1 waits for activations in the warm-up and steady state of 1F1B) give the latency at the
    ping-pong's bandwidth; the ping-pong's own fit of its samples stays in the provenance."""
    pv, c = measured.provenance, measured.comm
    pong = pv["p2p_pingpong"]
    refit = fit_link([(s["bytes"], s["p2p_ms"]) for s in pv["comm_samples"]])
    assert pong["latency_ms"] == pytest.approx(refit.latency_ms)
    assert pong["bytes_per_ms"] == pytest.approx(refit.bytes_per_ms) == pytest.approx(c.p2p.bytes_per_ms)
    assert c.p2p.latency_ms >= 0 and c.p2p.latency_ms != pong["latency_ms"]
    assert "runtime probe" in pv["comm_note"]


@pytest.mark.e2e
def test_the_busy_probe_runs_k_fac_in_the_bubbles_and_records_its_spread(measured):
    """runtime.busy: the probe's pipeline run again with K-FAC placed in its bubbles gives
    the spreads of a busier run, with both plans' utilizations (the busy one's higher), the
    runtime's work between its steps, and a note saying how it was made."""
    from pfcompile.check.replay import replay
    from pfcompile.profiler.runtime_probe import busy_plan, probe_plan

    busy = measured.runtime.busy
    assert busy is not None, measured.provenance.get("busy_note")
    u0, u1 = busy.utilization
    assert 0 < u0 < u1 <= 1 and busy.step_ms > 0
    # the utilizations are the two probe plans' replays with the profile, as a plan's are
    assert u0 == pytest.approx(replay(probe_plan(measured), measured).utilization, abs=1e-5)
    assert u1 == pytest.approx(replay(busy_plan(measured), measured).utilization, abs=1e-5)
    assert {"fwd", "bwd", "between_steps"} <= set(busy.op_spread) and "inv" in busy.op_spread
    assert "kfac in its bubbles" in measured.provenance["busy_note"]
    # its first refresh cycle untraced: before step k a precond has no inverse in force
    k, warmup = map(int, re.search(r"k = (\d+), \d+ steps, the first (\d+) untraced",
                                   measured.provenance["busy_note"]).groups())
    assert warmup == max(2, k)


@pytest.mark.e2e
def test_runtime_overheads_are_measured_by_running_the_runtime(measured):
    """The short 1F1B run of the real runtime (torchrun, 2 ranks) gave every overhead: a
    dispatch gap per op, work between steps, a send's posting, a receive's completion."""
    rt = measured.runtime
    assert "measured by running the runtime" in measured.provenance["runtime_note"]
    assert rt.op_ms > 0 and rt.step_ms > 0 and rt.send_ms > 0 and rt.recv_ms > 0, rt


def block_params() -> int:
    linears = 4 * (H * H + H) + (H * FFN + FFN) + (FFN * H + H)
    return linears + 2 * 2 * H  # two LayerNorms


@pytest.mark.e2e
def test_measured_memory_equals_closed_forms(measured):
    tokens = MB * SEQ
    # parameters (and their gradients): counted from the architecture, not from the modules
    params = {"embed": VOCAB * H + 128 * H,  # token and position embeddings (max_seq_len 128)
              "block0": block_params(), "block1": block_params(),
              "head": 2 * H + H * VOCAB + VOCAB}
    # saved activations, bounded from the shapes alone (which tensors autograd keeps beyond
    # what the backward needs is torch's choice and changes between versions):
    # - at least what any backward needs: every Linear's input (for its weight gradient:
    #   normalised x shared by q, k, v, the attention context, the normalised x of fc1, the
    #   gelu output of fc2) and q, k, v and the softmax probabilities (for the two bmm);
    # - at most every tensor the forward makes plus its input (residual stream, LayerNorm
    #   outputs and statistics, q/k/v, scores, scaled scores, probabilities, context,
    #   projections, fc1, gelu, fc2, sums).
    bth, btf, bhtt = tokens * H, tokens * FFN, MB * HEADS * SEQ * SEQ
    act_bounds = {
        "embed": (I64 * tokens, I64 * (tokens + SEQ) + F32 * 3 * bth),  # token ids at least
        "block0": (F32 * (6 * bth + btf + bhtt), F32 * (14 * bth + 2 * btf + 3 * bhtt + 4 * tokens)),
        # head: the fc's input, the log-softmax output, the int64 targets at least
        "head": (F32 * (bth + tokens * VOCAB) + I64 * tokens,
                 F32 * (3 * bth + 2 * tokens + 2 * tokens * VOCAB + 1) + I64 * tokens),
    }
    act_bounds["block1"] = act_bounds["block0"]
    for p in measured.parts:
        assert p.param_bytes == F32 * params[p.name], p.name
        assert p.grad_bytes == p.param_bytes, p.name
        low, high = act_bounds[p.name]
        assert low <= p.act_bytes <= high, (p.name, low, p.act_bytes, high)
        assert p.out_bytes == (0 if p.name == "head" else tokens * H * F32), p.name
    for l in measured.covered_layers:
        i, o = l.in_features, l.out_features
        assert (i, o) == {"fc1": (H, FFN), "fc2": (FFN, H)}.get(l.name.split(".")[-1], (H, H))
        assert l.kept_a_bytes == tokens * i * F32 and l.kept_b_bytes == tokens * o * F32
        assert l.factor_a_bytes == (i + 1) ** 2 * F32  # bias-augmented [x, 1]
        assert l.factor_b_bytes == o * o * F32
        # the larger of Cholesky (d·d) and eigen ([Q | eigenvalues]: d·(d+1))
        assert l.inverse_a_bytes == (i + 1) * (i + 2) * F32
        assert l.inverse_b_bytes == o * (o + 1) * F32


def test_saved_activation_bytes_of_an_mlp():
    import torch

    from runtime.observe.memory import saved_activation_bytes

    mlp = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))
    x = torch.randn(7, 12)
    params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    _, saved = saved_activation_bytes(lambda: mlp(x), params)
    # Linear 1 saves x; ReLU and Linear 2 share the ReLU output; weights excluded
    assert saved == 4 * (7 * 12 + 7 * 20)


def test_thread_clock_counts_cpu_time_only():
    import time

    import torch

    from pfcompile.profiler.clocks import Clock

    def sleep_then_work():
        time.sleep(0.02)  # descheduled, as when another process holds the core
        sum(range(20000))

    wall = Clock(torch.device("cpu"), repeats=3, warmup=0, kind="wall").time(sleep_then_work)
    thread = Clock(torch.device("cpu"), repeats=3, warmup=0, kind="thread").time(sleep_then_work)
    assert wall.median >= 20 and wall.samples == 3
    assert 0 < thread.median < 20


def test_entries_timed_in_turn_share_the_machines_slow_spells():
    """Clock.time_in_turn: one sample of each entry per round, so a spell that slows the
    machine from the fifth call on falls on both entries alike and their ratio holds; timed
    one after the other, the first entry keeps the fast machine and the ratio is 3x off."""
    import time

    import torch

    from pfcompile.profiler.clocks import Clock

    calls = []

    def work(units: int):
        def run():
            calls.append(units)
            time.sleep(0.004 * units * (3 if len(calls) > 4 else 1))
        return run

    clock = Clock(torch.device("cpu"), repeats=6, warmup=0)
    got = clock.time_in_turn({"a": (work(1), None), "b": (work(2), None)})
    assert calls == [1, 2] * 6 and got["a"].samples == got["b"].samples == 6  # in turn
    assert 1.6 < got["b"].median / got["a"].median < 2.5
    calls.clear()
    a, b = clock.time(work(1)), clock.time(work(2))
    assert b.median / a.median > 4  # the spell the turns shared


def test_fit_link_recovers_latency_and_bandwidth():
    from pfcompile.formats.profile import fit_link

    link = fit_link([(n, 0.05 + n / 2e6) for n in (4096, 65536, 1 << 20, 1 << 22)])
    assert link.latency_ms == pytest.approx(0.05) and link.bytes_per_ms == pytest.approx(2e6)
    # a fit whose intercept would be negative is refitted through the origin
    link = fit_link([(1000, 0.1), (2000, 1.1), (3000, 2.1)])
    assert link.latency_ms == 0 and link.bytes_per_ms > 0
    # relative error counts: one noisy large message does not wipe out the latency
    link = fit_link([(4096, 0.1), (65536, 0.1), (1 << 20, 0.1 + (1 << 20) / 1e6), (1 << 22, 30.0)])
    assert link.latency_ms > 0.05


@pytest.mark.e2e
def test_format_profile_lists_every_part_and_layer(measured):
    text = format_profile(measured)
    for p in measured.parts:
        assert f"{p.fwd_ms:.3f}" in text and p.name in text
    for l in measured.covered_layers:
        assert l.name in text
    assert "measured-gloo" in text and measured.hash in text



def _cost_table(text: str, title: str) -> tuple[list[str], dict[str, list[str]]]:
    """(column heads, layer -> cells) of the optimizer table of `format_profile` titled `title`."""
    lines = text.split(f"\n{title} per layer")[1].split("\n\n")[0].splitlines()[1:]  # below its title
    return lines[0].split()[1:], {line.split()[0]: line.split()[1:] for line in lines[2:]}


@pytest.mark.e2e
def test_format_profile_lists_each_optimizers_costs_where_the_profile_has_them(measured):
    text = format_profile(measured)
    assert "Shampoo per layer" not in text and "Muon per layer" not in text  # profiled for K-FAC only
    heads, rows = _cost_table(text, "K-FAC")
    assert heads == list(KFAC.cost_keys()) and len(rows) == len(measured.covered_layers)
    ref = load_profile(str(ROOT / "profiles" / "bert-large-p100-ref.json"))
    text = format_profile(ref)
    assert ref.provenance["optimizer_note"] in text
    for title, name, keys in (("K-FAC", "kfac", KFAC.cost_keys()), ("Shampoo", "shampoo", ("stats", "inv_L", "inv_R", "precond")),
                              ("Muon", "muon", ("orth",))):
        heads, rows = _cost_table(text, title)
        assert heads == list(keys) and len(rows) == len(ref.covered_layers)
        for l in ref.covered_layers:
            assert rows[l.name] == [f"{l.optimizer_ms[name][k]:.3f}" for k in keys]


SCHEMA3 = ROOT / "tests" / "data" / "profiles-schema3"


@pytest.mark.parametrize("path", sorted(SCHEMA3.glob("*.json")), ids=lambda p: p.stem)
def test_schema3_profile_loads_with_the_costs_of_its_schema4_rewrite(path):
    """Each profile as committed in schema 3 (kept here) loads, its hash verified over the file
    as written, and has the very costs of its schema-4 rewrite under profiles/; upgrading it
    gives that rewrite."""
    from pfcompile.formats.profile import upgraded

    old, new = load_profile(str(path)), load_profile(str(ROOT / "profiles" / path.name))
    assert old.schema_version == 3 and new.schema_version == 4
    assert old.hash == json.loads(path.read_text())["hash"]  # the file's own hash, still verifiable
    when = lambda prof: prof.provenance.get("date", prof.provenance.get("created"))  # noqa: E731
    if when(new) != when(old):  # measured again since: the rewrite is history, the upgrade must still match it
        new = upgraded(old)
    # an optimizer added to a reference profile since (its estimated costs) is not in the old one
    added = {o for l in new.covered_layers for o in l.optimizer_ms} - {o for l in old.covered_layers for o in l.optimizer_ms}
    for l in new.covered_layers:
        for o in added:
            del l.optimizer_ms[o]
    assert [l.optimizer_ms for l in old.covered_layers] == [l.optimizer_ms for l in new.covered_layers]
    assert all(list(l.optimizer_ms["kfac"]) == list(KFAC.cost_keys()) for l in old.covered_layers)
    assert old.parts == new.parts and old.comm == new.comm and old.runtime == new.runtime
    assert [(l.name, l.kept_a_bytes, l.factor_b_bytes, l.inverse_a_bytes) for l in old.covered_layers] == \
        [(l.name, l.kept_a_bytes, l.factor_b_bytes, l.inverse_a_bytes) for l in new.covered_layers]
    mine, theirs = upgraded(old).to_json(), new.to_json()
    for doc in (mine, theirs):  # what an added optimizer changed of the provenance
        for key in ("estimated", "optimizer_note", "created"):
            doc["provenance"].pop(key, None)
        doc.pop("hash", None)
    assert mine == theirs
    # the schema-3 fields map one to one onto K-FAC's cost keys
    raw = json.loads(path.read_text())["kfac_layers"][0]
    kfac = old.covered_layers[0].optimizer_ms["kfac"]
    assert (kfac["curv_a"], kfac["inv_B.eigen"], kfac["precond"]) == \
        (raw["curv_a_ms"], raw["inv_b_ms"]["eigen"], raw["precond_ms"])

# --- reference profiles from the CSV --------------------------------------------------------------
def csv_row(model: str, bs: int = 32) -> dict[str, float]:
    with open(CSV_DIR / f"{model}_time_memory_p100.csv", newline="") as f:
        return next({k: float(v) for k, v in r.items()} for r in csv.DictReader(f) if int(r["bs"]) == bs)


@pytest.mark.parametrize("model", ["bert-base", "bert-large"])
def test_reference_reproduces_csv(model):
    row, prof = csv_row(model), reference_profile(model, "p100", 32, 128)
    blocks = [p for p in prof.parts if p.name.startswith("block")]
    assert len(blocks) == {"bert-base": 12, "bert-large": 24}[model]
    for b in blocks:
        assert b.fwd_ms == pytest.approx(row["time_f"]) and b.bwd_ms == pytest.approx(row["time_b"])
        assert b.act_bytes == round(row["mem_act"] * MIB)
        ls = [prof.covered_layers[i] for i in prof.layers_of(b.name)]
        assert len(ls) == 6
        kfac = [l.optimizer_ms["kfac"] for l in ls]
        assert sum(c["curv_a"] + c["curv_b"] for c in kfac) == pytest.approx(row["time_kron"])
        assert sum(c["inv_A.cholesky"] + c["inv_B.cholesky"] for c in kfac) == pytest.approx(row["time_inv"])
        assert sum(c["precond"] for c in kfac) == pytest.approx(row["time_prec"])
        assert sum(l.factor_a_bytes + l.factor_b_bytes for l in ls) == round(row["mem_kron"] * MIB)
        assert sum(l.kept_b_bytes for l in ls) == round(row["mem_save_err"] * MIB)


def _body_without_date(prof) -> dict:
    body = prof.body()
    body["provenance"] = {k: v for k, v in body["provenance"].items() if k != "created"}
    return body


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["bert-base", "bert-large"])
def test_committed_reference_profiles_match_a_fresh_conversion(model, tmp_path):
    committed = load_profile(str(ROOT / "profiles" / f"{model}-p100-ref.json"))
    assert _body_without_date(committed) == _body_without_date(reference_profile(model, "p100", 32, 128))
    # and the CLI writes the same
    out = tmp_path / "ref.json"
    r = cli("profile", "--reference", model, "--gpu", "p100", "--micro-batch", "32", "--seq-len", "128", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert _body_without_date(load_profile(str(out))) == _body_without_date(committed)
    # --json prints the same profile, hash included
    r = cli("profile", "--reference", model, "--json")
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    assert _body_without_date(profile_from_json(printed, "<stdout>")) == _body_without_date(committed)


def test_committed_measured_profiles_load():
    for name in ("bert-tiny-cpu", "bert-mini-cpu"):
        prof = load_profile(str(ROOT / "profiles" / f"{name}.json"))
        assert prof.source == "measured" and prof.model["name"] == name.rsplit("-", 1)[0]
        assert all(p.fwd_ms > 0 and p.bwd_ms > 0 for p in prof.parts)
        assert len(prof.covered_layers) == 6 * prof.model["layers"]



@pytest.mark.parametrize("name, model", [("bert-tiny-cpu-optimizers", "bert-tiny"),
                                         ("bert-mini-cpu-optimizers", "bert-mini"),
                                         ("llama-tiny-cpu-optimizers", "llama-tiny")])
def test_committed_optimizers_profile_has_every_optimizers_costs(name, model):
    """benchmarks/race.py and runtime.py plan every optimizer from these: each layer needs every
    declared optimizer's ops, measured."""
    prof = load_profile(str(ROOT / "profiles" / f"{name}.json"))
    assert prof.source == "measured" and prof.model["name"] == model
    want = ["kfac", "shampoo", "soap", "muon"]
    assert prof.provenance["optimizers"] == want and prof.provenance["muon_ns_dtype"] == "float32"
    for layer in prof.covered_layers:
        assert set(layer.optimizer_ms) == set(want)
        assert all(v > 0 for costs in layer.optimizer_ms.values() for v in costs.values())

# --- every field checked on load: a mutated profile whose hash was recomputed ---------------------

def _rehashed(obj: dict) -> dict:
    """The profile as its writer would hash it (Profile.to_json: everything but the hash),
    so the hash check cannot mask the field check."""
    from pfcompile.formats.jsonio import canonical_hash

    return {**obj, "hash": canonical_hash({k: v for k, v in obj.items() if k != "hash"})}


def _set(path: tuple, value):
    def mutate(obj):
        node = obj
        for k in path[:-1]:
            node = node[k]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return mutate


_DELETE = object()
FWD = "parts.block0.fwd_ms"
PROFILE_FIELD_MUTATIONS = [
    # spread: [p10, p90] per measured op time
    (("spread", FWD), [], "spread.parts.block0.fwd_ms"),
    (("spread", FWD), [1.0], "spread.parts.block0.fwd_ms"),
    (("spread", FWD), {}, "spread.parts.block0.fwd_ms"),
    (("spread", FWD), "7", "spread.parts.block0.fwd_ms"),
    (("spread", FWD), ["0.1", "0.2"], "spread.parts.block0.fwd_ms"),
    (("spread", FWD), [True, 1.0], "spread.parts.block0.fwd_ms"),
    (("spread", FWD), [2**64 + 1, 2**64 + 1], "spread.parts.block0.fwd_ms"),
    (("spread", FWD), [-1e12, 1.0], "spread.parts.block0.fwd_ms"),
    (("spread", FWD), [0.5, 0.4], "spread.parts.block0.fwd_ms"),  # p10 above p90
    (("spread", "parts.block9.fwd_ms"), [0.1, 0.2], "spread.parts.block9.fwd_ms"),  # no such part
    # a map of times, not one time
    (("spread", "covered_layers.block0.attn.q.optimizer_ms.kfac"), [0.1, 0.2],
     "spread.covered_layers.block0.attn.q.optimizer_ms.kfac"),
    (("spread",), [], "spread"),
    (("spread",), "7", "spread"),
    # times at most a day, sizes at most an exbibyte, wherever they lie
    (("parts", 1, "fwd_ms"), 2**64 + 1, "parts[1].fwd_ms"),
    (("parts", 1, "bwd_input_ms"), -1e12, "parts[1].bwd_input_ms"),
    (("parts", 1, "step_ms", "kfac"), 1e12, "parts[1].step_ms.kfac"),
    (("parts", 1, "act_bytes"), 2**64 + 1, "parts[1].act_bytes"),
    (("parts", 1, "wgrad_bytes"), -1, "parts[1].wgrad_bytes"),
    (("parts", 1, "capture_ms"), {"fwd": -0.1}, "parts[1].capture_ms.fwd"),
    (("parts", 1, "capture_ms"), {"fwd": 1e12}, "parts[1].capture_ms.fwd"),
    (("parts", 1, "capture_ms"), {"step": 0.1}, "parts[1].capture_ms.step"),  # no capture slows a step
    (("parts", 1, "capture_ms"), [0.1], "parts[1].capture_ms"),
    (("covered_layers", 3, "optimizer_ms", "kfac", "inv_A.cholesky"), 1e12,
     "covered_layers[3].optimizer_ms.kfac.inv_A.cholesky"),
    (("covered_layers", 3, "factor_b_bytes"), 2**64 + 1, "covered_layers[3].factor_b_bytes"),
    (("comm", "p2p", "latency_ms"), 1e12, "comm.p2p.latency_ms"),
    (("comm", "allreduce", "bytes_per_ms"), "fast", "comm.allreduce.bytes_per_ms"),
    (("runtime", "step_ms"), 1e12, "runtime.step_ms"),
    (("runtime", "recv_ms"), -1.0, "runtime.recv_ms"),
    # the model spec, the device, the layers' names
    (("model", "name"), "", "model.name"),
    (("model", "hidden"), 0, "model.hidden"),
    (("model", "layers"), "2", "model.layers"),
    (("model", "vocab"), 2.5, "model.vocab"),
    (("model", "dtype"), "float16", "model.dtype"),
    (("model", "seq_len"), _DELETE, "model.seq_len"),
    (("provenance", "device_type"), "tpu", "provenance.device_type"),
    (("covered_layers", 1, "name"), "block0.attn.q", "covered_layers[1].name"),  # listed twice
    (("covered_layers", 0, "name"), "block1.attn.q", "covered_layers[0].name"),  # not of its part block0
    (("covered_layers", 0, "bias"), 1, "covered_layers[0].bias"),
    (("source",), "guessed", "source"),
]


def test_an_unmutated_rehashed_profile_loads_as_it_was():
    obj = json.loads((ROOT / "profiles" / "bert-tiny-cpu.json").read_text())
    assert _rehashed(obj)["hash"] == obj["hash"]
    prof = profile_from_json(_rehashed(obj), "p.json")
    assert prof.spread == obj["spread"] and len(prof.spread) == 108


@pytest.mark.parametrize("path,value,field", PROFILE_FIELD_MUTATIONS,
                         ids=[f"{'.'.join(map(str, p))}={v!r:.20}" for p, v, _ in PROFILE_FIELD_MUTATIONS])
def test_every_profile_field_is_checked_on_load(path, value, field):
    obj = json.loads((ROOT / "profiles" / "bert-tiny-cpu.json").read_text())
    assert obj["covered_layers"][0]["name"] == "block0.attn.q" and obj["covered_layers"][0]["part"] == "block0"
    _set(path, value)(obj)
    with pytest.raises(InputError) as e:
        profile_from_json(_rehashed(obj), "p.json")
    msg = str(e.value)
    assert msg.startswith(f"p.json: {field}: ") and "\n" not in msg, msg


@pytest.mark.e2e
def test_a_garbled_spread_is_one_line_from_inspect(tmp_path):
    obj = json.loads((ROOT / "profiles" / "bert-tiny-cpu.json").read_text())
    obj["spread"][FWD] = [-1e12, 2**64 + 1]
    path = tmp_path / "spread.json"
    path.write_text(json.dumps(_rehashed(obj)))
    one_line_error(cli("inspect", str(path)), f"{path}: spread.{FWD}: must be two finite times")


# --- bad input through the CLI ----------------------------------------------------------------------


@pytest.mark.e2e
def test_inspect_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    one_line_error(cli("inspect", str(path)), str(path), "no such file")


@pytest.mark.e2e
def test_inspect_corrupt_json(tmp_path):
    path = tmp_path / "bad.json"
    text = (ROOT / "profiles" / "bert-base-p100-ref.json").read_text()
    path.write_text(text[: len(text) // 2])  # a truncated file
    one_line_error(cli("inspect", str(path)), str(path), "not valid JSON")


@pytest.mark.e2e
def test_inspect_foreign_schema(tmp_path):
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps({"schema": "something-else", "data": []}))
    one_line_error(cli("inspect", str(path)), str(path), "schema")
    obj = json.loads((ROOT / "profiles" / "bert-base-p100-ref.json").read_text())
    obj["schema_version"] = 99
    path.write_text(json.dumps(obj))
    one_line_error(cli("inspect", str(path)), str(path), "schema_version", "99")


@pytest.mark.e2e
@pytest.mark.parametrize("field,value,needle", [
    (("parts", 1, "fwd_ms"), "fast", "parts[1].fwd_ms"),
    (("covered_layers", 2, "optimizer_ms", "kfac", "inv_A.eigen"), None, "covered_layers[2].optimizer_ms.kfac.inv_A.eigen"),
    (("comm", "p2p", "bytes_per_ms"), -1.0, "comm.p2p.bytes_per_ms"),
    (("model", "micro_batch"), 3.5, "model.micro_batch"),
])
def test_inspect_field_with_wrong_type(tmp_path, field, value, needle):
    obj = json.loads((ROOT / "profiles" / "bert-base-p100-ref.json").read_text())
    node = obj
    for k in field[:-1]:
        node = node[k]
    node[field[-1]] = value
    path = tmp_path / "wrong.json"
    path.write_text(json.dumps(obj))
    one_line_error(cli("inspect", str(path)), str(path), needle)
    with pytest.raises(Exception) as e:
        profile_from_json(obj, str(path))
    assert needle in str(e.value)


@pytest.mark.e2e
def test_op_spread_must_average_one(tmp_path):
    """The multipliers scale an op around its entry (they average 1): one of 1e308 (found by
    tests/test_fuzz.py) overflowed the replay's draws to inf; it is refused in one line."""
    obj = json.loads((ROOT / "profiles" / "bert-tiny-cpu.json").read_text())
    assert len(obj["runtime"]["op_spread"]["fwd"]) == 20
    obj["runtime"]["op_spread"]["fwd"][15] = 1e308
    obj.pop("hash")
    path = tmp_path / "spread.json"
    path.write_text(json.dumps(obj))
    one_line_error(cli("inspect", str(path)), str(path), "runtime.op_spread.fwd", "must average 1")
    # a rank's level likewise, in process (the same reader): named by its own field
    obj["runtime"]["op_spread"]["fwd"] = [1.0] * 20
    for bad, why in (([1.0] * 19 + [1e308], "must average 1"), (["slow"], "non-empty list of finite numbers")):
        obj["runtime"]["level_spread"] = bad
        with pytest.raises(InputError) as e:
            profile_from_json(obj, str(path), check_hash=False)
        assert "runtime.level_spread" in str(e.value) and why in str(e.value), str(e.value)


@pytest.mark.e2e
def test_inspect_edited_profile_fails_the_hash(tmp_path):
    obj = json.loads((ROOT / "profiles" / "bert-base-p100-ref.json").read_text())
    obj["parts"][1]["fwd_ms"] = 1.0
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(obj))
    one_line_error(cli("inspect", str(path)), str(path), "hash")


@pytest.mark.e2e
def test_profile_unavailable_device_and_unknown_model(tmp_path):
    out = tmp_path / "p.json"
    # a device no host has (cuda:0 exists on a GPU host): refused with one line, GPU or not
    one_line_error(cli("profile", "--device", "cuda:99", "-o", str(out)), "--device", "cuda:99", "not available")
    line = one_line_error(cli("profile", "--model", "bert-huge", "-o", str(out)), "--model", "bert-huge")
    assert "bert-tiny" in line and "bert-mini" in line  # lists the valid names
    one_line_error(cli("profile", "--micro-batch", "0", "-o", str(out)), "--micro-batch")
    one_line_error(cli("profile", "--reference", "bert-large", "--micro-batch", "3", "-o", str(out)), "bs", "3")
    assert not out.exists() and not list(tmp_path.glob(".*tmp"))  # nothing half-written


def test_profile_under_the_runs_conditions_records_its_ranks():
    """--ranks 2: one neighbour process runs the model meanwhile; the profile says so."""
    from pfcompile.profiler import profile_model

    prof = profile_model("bert-tiny", 1, 8, repeats=1, warmup=0, comm=False, entry_budget_s=0.05,
                         progress=False, ranks=2)
    assert prof.provenance["ranks"] == 2 and all(p.fwd_ms > 0 for p in prof.parts)
    with pytest.raises(InputError, match="--ranks: must be >= 1"):
        profile_model("bert-tiny", 1, 8, repeats=1, warmup=0, comm=False, progress=False, ranks=0)


def test_muon_is_timed_in_the_newton_schulz_dtype_asked_for():
    """--muon-ns-dtype: Muon's orthogonalisation is timed in the run's dtype and the profile
    says which (bfloat16, torch's default, is many times slower than float32 on most CPUs)."""
    from pfcompile.profiler import profile_model

    prof = profile_model("bert-tiny", 1, 8, repeats=1, warmup=0, comm=False, entry_budget_s=0.05,
                         progress=False, optimizers=("muon",), muon_ns_dtype="float32")
    assert prof.provenance["muon_ns_dtype"] == "float32"
    assert all(layer.optimizer_ms["muon"]["orth"] > 0 for layer in prof.covered_layers)
    plain = profile_model("bert-tiny", 1, 8, repeats=1, warmup=0, comm=False, entry_budget_s=0.05, progress=False)
    assert "muon_ns_dtype" not in plain.provenance  # only a profile that times Muon records it


def test_cold_cache_sweeps_before_every_repeat():
    """--cold-cache: an untimed sweep of a buffer larger than the caches before each repeat
    (the sweep writes the repeat's index: after the last repeat it holds the last index)."""
    import torch

    from pfcompile.profiler import profile_model
    from pfcompile.profiler.clocks import COLD_SWEEP_BYTES, Clock

    clock = Clock(torch.device("cpu"), repeats=3, warmup=1, cold=True)
    t = clock.time(lambda: torch.ones(8) @ torch.ones(8))
    assert t.samples == 3 and clock._sweep.numel() * 4 == COLD_SWEEP_BYTES and float(clock._sweep[-1]) == 3.0
    assert Clock(torch.device("cpu"), 1, 0)._sweep is None  # off by default
    prof = profile_model("bert-tiny", 1, 8, repeats=1, warmup=0, comm=False, entry_budget_s=0.05,
                         progress=False, cold=True)
    assert prof.provenance["cold_cache"] is True and all(p.fwd_ms > 0 for p in prof.parts)


@pytest.mark.e2e
@pytest.mark.full  # CI runs the user's model under torchrun (test_runtime) and the probe on bert-tiny
def test_a_user_models_profile_runs_the_runtime_probe_with_its_code(tmp_path):
    """The probe is a torchrun job of the runtime, which imports a user's model only when told
    to (--model-code): without it the probe fails and the overheads fall back to zero."""
    out = tmp_path / "mine.json"
    env_path = str(ROOT / "examples")
    r = subprocess.run([sys.executable, "-m", "pfcompile", "profile", "--model", "my_model:build", "--micro-batch", "2",
                        "--seq-len", "16", "--repeats", "3", "--warmup", "1", "-o", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": env_path})
    assert r.returncode == 0, r.stderr[-2000:]
    prof = load_profile(str(out))
    assert prof.provenance["runtime_note"].startswith("runtime overheads measured by running the runtime")
    assert prof.runtime.step_ms > 0 and prof.runtime.recv_ms > 0


def test_a_profile_flushes_subnormals_as_a_run_does_and_restores_the_callers_setting():
    """A run's ranks flush subnormal floats to zero by default (runtime.flush_denormal): met
    in x86 arithmetic they take a microcode path many times slower. The profiler times the
    ops the same way (provenance.denormals_flushed) and leaves its caller's setting as it
    was. Under the flag a float32 product below 1.2e-38 is 0; without it, it is not. Its
    malloc keeps freed memory as the ranks' does (provenance.freed_memory_kept, where the
    C library is glibc; that lasts the process's life: runtime.config.allocator)."""
    import torch

    from pfcompile.profiler import profile_model
    from runtime.config.allocator import _glibc
    from runtime.config.precision import denormals_flushed, flushing_denormals

    tiny = torch.tensor([1e-30], dtype=torch.float32)
    assert not denormals_flushed() and float(tiny * 1e-15) > 0  # the process's default
    prof = profile_model("bert-tiny", 1, 8, repeats=1, warmup=0, comm=False, entry_budget_s=0.05, progress=False)
    assert prof.provenance["denormals_flushed"] is True
    assert prof.provenance["freed_memory_kept"] is (_glibc() is not None)
    assert not denormals_flushed() and float(tiny * 1e-15) > 0  # restored
    with flushing_denormals("cpu"):
        assert float(tiny * 1e-15) == 0.0
    with flushing_denormals("cuda"):  # a GPU run's host arithmetic is left as it is
        assert not denormals_flushed()


def test_soaps_activation_is_timed_as_at_a_later_cycles_start(monkeypatch):
    """SOAP declares an activation (its first moment rotated out of the basis in force into
    the refreshed one, at the next cycle's start). The profiler times the runtime's own
    `activate` on the state it meets then: moments kept, a basis in force, a refreshed one
    pending (each timed call restores that state first). The entry lands in the layer's
    SOAP map and shows in `inspect`; a profile made before it was timed loads without it."""
    import torch

    from pfcompile.profiler.clocks import Clock
    from pfcompile.profiler.optimizer_layers import measure_optimizer_layer
    from runtime.optimizers.soap import SoapLayer

    seen = []
    real = SoapLayer.activate

    def watched(self):
        seen.append((self.exp_avg is not None, bool(self._pending), bool(self.bases)))
        return real(self)

    monkeypatch.setattr(SoapLayer, "activate", watched)
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 20)
    linear.weight.grad = torch.randn_like(linear.weight)
    ms, timings = measure_optimizer_layer("soap", "fc", linear, Clock(torch.device("cpu"), repeats=3, warmup=1))
    assert ms["activate"] > 0 and timings["activate"].samples == 3
    assert seen[0] == (False, True, False)  # the first basis comes into force: nothing to rotate
    assert seen[1:] == [(True, True, True)] * 4  # warm-up and repeats: moments, a basis, a pending one

    from pfcompile.profiler import profile_model

    prof = profile_model("bert-tiny", 1, 8, repeats=1, warmup=0, comm=False, entry_budget_s=0.05,
                         progress=False, optimizers=("soap",))
    assert all(layer.optimizer_ms["soap"]["activate"] > 0 for layer in prof.covered_layers)
    again = profile_from_json(json.loads(json.dumps(prof.to_json())))
    assert [layer.optimizer_ms for layer in again.covered_layers] == [layer.optimizer_ms for layer in prof.covered_layers]
    assert "activate" in format_profile(prof).split("SOAP per layer")[1].splitlines()[1]
    old = load_profile(str(TINY_OPTIMIZERS_BEFORE_OWN_STEP))
    assert all("activate" not in layer.optimizer_ms["soap"] for layer in old.covered_layers)


def spin(seconds: float) -> None:
    """Busy for `seconds`: a spin, not a sleep (a loaded VM wakes a sleeper late)."""
    import time

    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def test_parts_are_timed_with_the_hooks_idle_and_capture_apart(monkeypatch):
    """A part's pipeline ops are timed with K-FAC's hooks idle (every step but a K-FAC
    refresh) and again capturing; `capture_ms` is the difference, per op. Each layer's save
    is made to cost a known 2 ms: the forward's capture (the inputs), the backward's and B's
    (the output gradients) come out at that many layers x 2 ms, W's at none, and the ops'
    own times hold none of it. The entry round-trips through the profile JSON."""

    import torch

    from pfcompile.profiler.clocks import Clock
    from pfcompile.profiler.parts import PartBench, measure_part
    from pfcompile.profiler.settings import resolve_spec
    from runtime.optimizers.kfac import KfacLayer

    cost_s = 0.002
    for name in ("save_input", "save_grad"):
        real = getattr(KfacLayer, name)
        def slowed(self, mb, t, real=real):
            spin(cost_s)
            real(self, mb, t)
        monkeypatch.setattr(KfacLayer, name, slowed)
    torch.manual_seed(0)
    bench = PartBench(resolve_spec("bert-tiny", 8), "block0", 1, 8, "cpu", torch.float32)
    part, timings = measure_part(bench, Clock(torch.device("cpu"), repeats=5, warmup=1))
    saves = len(bench.kfac) * cost_s * 1e3
    for kind in ("fwd", "bwd", "bwd_input"):
        assert part.capture_ms[kind] == pytest.approx(saves, rel=0.3), kind
        assert timings[f"{kind}_ms"].median < saves * 0.5, kind  # the op's own time: hooks idle
    assert part.capture_ms["bwd_weight"] < saves * 0.2
    prof = load_profile(str(ROOT / "profiles" / "bert-tiny-cpu.json"))
    assert "capture_ms" not in json.dumps(prof.to_json())  # made before it was timed: absent, not null
    assert "what capturing adds" not in format_profile(prof)
    prof.part("block0").capture_ms = part.capture_ms
    assert "what capturing adds" in format_profile(prof)
    assert profile_from_json(json.loads(json.dumps(prof.to_json()))).part("block0").capture_ms == part.capture_ms


def test_each_optimizers_step_is_timed_as_the_runtimes_update_runs_it(monkeypatch):
    """The `step` op is timed per optimizer through the runtime's own update
    (runtime.pipeline.build.Update over the part): Muon's step applies each covered weight's
    update (MuonLayer.apply), which is made to cost a known 2 ms per layer, so Muon's entry
    holds that many layers x 2 ms and K-FAC's and AdamW's, which never call it, none of it.
    The entry round-trips through the profile JSON (its hash included), a Muon plan's step op
    costs it, and an optimizer without an entry of its own steps like its declaration says."""

    import torch

    from pfcompile.graph.costs import Costs
    from pfcompile.profiler.clocks import Clock
    from pfcompile.profiler.parts import PartBench, measure_part
    from pfcompile.profiler.settings import resolve_spec
    from runtime.optimizers.muon import MuonLayer

    cost_s = 0.002
    real = MuonLayer.apply

    def slowed(self, lr, real=real):
        spin(cost_s)
        real(self, lr)
    monkeypatch.setattr(MuonLayer, "apply", slowed)
    torch.manual_seed(0)
    bench = PartBench(resolve_spec("bert-tiny", 8), "block0", 1, 8, "cpu", torch.float32)
    part, timings = measure_part(bench, Clock(torch.device("cpu"), repeats=5, warmup=1), ("muon",))
    applies = len(bench.kfac) * cost_s * 1e3
    assert set(part.step_ms) == {"kfac", "adamw", "muon"} and "step_ms.muon" in timings
    assert part.step_ms["muon"] >= applies
    assert part.step_ms["kfac"] < applies * 0.5 and part.step_ms["adamw"] < applies * 0.5
    assert all(l.module.weight.grad is not None for l in bench.kfac)  # left as the backward made them

    prof = load_profile(str(TINY_OPTIMIZERS_BEFORE_OWN_STEP))
    assert "muon" not in prof.part("block0").step_ms  # made before it was timed
    partition = [["embed", "block0"], ["block1", "head"]]
    before = Costs(prof, partition, replicas=1, optimizer="muon").step_ms(0)
    assert before == pytest.approx(sum(prof.part(p).step_ms["adamw"] for p in partition[0]))  # Muon steps like AdamW
    prof.part("block0").step_ms = dict(part.step_ms)
    again = profile_from_json(json.loads(json.dumps(prof.to_json())))
    assert again.part("block0").step_ms == part.step_ms
    assert "step ms Muon" in format_profile(again) and "step ms Shampoo" not in format_profile(again)
    muon = Costs(again, partition, replicas=1, optimizer="muon")
    assert muon.step_ms(0) == pytest.approx(again.part("embed").step_ms["adamw"] + part.step_ms["muon"])
    shampoo = Costs(again, partition, replicas=1, optimizer="shampoo")  # no entry of its own: K-FAC's
    assert shampoo.step_ms(0) == pytest.approx(again.part("embed").step_ms["kfac"] + part.step_ms["kfac"])
