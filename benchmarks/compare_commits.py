"""PipeFisher's setting planned at several commits, compared (not a test): does a change
leave the plans as they were?

Each commit's tree is exported (`git archive`) into a temporary folder and runs the README's two
commands (Chimera, D = 8, N = 8, from profiles/bert-large-p100-ref.json; the greedy, then
CP-SAT with `--time-limit 60`) with that worktree first on PYTHONPATH. Every later commit's
plans are compared with the first's: the op lists (kind, stage, micro-batch, layer,
factor, peer of every op of every rank and step) and the statistics, timing fields aside.

    .venv/bin/python benchmarks/compare_commits.py BASE COMMIT [COMMIT ...]
    .venv/bin/python benchmarks/compare_commits.py --smoke    # HEAD against itself, bert-tiny, 1F1B D = 2 (tests)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["-m", "pfcompile", "plan", "profiles/bert-large-p100-ref.json", "--schedule", "chimera", "--stages", "8",
           "--micro-batches", "8", "--time-limit", "60", "--json"]
# --smoke: the smallest setting (tests/test_benchmarks_smoke.py), HEAD against itself
SMOKE_COMMAND = ["-m", "pfcompile", "plan", "profiles/bert-tiny-cpu.json", "--schedule", "1f1b", "--stages", "2",
                 "--micro-batches", "4", "--time-limit", "2", "--json"]
# what depends on the machine and the moment, not on the plan
TIMING = {"solve_seconds", "stage_seconds", "seconds", "peak_rss_mib", "k_search", "decomposition", "solution_from"}


def plans_at(commit: str, work: Path, command: list[str], label: str) -> dict[str, dict]:
    """The plans of `command` made by the commit's tree (exported, so the repository's
    worktree list is left as it was)."""
    tree = work / label
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True)
    if archive.returncode:
        sys.exit(f"compare_commits: {commit}: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    out = {}
    for method in ("greedy", "cpsat"):
        path = work / f"{label}-{method}.json"
        r = subprocess.run([sys.executable, *command, "--method", method, "-o", str(path)], cwd=tree,
                           env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"compare_commits: {commit} {method} failed:\n{r.stderr[-2000:]}")
        out[method] = json.loads(path.read_text())
    return out


def ops(plan: dict) -> list:
    keys = ("op", "stage", "mb", "layer", "factor", "peer")
    return [[[tuple(o.get(k) for k in keys) for o in step] for step in rank["steps"]] for rank in plan["ranks"]]


def summary(plan: dict) -> str:
    st = plan["stats"]
    return (f"step {st['step_time_ms']:.3f} ms, overhead {st['step_overhead']:.4%} (vs the best first-order "
            f"{st.get('step_overhead_tight'):.4%}), utilization PipeFisher {st['utilization_pipefisher'][0]:.4f} "
            f"(mean {st['utilization_pipefisher_mean']:.4f}), strict {st['utilization_strict']:.4f}, "
            f"k {plan['config']['refresh_steps']} (lower bound {st.get('refresh_steps_lower_bound')}), "
            f"{st['solver_status']}, gap {st.get('gap')}, peak {min(st['peak_memory_bytes']) / 1e9:.2f}–"
            f"{max(st['peak_memory_bytes']) / 1e9:.2f} GB, division {plan['config'].get('precond_division')}")


def main() -> int:
    smoke = "--smoke" in sys.argv[1:]
    commits = ["HEAD", "HEAD"] if smoke else sys.argv[1:]
    if len(commits) < 2 or (smoke and len(sys.argv) > 2):
        sys.exit(__doc__.strip().splitlines()[-2].strip())
    labels = [str(i) for i in range(len(commits))]  # a commit may be named twice, or as a/b
    with tempfile.TemporaryDirectory() as tmp:
        plans = {lab: plans_at(c, Path(tmp), SMOKE_COMMAND if smoke else COMMAND, lab) for c, lab in zip(commits, labels)}
    base = labels[0]
    for method in ("greedy", "cpsat"):
        print(f"## {method}")
        for c, lab in zip(commits, labels):
            print(f"- {c}: {summary(plans[lab][method])}")
        for c, lab in list(zip(commits, labels))[1:]:
            a, b = plans[base][method], plans[lab][method]
            sa = {k: v for k, v in a["stats"].items() if k not in TIMING}
            sb = {k: v for k, v in b["stats"].items() if k not in TIMING}
            differ = sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))
            print(f"- {commits[0]} against {c}: ops identical: {ops(a) == ops(b)}; statistics that differ: "
                  f"{', '.join(differ) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
