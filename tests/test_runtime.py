"""The distributed runtime against a single-process run: real torchrun, real gloo, float64.

Plans here are built by `helpers.hand_plan` — a small list scheduler independent of the
planner — so that the runtime is tested on its own; the demo runs `pfcompile plan` outputs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    MODEL,
    ROOT,
    USER_MODEL,
    K,
    assert_same_params,
    distributed_params,
    make_plan,
    plan_in_process,
    reference_params,
    run_single,
    tiered,
    torchrun,
)

from pfcompile.formats.profile import load_profile
from pfcompile.formats.verify import model_hash
from runtime.pipeline.comm import free_port

pytestmark = pytest.mark.e2e  # every test here starts processes

# --- tests ---------------------------------------------------------------------------------
# (schedule, stages, replicas, model, p2p tags, receives posted ahead): one case runs the
# user's model through --model-code. Tags off: messages matched per pair in issue order,
# NCCL's rule, on gloo. Receives ahead: 0 is NCCL's, 1 one at a time; 8 posts most of a
# step's receives (gloo's default: all) before their sends, with tags last-needed first
# (posting_order), without tags (Chimera: both directions) in plan order.
CASES = [("gpipe", 2, 1, USER_MODEL, "on", 1), ("1f1b", 2, 1, MODEL, "off", 1), ("gpipe", 4, 1, MODEL, "off", 0),
         ("1f1b", 2, 2, MODEL, "on", 8), ("chimera", 4, 2, MODEL, "off", 8)]


ONE_NODE: dict = {}  # parameters of the one-node runs above, reused by the two-node test


# CI: the user's model, and 2x2 1F1B with most receives posted ahead
@pytest.mark.parametrize("schedule,D,R,model,tags,ahead", tiered(
    CASES, [f"{s}-{D}x{R}-{m}-tags-{t}-ahead-{a}" for s, D, R, m, t, a in CASES], ci={0, 3}))
def test_matches_single_process(tmp_path, schedule, D, R, model, tags, ahead):
    plan = make_plan(tmp_path, schedule, D, R, name=model)
    W = D if schedule == "chimera" else D * R
    trace = tmp_path / "trace.json"
    user = ["--model-code", model] if model == USER_MODEL else []
    r = torchrun(plan, W, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--checkpoint-every", "3", "--trace", str(trace), "--p2p-tags", tags,
                 "--recv-ahead", str(ahead), *user)
    assert r.returncode == 0, r.stdout[-3000:]
    initial, want = reference_params(plan, 3)
    got = distributed_params(tmp_path / "ckpt", 3, plan)
    assert_same_params(got, want, initial)
    ONE_NODE[(schedule, D, R)] = got

    # The measured trace has every op of every rank, and rank 0 printed the summary line.
    loaded = json.loads(plan.read_text())
    expected = sum(len(loaded["ranks"][q]["steps"][t % K]) for q in range(W) for t in range(3))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X" and e["cat"] != "runtime"]
    assert len(events) == expected
    assert {e["pid"] for e in events} == set(range(W))
    assert all(e["dur"] >= 0 for e in events)
    line = next(l for l in r.stdout.splitlines() if l.startswith("runtime: 3 steps"))
    assert "ms/step" in line and "bubble" in line and "measured/predicted" in line


def test_two_nodes_equal_one_node(tmp_path):
    """A 4-rank plan as two 'nodes' of 2 ranks (c10d rendezvous on 127.0.0.1) ends with the
    same parameters as one node of 4 and as the single process."""
    plan = make_plan(tmp_path, "1f1b", 2, 2)
    port = free_port()
    nodes = [torchrun(plan, 2, "--steps", "3", "--checkpoint-dir", str(tmp_path / "two"), "--checkpoint-every", "3",
                      launcher=["--nnodes", "2", "--node-rank", str(i), "--rdzv-backend", "c10d",
                                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"], wait=False)
             for i in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-2000:] for o in outs)
    if ("1f1b", 2, 2) not in ONE_NODE:  # run on its own: make the one-node run here
        one = torchrun(plan, 4, "--steps", "3", "--checkpoint-dir", str(tmp_path / "one"), "--checkpoint-every", "3")
        assert one.returncode == 0, one.stdout[-3000:]
        ONE_NODE[("1f1b", 2, 2)] = distributed_params(tmp_path / "one", 3, plan)
    two_nodes = distributed_params(tmp_path / "two", 3, plan)
    one_node = ONE_NODE[("1f1b", 2, 2)]
    for name, t in one_node.items():
        torch.testing.assert_close(two_nodes[name], t, rtol=1e-12, atol=0)
    initial, want = reference_params(plan, 3)
    assert_same_params(two_nodes, want, initial)


def test_plan_for_4_ranks_on_2_fails_at_start(tmp_path):
    plan = make_plan(tmp_path, "gpipe", 4)
    start = time.monotonic()
    r = torchrun(plan, 2, "--steps", "2", "--timeout", "20")
    assert r.returncode != 0
    assert "config.world_size: the plan is for 4 ranks but this job has 2" in r.stdout
    assert 'File "' + str(ROOT / "runtime") not in r.stdout  # no traceback from the runtime itself
    assert time.monotonic() - start < 60  # failed at start, did not wait for a timeout




def test_bad_plans_fail_with_one_line(tmp_path):
    plan = make_plan(tmp_path, "gpipe", 2)
    text = plan.read_text()

    truncated = tmp_path / "truncated.json"
    truncated.write_text(text[: len(text) // 2])
    r = run_single(str(truncated))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and f"{truncated}: not valid JSON" in r.stderr

    obj = json.loads(text)
    obj["ranks"][0]["steps"][0][0]["op"] = "fwdd"
    bad_op = tmp_path / "bad-op.json"
    bad_op.write_text(json.dumps(obj))
    r = run_single(str(bad_op))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "ranks[0].steps[0][0]: unknown op 'fwdd'" in r.stderr

    # A user model is imported only when the command line names the same code.
    obj = json.loads(text)
    obj["model"]["name"] = "os:getcwd"
    obj["profile"]["model_hash"] = model_hash(obj["model"], obj["profile"]["hash"])  # a plan made for that model
    user = tmp_path / "user-model.json"
    user.write_text(json.dumps(obj))
    r = run_single(str(user), "--steps", "1", world_size=2)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "model.name: is user code 'os:getcwd'; pass --model-code os:getcwd" in r.stderr

    # A one-rank job given a 2-rank plan: the world-size check, before any collective.
    r = run_single(str(plan))
    assert r.returncode == 2 and "the plan is for 2 ranks but this job has 1" in r.stderr


def test_interleave_fails_on_a_bad_plan_with_one_line(tmp_path):
    """`-m runtime.interleave` checks its plans as `-m runtime` does: a plan with an unknown
    op is one line naming the file and the field, exit status 2, no traceback."""
    obj = json.loads(make_plan(tmp_path, "gpipe", 2).read_text())
    obj["ranks"][0]["steps"][0][0]["op"] = "fwdd"
    bad_op = tmp_path / "bad-op.json"
    bad_op.write_text(json.dumps(obj))
    r = subprocess.run([sys.executable, "-m", "runtime.interleave", str(bad_op), str(bad_op), "--blocks", "2",
                        "--timed", "2"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert f"{bad_op}: ranks[0].steps[0][0]: unknown op 'fwdd'" in r.stderr


def test_interleave_set_for_names_its_plans_or_fails_with_one_line():
    """--set-for takes a list of the plans' indices (a setting such as muon.ns_dtype for two
    plans of the same optimizer); an index beyond them, or a word, is named before any work."""
    from runtime.interleave import plan_indices

    assert plan_indices("0", 2) == [0] and plan_indices("1,2", 3) == [1, 2]
    assert plan_indices("0,2", 2) == "2 is not the index of one of the 2 plans"
    assert "is not a comma-separated list" in plan_indices("one", 2)
    r = subprocess.run([sys.executable, "-m", "runtime.interleave", "a.json", "b.json", "--blocks", "2",
                        "--timed", "2", "--set-for", "0,2"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--set-for: 2 is not the index of one of the 2 plans" in r.stderr.splitlines()[-1]


def test_killed_rank_resumes_from_checkpoint(tmp_path):
    """Rank 1 dies at step 3 on the first attempt; torchrun restarts the job, which resumes
    from the checkpoint of step 3 and ends with the parameters of an uninterrupted run."""
    plan = make_plan(tmp_path, "1f1b", 2)
    ckpt = tmp_path / "ckpt"
    r = torchrun(plan, 2, "--steps", "5", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--resume",
                 "--timeout", "20", launcher=["--standalone", "--max-restarts", "1"],
                 env={"PFC_RUNTIME_CRASH": "1:3"})
    assert r.returncode == 0, r.stdout[-3000:]
    # the survivor either noticed (one line, test_a_lost_peer_is_one_line_on_every_side) or
    # was stopped by torchrun first: never a traceback from the runtime's code
    assert 'File "' + str(ROOT / "runtime") not in r.stdout, r.stdout[-3000:]
    # Rank 1 saved step 3 and died; torchrun may stop rank 0 before it saves step 3 too, and
    # then the last checkpoint complete on both ranks is step 2.
    resumed = re.search(r"resumed from .* at step (\d+)", r.stdout)
    assert resumed and int(resumed.group(1)) in (2, 3), r.stdout[-3000:]
    assert "runtime: 5 steps" in r.stdout
    initial, want = reference_params(plan, 5)
    assert_same_params(distributed_params(ckpt, 5, plan), want, initial)
    # Older checkpoints are pruned once a newer one is complete (a rank that saved first may
    # keep its previous file until then).
    step_dirs = sorted(d.name for d in ckpt.iterdir() if d.name.startswith("step-"))
    assert step_dirs[-1] == "step-00000005" and len(step_dirs) <= 2
    # Beside them: the effective config; the metrics go to each attempt's run folder, the
    # last of which logged steps up to 5 and the summary.
    assert "train.toml" in {d.name for d in ckpt.iterdir()}
    attempts = sorted((tmp_path / "runs").glob(f"{plan.stem}-*"))
    assert len(attempts) == 2, attempts
    logged = [json.loads(line)["step"] for line in (attempts[-1] / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] == 5 and json.loads((attempts[-1] / "summary.json").read_text())["steps"] == 5


def ranks_without_torchrun(plan: Path, nproc: int, *args: str, env: dict | None = None) -> list[subprocess.Popen]:
    """The runtime's ranks as plain processes meeting on 127.0.0.1: no agent stops the
    survivors when one dies, so each ends by what it notices itself."""
    port = free_port()
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    procs = []
    for q in range(nproc):
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path, "RANK": str(q),
                    "LOCAL_RANK": str(q), "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), **(env or {})}
        full_env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "runtime", str(plan), "--dtype", "float64", "--data",
                                       "synthetic", *args], cwd=plan.parent, env=full_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


# (plan, rank that dies at step 3, flags): the survivor, paused at step 3 until its peer is
# gone, next talks to it in a send (rank 0 of 1F1B starts each step with a forward and its
# send; no receive posted ahead), in posting a receive (rank 1 of 1F1B posts the step's first
# receive ahead), or in a collective (two replicas of one stage all-reduce their gradients)
LOST_PEER = {"send": (("1f1b", 2, 1), 1, ["--recv-ahead", "0"]), "receive": (("1f1b", 2, 1), 0, []),
             "collective": (("gpipe", 1, 2), 1, [])}


@pytest.mark.parametrize("side", LOST_PEER)
def test_a_lost_peer_is_one_line_on_every_side(tmp_path, side):
    (schedule, D, R), dead, flags = LOST_PEER[side]
    plan = make_plan(tmp_path, schedule, D, R)
    procs = ranks_without_torchrun(plan, 2, "--steps", "6", "--timeout", "15", *flags,
                                   env={"PFC_RUNTIME_CRASH": f"{dead}:3", "PFC_RUNTIME_PAUSE": f"{1 - dead}:3:2"})
    outs = [p.communicate(timeout=180) for p in procs]
    from runtime.observe.faults import CRASH_EXIT_CODE

    assert procs[dead].returncode == CRASH_EXIT_CODE
    survivor = 1 - dead
    out, err = outs[survivor]
    assert procs[survivor].returncode == 3, err[-3000:]
    assert err.count("\n") == 1 and "Traceback" not in err, err[-3000:]
    assert err.startswith(f"runtime[rank {survivor}]: error: ") and "no answer within 15 s or peer lost" in err, err


def test_a_diverging_run_stops_every_rank_in_the_same_step(tmp_path):
    """The loss forced to NaN at step 3 on one rank of a 4-rank Chimera: every rank prints
    the same line (step, stage, value), exits 4 within seconds of the NaN, and the last
    checkpoint written (step 2) is complete and finite; step 4's is never written."""
    plan = make_plan(tmp_path, "chimera", 4)
    ckpt = tmp_path / "ckpt"
    p = torchrun(plan, 4, "--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--timeout", "60",
                 env={"PFC_RUNTIME_NAN": "0:3:3"}, wait=False)  # rank 0 holds stage 3, the head of replica 0
    seen: list[tuple[float, str]] = []  # (arrival, line): the lines as they come
    for line in p.stdout:
        seen.append((time.time(), line.rstrip("\n")))
    p.wait(timeout=60)
    ended = time.time()
    text = "\n".join(line for _, line in seen)
    fault = next(line for _, line in seen if "fault:" in line)
    poisoned = float(re.search(r"unix time ([0-9.]+)", fault).group(1))
    errors = {int(m.group(1)): (t, m.group(2)) for t, line in seen
              if (m := re.fullmatch(r"runtime\[rank (\d)\]: error: (.*)", line))}
    assert sorted(errors) == [0, 1, 2, 3], text[-4000:]
    lines = {msg for _, msg in errors.values()}
    assert lines == {"step 3: stage 3 produced a non-finite loss; the run diverged (a smaller --lr?)"}, lines
    codes = dict(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\n\s*exitcode\s*: (-?\d+)", text))  # torchrun's report
    assert codes == {"0": "4", "1": "4", "2": "4", "3": "4"}, text[-4000:]
    assert 'File "' + str(ROOT / "runtime") not in text  # no traceback from the runtime itself
    last_line = max(t for t, _ in errors.values()) - poisoned
    for q, (t, msg) in sorted(errors.items()):
        print(f"\nrank {q} (+{t - poisoned:.2f} s, exit {codes[str(q)]}): runtime[rank {q}]: error: {msg}", end="")
    print(f"\nNaN at step 3 -> every rank's line within {last_line:.2f} s, torchrun ended {ended - poisoned:.2f} s "
          "after the NaN")
    assert ended - poisoned < 20
    from runtime.io.checkpoint import complete_steps

    assert complete_steps(ckpt, 4) == [2] and not (ckpt / "step-00000004").exists()
    for q in range(4):
        state = torch.load(ckpt / "step-00000002" / f"rank-{q}.pt", weights_only=True)
        assert all(torch.isfinite(t).all() for st in state["stages"].values() for t in st["params"].values())


@pytest.mark.parametrize("schedule,D", tiered([("chimera", 4), ("1f1b", 2)], ["chimera-4", "1f1b-2"], ci={1}))
def test_planner_output_matches_single_process(tmp_path, ops_only_tiny, schedule, D):
    """A real `pfcompile plan` output (greedy placement, from the committed bert-tiny
    profile's op costs) runs one whole refresh cycle and one step with the new inverses in
    force, and ends equal to the single-process run."""
    plan = tmp_path / f"{schedule}.json"
    plan_in_process(ops_only_tiny, "--schedule", schedule, "--stages", D, "--micro-batches", 4, "--method", "greedy",
                    "-o", plan)
    config = json.loads(plan.read_text())["config"]
    steps = config["refresh_steps"] + 1
    r = torchrun(plan, config["world_size"], "--steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--checkpoint-every", str(steps), "--p2p-tags", "off")
    assert r.returncode == 0, r.stdout[-3000:]
    initial, want = reference_params(plan, steps)
    assert_same_params(distributed_params(tmp_path / "ckpt", steps, plan), want, initial)


SPLIT_CASES = [("chimera", ["--stages", "4", "--partition", "embed|block0,block1|block2,block3|head"]),
               ("1f1b", ["--stages", "2", "--replicas", "2"])]


@pytest.mark.parametrize("schedule,args", tiered(SPLIT_CASES, [c[0] for c in SPLIT_CASES], ci={1}))
def test_split_preconditioning_matches_single_process(tmp_path, schedule, args):
    """--precond split (PipeFisher's): the gradients are reduce-scattered, each replica
    preconditions the layers it owns, the preconditioned gradients are all-gathered. On
    bert-mini (2 blocks a stage: one to each replica) a 4-rank Chimera and a 2x2 1F1B run,
    k = 1 (refresh every step, so steps 1 and 2 precondition with real inverses), end equal
    to the single-process trainer. Micro-batches of 2 x 32 tokens (the committed profile's
    model, batch shrunk: the plan's times do not matter here) keep the 4 ranks quick."""
    prof = load_profile(str(ROOT / "profiles" / "bert-mini-cpu.json"))
    prof.model.update(micro_batch=2, seq_len=32)
    profile = tmp_path / "bert-mini-small-batch.json"
    prof.save(str(profile))
    plan = tmp_path / f"{schedule}-split.json"
    plan_in_process(profile, "--schedule", schedule, *args, "--micro-batches", 4, "--method", "none",
                    "--precond", "split", "-o", plan)
    loaded = json.loads(plan.read_text())
    config = loaded["config"]
    assert config["precond"] == "split" and config["refresh_steps"] == 1
    # each owned layer is preconditioned on exactly one rank, between rs_grad and ag_grad
    where = {}
    for q, r in enumerate(loaded["ranks"]):
        kinds = [o["op"] for o in r["steps"][0]]
        for o in r["steps"][0]:
            if o["op"] == "precond":
                where.setdefault(o["layer"], []).append(q)
        if "rs_grad" in kinds:
            assert kinds.index("rs_grad") < kinds.index("precond") < kinds.index("ag_grad") < kinds.index("step")
    owner = config["precond_owner"]
    assert any(o is not None for o in owner)
    assert all(len(where[l]) == (1 if owner[l] is not None else 2) for l in range(len(owner)))
    r = torchrun(plan, config["world_size"], "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--checkpoint-every", "3")
    assert r.returncode == 0, r.stdout[-3000:]
    initial, want = reference_params(plan, 3)
    assert_same_params(distributed_params(tmp_path / "ckpt", 3, plan), want, initial)
    # the stage groups, made after the world's and the control group, run their gloo network
    # threads under SCHED_IDLE too (runtime.idle_network_threads): one per group a rank is in
    (folder,) = (tmp_path / "runs").glob(f"{plan.stem}-*")
    groups = [2] * config["world_size"]
    for s in {p["stage"] for p in loaded["placement"]}:
        ranks = {p["rank"] for p in loaded["placement"] if p["stage"] == s}
        for q in ranks if len(ranks) > 1 else ():
            groups[q] += 1
    assert json.loads((folder / "summary.json").read_text())["network_threads_idle"] == groups


def test_a_step_ends_on_each_rank_without_waiting_for_the_others(tmp_path):
    """The plan starts a rank's next step after its own last op. The runtime too: the
    divergence check and the logged losses are all-reduced in the background
    (Interpreter.agree, runtime.pipeline.loop.LoggedSteps), so in a 4-stage 1F1B the last
    stage, which ends its step three backward passes before the first, starts the next one
    (its first receive) while the first stage still runs its last backward passes. A barrier
    at the step's end would start it after the first stage's last op."""
    from pfcompile.calibrate.measured import load_measured

    plan = make_plan(tmp_path, "1f1b", 4, kfac=False)
    trace = tmp_path / "trace.json"
    r = torchrun(plan, 4, "--steps", "16", "--trace", str(trace))
    assert r.returncode == 0, r.stdout[-3000:]
    ops = load_measured(str(trace)).by_rank()
    last_end = {o.step: o.end_ms for o in ops[0]}  # in execution order: the step's last op wins
    first_start: dict[int, float] = {}
    for o in ops[3]:
        first_start.setdefault(o.step, o.start_ms)
    steps = sorted(s for s in last_end if s + 1 in first_start)  # the trace's steps after warm-up
    ahead = [first_start[s + 1] < last_end[s] for s in steps]
    # With a barrier no step could start ahead (causality); four ranks on two cores can still
    # deschedule the last stage for a step, so half the steps ahead is the bar, not all.
    assert len(steps) >= 10 and 2 * sum(ahead) >= len(steps), [first_start[s + 1] - last_end[s] for s in steps]


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """One run of the hand-made 2-stage 1F1B plan, traced from its first step (--warmup 0),
    every runtime setting at its default and no --log-dir (its run folder: runs/PLAN-UTCTIME/
    beside the plan). Two tests read it, one launch: its trace's runtime row, and the
    summary's default of flushed subnormals."""
    d = tmp_path_factory.mktemp("traced")
    plan = make_plan(d, "1f1b", 2)
    trace_path = d / "trace.json"
    steps = 3 * K + 1
    r = torchrun(plan, 2, "--steps", str(steps), "--warmup", "0", "--trace", str(trace_path))
    return plan, steps, trace_path, r


def test_the_trace_shows_the_runtimes_work_between_ops(traced_run):
    """A measured trace has a "runtime" row per rank (pfcompile.formats.ops.RUNTIME_SPANS):
    every step's batch, sends completed and divergence check, the receives posted ahead
    (on a rank that receives: step 0's at its start, and each next step's within the step
    before, once its own receives are in; none after the last), K-FAC's activation of the new inverses on each refresh step after
    the first and never on another step, and the periodic collection. Each span lies
    between the rank's ops, never inside one, so "between ops" can be split by them; the
    loader keeps them apart from the ops."""
    from pfcompile.calibrate.measured import load_measured

    plan, steps, trace_path, r = traced_run
    k = K  # the hand plan's refresh cycle
    assert steps == 3 * k + 1
    assert r.returncode == 0, r.stdout[-3000:]
    events = json.loads(trace_path.read_text())["traceEvents"]
    rows = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(0, "runtime"), (1, "runtime")} <= rows
    trace = load_measured(str(trace_path))
    assert trace.ops and all(o.op.kind != "batch" for o in trace.ops)
    for q, ops in trace.by_rank().items():
        spans = [s for s in trace.spans if s.rank == q]
        for name in ("batch", "drain", "verdict"):
            assert sorted(s.step for s in spans if s.name == name) == list(range(steps)), (q, name)
        posts = [s for s in spans if s.name == "post_recv"]
        assert sorted(s.step for s in posts) == [0] + list(range(steps - 1)), q
        for s in posts[1:]:  # the next step's, after this step's last receive
            last_recv = max(o.end_ms for o in ops if o.step == s.step and o.op.kind.startswith("recv_"))
            assert s.start_ms >= last_recv - 1e-6, (q, s)
        assert sorted(s.step for s in spans if s.name == "activate") == list(range(k, steps, k)), q
        assert [s.step for s in spans if s.name == "gc"] == [0]
        for s in spans:  # between ops: no op of this rank overlaps a span
            assert not any(o.start_ms < s.end_ms - 1e-6 and s.start_ms < o.end_ms - 1e-6 for o in ops), (q, s)


def test_ranks_flush_subnormals_keep_freed_memory_and_idle_gloo_threads_unless_told_not_to(tmp_path, traced_run):
    """Each rank's arithmetic flushes subnormal floats to zero by default
    (runtime.flush_denormal), read back from the rank's own CPU state into the summary; the
    setting turns it off. (A K-FAC run whose values drift below 1.2e-38 slowed its backward
    passes 3x within 120 steps without it: benchmarks/results/2026-12-04-denormals.md.)
    Likewise each rank's malloc keeps what torch frees (runtime.keep_freed_memory;
    tests/test_allocator.py checks the effect against glibc), and the summary counts each
    rank's minor page faults per step after the warm-up. And gloo's network threads (one per
    process group: the world's and the control group's) run under SCHED_IDLE
    (runtime.idle_network_threads), read back from the kernel at the end of the run. The
    default: the shared traced run (no setting given), its summary in its run folder. The
    trace carries the same counts step by step as a counter track per rank, beside the ops,
    with each step's peak memory."""
    plan, steps, trace_path, r = traced_run
    assert r.returncode == 0, r.stdout[-3000:]
    (folder,) = (plan.parent / "runs").glob(f"{plan.stem}-*")
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["denormals_flushed"] == [True, True]
    assert summary["freed_memory_kept"] == [True, True]
    assert summary["network_threads_idle"] == [2, 2]
    faults = summary["page_faults_per_step"]
    assert len(faults) == 2 and all(f is not None and f >= 0 for f in faults), faults
    events = json.loads(trace_path.read_text())["traceEvents"]
    starts = {}  # each rank's first op of each step
    for e in events:
        if e["ph"] == "X" and "op" in e["args"]:
            key = (e["pid"], e["args"]["step"])
            starts[key] = min(starts.get(key, e["ts"]), e["ts"])
    for q in (0, 1):
        counters = [e for e in events if e["ph"] == "C" and e["pid"] == q]
        assert [e["name"] for e in counters] == ["step"] * steps, q
        # a step's value from its start on, before its first op
        assert all(e["ts"] <= starts[(q, i)] for i, e in enumerate(counters)), q
        per_step = [e["args"]["page faults"] for e in counters[1:]]  # the first has no count before it
        assert "page faults" not in counters[0]["args"] and all(n >= 0 for n in per_step), q
        assert sum(per_step) / len(per_step) == pytest.approx(faults[q]), q  # warm-up 0: every step after the first
        peaks = [e["args"]["peak memory MiB"] for e in counters]
        assert max(peaks) == pytest.approx(summary["peak_memory_bytes_measured"][q] / 2**20, abs=1e-3), q
    log = tmp_path / "run-false"
    r = torchrun(plan, 2, "--steps", "3", "--warmup", "0", "--log-dir", str(log), "--set", "runtime.flush_denormal=false",
                 "--set", "runtime.keep_freed_memory=false", "--set", "runtime.idle_network_threads=false")
    assert r.returncode == 0, r.stdout[-3000:]
    summary = json.loads((log / "summary.json").read_text())
    assert summary["denormals_flushed"] == [False, False]
    assert summary["freed_memory_kept"] == [False, False]
    assert summary["network_threads_idle"] == [0, 0]
