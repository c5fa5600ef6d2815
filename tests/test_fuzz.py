"""Structural fuzzing of profiles and plans (deterministic seed, a few hundred cases), and
fuzzing of their string fields through every command that reads them.

Every mutated input must end in one of two ways: a one-line refusal (an InputError naming
the file and a field), or acceptance. Plans of K-FAC, Shampoo and Muon are mutated alike.
An accepted K-FAC plan must train exactly like the original: a sample of the accepted
plans whose op order differs from the original is run with torchrun (2 ranks, float64, one
refresh cycle and one step more) next to the original, and their losses must agree to
1e-10 (reordered curvature sums differ in the last bits).
An accepted profile must give a plan the verifier accepts (what a profile can change is
the schedule, not the mathematics; the runtime's exactness for any valid plan is
tests/test_runtime.py's). A traceback (any other exception) or a hang (a case over 20 s)
fails the test. The counts per target are printed (pytest -s).

String fields (names, kinds, notes, op names) get lone surrogates, control characters,
right-to-left marks, emoji runs and 100,000-character strings, and go through `pfcompile
plan` (profiles), `inspect` (plans and profiles), `render` (plans) and the runtime's
validation (plans; what every rank runs before joining the job). Each must end in a
refusal or an acceptance whose every printed line is printable (no raw control or format
character, nothing an encoder cannot write), an error being one line of bounded length.
The table of outcomes per target is printed (pytest -s).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiered

from pfcompile.formats.errors import InputError
from pfcompile.formats.jsonio import parse_json
from pfcompile.formats.plan import plan_from_json
from pfcompile.formats.profile import load_profile, profile_from_json
from pfcompile.formats.verify import verify_plan
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.place.build import build_plan
from pfcompile.place.options import PlanOptions

pytestmark = pytest.mark.e2e  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "profiles" / "bert-tiny-cpu.json"
TINY_OPTIMIZERS = ROOT / "profiles" / "bert-tiny-cpu-optimizers.json"  # with Shampoo's and Muon's costs
SEED = 14
# plan cases per optimizer (K-FAC's plan from TINY, the others' from TINY_OPTIMIZERS), profile cases
PLAN_CASES, PROFILE_CASES = {"kfac": 160, "shampoo": 70, "muon": 70}, 60
# CI's tier tries a third of the cases (the same generators, the same seed); `make test-all` all
SHARES = tiered([(1 / 3,), (1.0,)], ["a-third", "all"], ci={0})
EDGES = [0, -1, 1, 2**31, 10**30, 1e308, -1e12, 0.5, True, None, "1", [], {}]


class Hang(Exception):
    pass


def _alarm(_signum, _frame):
    raise Hang()


OUTCOMES = ("tried", "refused", "accepted", "traceback", "hang")


def _tally() -> dict[str, int]:
    """A target's count of each outcome, all zero."""
    return dict.fromkeys(OUTCOMES, 0)


def _classify(run, counts: dict, accepted: list, case) -> None:
    """Run one case under a 20 s alarm; count its outcome."""
    counts["tried"] += 1
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        result = run()
    except InputError as e:
        msg = str(e)
        assert "\n" not in msg, msg
        # names a field of the file, or the flag whose value the file's numbers make
        # impossible (a profile whose K-FAC work no bubble can hold: --micro-batches)
        assert (e.field or (e.where or "").startswith("--") or "JSON" in e.message
                or "not accepted" in e.message), msg
        counts["refused"] += 1
        return
    except Hang:
        counts["hang"] += 1
        return
    except Exception as e:  # noqa: BLE001  (a traceback the user would see)
        counts["traceback"] += 1
        counts.setdefault("tracebacks", []).append(f"{type(e).__name__}: {e}"[:200])
        return
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    counts["accepted"] += 1
    accepted.append((case, result))


# --- plan mutations ----------------------------------------------------------------------

def _lists(o):
    return [(q, t) for q, r in enumerate(o["ranks"]) for t in range(len(r["steps"]))]


def _pick(rng, o):
    q, t = rng.choice(_lists(o))
    ops = o["ranks"][q]["steps"][t]
    return q, t, ops


def m_swap(rng, o):
    _, _, ops = _pick(rng, o)
    i, j = rng.randrange(len(ops)), rng.randrange(len(ops))
    ops[i], ops[j] = ops[j], ops[i]


def m_swap_adjacent(rng, o):
    _, _, ops = _pick(rng, o)
    i = rng.randrange(len(ops) - 1)
    ops[i], ops[i + 1] = ops[i + 1], ops[i]


def m_delete(rng, o):
    _, _, ops = _pick(rng, o)
    del ops[rng.randrange(len(ops))]


def m_duplicate(rng, o):
    _, _, ops = _pick(rng, o)
    ops.insert(rng.randrange(len(ops) + 1), dict(rng.choice(ops)))


def m_move_step(rng, o):
    q, t, ops = _pick(rng, o)
    steps = o["ranks"][q]["steps"]
    dest = steps[rng.randrange(len(steps))]
    dest.insert(rng.randrange(len(dest) + 1), ops.pop(rng.randrange(len(ops))))


def m_move_floating(rng, o):
    """An optimizer op moved to another step of its rank: a refresh op often legally (the
    point of the cycle); a per-step op (Shampoo's statistics, Muon's orthogonalisation) not."""
    q, t, ops = _pick(rng, o)
    idx = [i for i, d in enumerate(ops) if d["op"] in ("curv_a", "curv_b", "inv", "stats", "precond", "orth")]
    if not idx:
        return
    steps = o["ranks"][q]["steps"]
    dest = steps[rng.randrange(len(steps))]
    dest.append(ops.pop(rng.choice(idx)))


def m_move_rank(rng, o):
    _, _, ops = _pick(rng, o)
    q2 = rng.randrange(len(o["ranks"]))
    dest = o["ranks"][q2]["steps"][rng.randrange(len(o["ranks"][q2]["steps"]))]
    dest.insert(rng.randrange(len(dest) + 1), ops.pop(rng.randrange(len(ops))))


def m_field(rng, o):
    """peer, micro-batch, stage, layer or factor changed, to a near or an edge value."""
    _, _, ops = _pick(rng, o)
    d = ops[rng.randrange(len(ops))]
    key = rng.choice([k for k in ("peer", "mb", "stage", "layer", "factor") if k in d] or ["op"])
    d[key] = rng.choice([0, 1, 2, 3, -1, 10**30, "A", "B", None, True]) if key != "op" else "fwdd"


def m_time(rng, o):
    _, _, ops = _pick(rng, o)
    d = ops[rng.randrange(len(ops))]
    d[rng.choice(["start", "end"])] = rng.choice(EDGES)


def m_config(rng, o):
    key = rng.choice(["micro_batches", "refresh_steps", "world_size", "replicas", "stages", "virtual_stages",
                      "optimizer", "schedule", "inverse", "memory_limit_bytes"])
    o["config"][key] = rng.choice(EDGES + ["chimera", "eigen", False, "kfac", "shampoo", "muon", "adamw"])


def m_model(rng, o):
    key = rng.choice(["micro_batch", "hidden", "heads", "ffn", "kind", "seq_len", "name"])
    o["model"][key] = rng.choice(EDGES + ["gpt", 16, 128])


def m_structure(rng, o):
    key = rng.choice(["placement", "micro_batch_replica", "layer_stage", "partition", "layers", "profile"])
    v = o[key]
    if isinstance(v, list) and v and rng.random() < 0.5:
        v.pop(rng.randrange(len(v)))
    elif isinstance(v, list) and v:
        v[rng.randrange(len(v))] = rng.choice(EDGES)
    else:
        o[key] = rng.choice(EDGES)


PLAN_MUTATIONS = [m_swap, m_swap_adjacent, m_delete, m_duplicate, m_move_step, m_move_floating, m_move_rank,
                  m_field, m_time, m_config, m_model, m_structure]


def _retime(o) -> None:
    """Times in list order (what a tool that edits a plan and re-times it writes): the order
    rules are then reached instead of the time-order rule."""
    for r in o["ranks"]:
        clock = 0.0
        for ops in r["steps"]:
            for d in ops:
                if isinstance(d, dict):
                    d["start"] = d["end"] = clock
                    clock += 0.001


def _order(obj) -> list:
    return [[[json.dumps({k: v for k, v in d.items() if k not in ("start", "end")}, sort_keys=True)
              for d in ops] for ops in r["steps"]] for r in obj["ranks"]]


# --- profile mutations ----------------------------------------------------------------------

def _paths(obj, prefix=()):
    """Every (path, value) of a JSON object, leaves and containers."""
    out = [(prefix, obj)]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def mutate_profile(rng, obj) -> None:
    path, _ = rng.choice([p for p in _paths(obj) if p[0]])
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if rng.random() < 0.25:
        del parent[key]
    else:
        parent[key] = rng.choice(EDGES)


# --- the test ---------------------------------------------------------------------------------

def _torchrun_losses(plan: Path, steps: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "runtime",
           str(plan), "--dtype", "float64", "--data", "synthetic", "--steps", str(steps), "--json", "--timeout", "60"]
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path, "TMPDIR": str(plan.parent)}
    # in the plan's (temporary) folder, where the run folder and torchrun's torchelastic_* go
    return subprocess.Popen(cmd, cwd=plan.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(p: subprocess.Popen) -> list[float]:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("{"))
    return json.loads(line)["losses"]


@pytest.mark.filterwarnings("error::RuntimeWarning")  # an overflow to inf or nan is a bug, not a warning
@pytest.mark.parametrize("share", SHARES)
def test_fuzz_profiles_and_plans(tmp_path, share):
    rng = random.Random(SEED)
    profile = load_profile(str(TINY))
    plan, _, _ = build_plan(profile, PipelineConfig("1f1b", 2, 4), PlanOptions("greedy"))
    original = plan.to_json()
    others = load_profile(str(TINY_OPTIMIZERS))
    originals = {"kfac": original, **{o: build_plan(others, PipelineConfig("1f1b", 2, 4, optimizer=o),
                                                    PlanOptions("greedy"))[0].to_json() for o in ("shampoo", "muon")}}
    report = {}

    # plans of every optimizer: the path every plan reader takes (bounded JSON, the loader, the verifier)
    counts = _tally()
    accepted: list = []
    for name, cases in PLAN_CASES.items():
        mine = _tally()
        for n in range(round(cases * share)):
            obj = copy.deepcopy(originals[name])
            for _ in range(1 + (rng.random() < 0.3)):  # one mutation, sometimes two
                rng.choice(PLAN_MUTATIONS)(rng, obj)
            if rng.random() < 0.5:
                _retime(obj)
            text = json.dumps(obj)  # NaN and Infinity come out as JSON's non-numbers; the reader refuses them

            def run(text=text, n=n, name=name):
                p = plan_from_json(parse_json(text, f"{name}-plan-{n}.json"), f"{name}-plan-{n}.json")
                verify_plan(p, f"{name}-plan-{n}.json")
                return p
            _classify(run, mine, accepted if name == "kfac" else [], obj)
        report[f"plans ({name})"] = mine
        assert mine["traceback"] == 0 and mine["hang"] == 0, (name, mine)
        assert mine["refused"] > 0 and mine["accepted"] > 0, (name, mine)
        for key in OUTCOMES:
            counts[key] += mine[key]
    report["plans"] = counts
    reordered = [obj for obj, _ in accepted if _order(obj) != _order(original)]
    counts["accepted_reordered"] = len(reordered)

    # profiles: the path of `pfcompile plan` (bounded JSON, the profile loader, the planner,
    # and the verifier before writing)
    pcounts = _tally()
    base = json.loads(TINY.read_text())
    for n in range(round(PROFILE_CASES * share)):
        obj = copy.deepcopy(base)
        mutate_profile(rng, obj)
        if rng.random() < 0.5:
            obj.pop("hash", None)  # a hand-edited profile without its hash: the content is checked, not the hash
        text = json.dumps(obj)

        def run(text=text, n=n):
            prof = profile_from_json(parse_json(text, f"profile-{n}.json"), f"profile-{n}.json")
            made, _, _ = build_plan(prof, PipelineConfig("1f1b", 2, 4), PlanOptions("greedy"), where=f"profile-{n}.json")
            verify_plan(plan_from_json(made.to_json()), profile_model=prof.model)
            return made
        _classify(run, pcounts, [], obj)
    report["profiles"] = pcounts

    # accepted plans that reorder ops train exactly like the original (a sample, by torchrun)
    sample = reordered[:1]
    steps = plan.refresh_steps + 1
    path0 = tmp_path / "original.json"
    path0.write_text(json.dumps(original))
    procs = [_torchrun_losses(path0, steps)]
    for i, obj in enumerate(sample):
        p = tmp_path / f"accepted-{i}.json"
        p.write_text(json.dumps(obj))
        procs.append(_torchrun_losses(p, steps))
    want = _losses(procs[0])
    equal = 0
    for proc in procs[1:]:
        got = _losses(proc)
        assert got == pytest.approx(want, rel=1e-10, abs=0), (got, want)
        equal += 1
    counts["accepted_reordered_trained_equal"] = equal
    print("\nfuzz:", json.dumps(report))
    for c in (counts, pcounts):
        assert c["traceback"] == 0 and c["hang"] == 0, c
        assert c["tried"] == c["refused"] + c["accepted"]
    assert counts["refused"] > 0 and counts["accepted"] > 0 and sample


# --- string fields -----------------------------------------------------------------------------

STRINGS = ["\ud800", "a\udfffb", "\x00\x07\x1b[2J\r\nX", "\u202eevil\u202c", "\u200f\u200e\u2066x\u2069", "\u00e9",
           "\U0001f600" * 50, "x" * 100_000, "\u00e9" * 100_000, "\t", "", "bert-tiny\n"]
PLAN_STRING_FIELDS = [
    ("model", "name"), ("model", "kind"), ("model", "dtype"), ("partition", 0, 0), ("partition", 1, -1),
    ("layers", 0), ("layers", -1), ("config", "schedule"), ("config", "method"), ("config", "inverse"),
    ("config", "inversion"), ("config", "precond"), ("ranks", 0, "steps", 0, 0, "op"),
    ("ranks", 1, "steps", 0, -1, "op"), ("profile", "name"), ("profile", "hash"), ("profile", "device_type"),
    ("profile", "parts", 1), ("stats", "solver_status"), ("stats", "refresh_steps_note"), ("schema",)]
PROFILE_STRING_FIELDS = [
    ("model", "name"), ("model", "kind"), ("model", "dtype"), ("parts", 0, "name"), ("parts", 2, "name"),
    ("covered_layers", 0, "name"), ("covered_layers", 3, "part"), ("provenance", "note"), ("provenance", "device"),
    ("provenance", "host"), ("source",), ("comm", "method"), ("schema",)]
STRING_CASES = 60  # per target


def _set(obj, path, value) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def _strict() -> io.TextIOWrapper:
    """A stream like a UTF-8 terminal's: what cannot be encoded raises."""
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", newline="\n")


def _shown(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode("utf-8")


def _printable_lines(text: str) -> None:
    """Every line printable: no control or format character, nothing an encoder cannot write."""
    for line in text.splitlines():
        assert line.isprintable(), repr(line[:200])


def _run_cli(run) -> int:
    """Run a command with strict stdout/stderr; its printed lines must be printable."""
    out, err = _strict(), _strict()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run()
    shown = _shown(err)
    _printable_lines(_shown(out) + shown)
    if code not in (0, 2):
        raise AssertionError(f"exit {code}")
    if code == 2:  # a refusal: one line of bounded length, printed
        assert shown.count("\n") == 1 and len(shown) < 2400, repr(shown[:300])
        raise InputError(None, "cli", shown.rstrip("\n"))
    return code


def _runtime_validation(path: Path) -> int:
    """What every rank runs before joining the job; a refusal printed as the runtime does."""
    from runtime.__main__ import EXIT_INPUT, _fail
    from runtime.config.cli import build_parser, prepare

    def run():
        try:
            prepare(build_parser().parse_args([str(path), "--data", "synthetic"]), 0, 2)
        except InputError as e:
            return _fail(0, e, EXIT_INPUT)
        return 0
    return _run_cli(run)


@pytest.mark.parametrize("share", SHARES)
def test_fuzz_string_fields(tmp_path, monkeypatch, share):
    from pfcompile.cli import main as pfcompile_main

    monkeypatch.chdir(tmp_path)  # the runtime's run folder would go here
    rng = random.Random(SEED + 1)
    profile = load_profile(str(TINY))
    plan, _, _ = build_plan(profile, PipelineConfig("1f1b", 2, 4), PlanOptions("greedy"))
    plan_json, profile_json = plan.to_json(), json.loads(TINY.read_text())
    table = {t: _tally()
             for t in ("plan", "inspect", "render", "runtime")}
    tracebacks: list = []

    def case(target: str, make, fields, n: int):
        obj = copy.deepcopy(make)
        path_in = rng.choice(fields)
        value = rng.choice(STRINGS)
        _set(obj, path_in, value)
        if fields is PROFILE_STRING_FIELDS:
            obj.pop("hash", None)  # hand-edited: its content is checked, not a hash
        f = tmp_path / f"{target}-{n}.json"
        f.write_text(json.dumps(obj))  # ensure_ascii: any string, surrogates too, is valid JSON text
        return f, (path_in, value[:20])

    runs = {
        "plan": (profile_json, PROFILE_STRING_FIELDS, lambda f: _run_cli(lambda: pfcompile_main(
            ["plan", str(f), "--schedule", "1f1b", "--stages", "2", "--micro-batches", "4", "--method", "greedy",
             "-o", str(tmp_path / "out.json")]))),
        "inspect": (None, None, lambda f: _run_cli(lambda: pfcompile_main(["inspect", str(f)]))),
        "render": (plan_json, PLAN_STRING_FIELDS, lambda f: _run_cli(lambda: pfcompile_main(
            ["render", str(f), "--trace", str(tmp_path / "t.json"), "--torch-csv", str(tmp_path / "t.csv"),
             "--graph", str(tmp_path / "g.svg")]))),
        "runtime": (plan_json, PLAN_STRING_FIELDS, _runtime_validation),
    }
    for target, (make, fields, run) in runs.items():
        counts = table[target]
        for n in range(round(STRING_CASES * share)):
            if target == "inspect":  # plans and profiles alike
                make, fields = (plan_json, PLAN_STRING_FIELDS) if n % 2 else (profile_json, PROFILE_STRING_FIELDS)
            f, what = case(target, make, fields, n)
            _classify(lambda f=f, run=run: run(f), counts, [], what)
        tracebacks += [(target, t) for t in counts.pop("tracebacks", [])]
    print("\nstring fuzz (tried, refused, accepted, traceback, hang):")
    print("| target | tried | refused | accepted | traceback | hang |")
    print("|---|---|---|---|---|---|")
    for target, c in table.items():
        print(f"| {target} | {c['tried']} | {c['refused']} | {c['accepted']} | {c['traceback']} | {c['hang']} |")
    assert not tracebacks, "\n".join(f"{target}: {t}" for target, t in tracebacks)
    for target, c in table.items():
        assert c["traceback"] == 0 and c["hang"] == 0 and c["tried"] == c["refused"] + c["accepted"], (target, c)
        assert c["refused"] > 0 and c["accepted"] > 0, (target, c)
