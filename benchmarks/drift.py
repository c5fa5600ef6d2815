"""How much this machine drifts: the noise floor under every timed aim (not a test: it times).

Four figures, measured one after the other with nothing else running:

- a fixed single-thread kernel (--size square float32 matmuls, 100 of them) timed every
  0.2 s for --seconds: the machine's own jitter, no runtime in it; beside it a memory-bound
  one (AdamW-like updates), and the two's ratio: whether the machine moves them together;
- one plan run --runs times back to back, --steps steps each (--profile's model, 2 stages,
  1F1B, AdamW in the family's order, synthetic tokens, 2 ranks x 1 thread, gloo): each
  run's ms/step (the runtime's Summary.step_ms), what a measured/predicted ratio from one
  run carries besides the model's error;
- the same runs paired, each against the one before: the "overhead" of a plan over itself,
  0 in truth, so its spread is what a paired overhead from one round carries;
- each run against both kernels timed for --beside seconds just before it (Pearson's r
  over the runs): which of the machine's speeds, compute or memory, a run's level follows;
- one long traced run of the plan (--long-steps): its passes' mean level over windows of
  0.5 to 8 s, against the run's own mean. How fast the spread falls with the window says how
  long a probe or a measured run must last for its mean to stand for the machine;
- with --side-by-side S, both kernels back to back on both cores at once for S seconds (one
  process pinned to each, as the ranks are; no runtime): whether the machine moves the two
  cores together, and how often a later window of it is within ±10% of an earlier one, the
  bound a profile (one window) meets when a run (a later one) is measured against it.

    .venv/bin/python benchmarks/drift.py [--seconds 60] [--runs 8] [--steps 30] [--long-steps 1200]
                                         [--beside 1] [--side-by-side 240] [--profile PROFILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


KERNEL_SIZE = 256


STREAM_FLOATS = 4_000_000  # bert-tiny's parameter count, about: its AdamW update's working set


def kernel_pairs(seconds: float, size: int = KERNEL_SIZE) -> tuple[list[float], list[float]]:
    """Two kernels timed alternately every 0.2 s for `seconds`, one thread: 100 matmuls of
    `size` x `size` (compute-bound, as the passes and most optimizer ops are) and 2
    AdamW-like updates of STREAM_FLOATS floats (memory-bound, as AdamW's step is). When a
    machine slows one and not the other, a plan's ops do not all move by one factor, and
    a plan with more compute-bound work moves more. -> (matmul ms, update ms)."""
    series = kernel_series(seconds, size, pause=0.2)
    return [x[1] for x in series], [x[2] for x in series]


def kernel_series(seconds: float, size: int = KERNEL_SIZE, pause: float = 0.2,
                  cpu: int | None = None) -> list[tuple[float, float, float]]:
    """kernel_pairs' samples with their wall-clock times, `pause` s apart (0: back to back,
    the core kept busy as a rank keeps it), on `cpu` alone where given. -> [(time.time(),
    matmul ms, update ms)]."""
    import torch

    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu % os.cpu_count()})
    torch.set_num_threads(1)
    a = torch.randn(size, size)
    p, g, m, v = (torch.randn(STREAM_FLOATS) for _ in range(4))

    def update():
        for _ in range(2):
            m.mul_(0.9).add_(g, alpha=0.1)
            v.mul_(0.999).addcmul_(g, g, value=0.001)
            p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)

    for _ in range(20):
        a @ a
    update()
    out, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        t = time.perf_counter()
        for _ in range(100):
            a @ a
        t1 = time.perf_counter()
        update()
        out.append((time.time(), (t1 - t) * 1e3, (time.perf_counter() - t1) * 1e3))
        if pause > 0:
            time.sleep(pause)
    return out


def _busy_core(args: tuple[float, int, int]) -> list[tuple[float, float, float]]:
    seconds, size, cpu = args
    return kernel_series(seconds, size, pause=0.0, cpu=cpu)


def side_by_side(seconds: float, size: int = KERNEL_SIZE) -> dict[float, dict]:
    """Both kernels back to back on two cores at once (one process pinned to each, as the
    ranks are), no runtime in them: whether the machine moves both cores together, and how
    often one window of it stands for a later one. Per window length (SIDE_WINDOWS_S) and
    kernel: each core's windows over its median (min, max), Pearson's r between the cores'
    windows, and the share of (earlier, later) window pairs of the two cores' mean whose
    ratio is within ±10% (a profile is one window, a run a later one)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(2) as pool:
        cores = pool.map(_busy_core, [(seconds, size, 0), (seconds, size, 1)])
    t0 = min(c[0][0] for c in cores if c)
    out: dict[float, dict] = {}
    for w in SIDE_WINDOWS_S:
        binned = []
        for c in cores:
            bins: dict[int, list] = {}
            for t, mm, up in c:
                bins.setdefault(int((t - t0) // w), []).append((mm, up))
            binned.append(bins)
        shared = sorted(set(binned[0]) & set(binned[1]))[:-1]  # the last bin is partial
        if len(shared) < 3:
            continue
        out[w] = {}
        for j, kernel in ((0, "matmuls"), (1, "updates")):
            levels = []
            for bins in binned:
                v = [statistics.mean(x[j] for x in bins[k]) for k in shared]
                mid = statistics.median(v)
                levels.append([x / mid for x in v])
            both = [(x + y) / 2 for x, y in zip(*levels)]
            pairs = [(x, y) for i, x in enumerate(both) for y in both[i + 1:]]
            out[w][kernel] = {"windows": len(shared), "cores": [(min(v), max(v)) for v in levels],
                              "r": correlation(*levels),
                              "within_10": sum(abs(y / x - 1) <= 0.10 for x, y in pairs) / len(pairs)}
    return out


WINDOWS_S = (0.5, 1.0, 2.0, 4.0, 8.0)
SIDE_WINDOWS_S = (1.0, 4.0, 8.0, 24.0)


def window_levels(trace_path: str) -> dict[float, list[float]]:
    """A traced run's passes (fwd, bwd, B, W) each over its own op's mean in the run, averaged
    over consecutive windows of each of WINDOWS_S seconds by start time (the last, partial
    window dropped). -> window seconds -> the windows' levels (1 = the run's mean)."""
    from pfcompile.calibrate.measured import load_measured
    from pfcompile.formats.ops import PASS_KINDS

    trace = load_measured(trace_path)
    passes = [o for o in trace.ops if o.op.kind in PASS_KINDS]
    by_op: dict = {}
    for o in passes:
        by_op.setdefault((o.rank, str(o.op)), []).append(o.ms)
    mean = {k: statistics.mean(v) for k, v in by_op.items()}
    t0 = min(o.start_ms for o in passes)
    out = {}
    for w in WINDOWS_S:
        bins: dict[int, list[float]] = {}
        for o in passes:
            bins.setdefault(int((o.start_ms - t0) // (w * 1e3)), []).append(o.ms / mean[(o.rank, str(o.op))])
        out[w] = [statistics.mean(bins[b]) for b in sorted(bins)][:-1]
    return out


def correlation(x: list[float], y: list[float]) -> float:
    """Pearson's r of two series (0 where either is constant: no linear relation to show)."""
    try:
        return statistics.correlation(x, y)
    except statistics.StatisticsError:
        return 0.0


def quantile(s: list[float], f: float) -> float:
    """The f-quantile of the sorted `s`, nearest rank."""
    return s[min(len(s) - 1, int(f * len(s)))]


def row(what: str, unit: str, v: list[float], fmt: str = ".2f", ratio: bool = True) -> str:
    s = sorted(v)
    cells = [statistics.median(s), quantile(s, 0.1), quantile(s, 0.9), s[0], s[-1]]
    spread = f"{s[-1] / s[0]:.3f}" if ratio and s[0] > 0 else "-"
    return f"| {what} | {unit} | {len(s)} | " + " | ".join(format(c, fmt) for c in cells) + f" | {spread} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the kernel is timed")
    ap.add_argument("--size", type=int, default=KERNEL_SIZE, help="the kernel's matrix size")
    ap.add_argument("--runs", type=int, default=8, help="runs of the plan, back to back")
    ap.add_argument("--steps", type=int, default=30, help="steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--long-steps", type=int, default=1200, help="steps of the one long traced run (0: skip)")
    ap.add_argument("--beside", type=float, default=1.0,
                    help="seconds of both kernels timed just before each run, for their correlation with it (0: skip)")
    ap.add_argument("--side-by-side", type=float, default=0.0, metavar="S",
                    help="also time both kernels on both cores at once for S seconds, one process pinned to each "
                         "(0: skip)")
    ap.add_argument("--profile", default=str(ROOT / "profiles" / "bert-tiny-cpu.json"))
    a = ap.parse_args()
    if a.runs < 2:
        sys.exit("drift: --runs must be >= 2 (the pairs need two)")
    # the runtime benchmark's plan and launch helpers (loaded by path: its name is the package's)
    spec = importlib.util.spec_from_file_location("bench_runtime", Path(__file__).with_name("runtime.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    load0 = os.getloadavg()
    kernel, stream = kernel_pairs(a.seconds, a.size)
    with tempfile.TemporaryDirectory(prefix="pfcompile-drift-") as tmp:
        plan = bench.plan(a.profile, Path(tmp), "drift-1f1b-adamw", "--schedule", "1f1b", "--micro-batches", "4",
                          "--optimizer", "adamw", "--method", "none")
        runs, before = [], []
        for i in range(a.runs):
            if a.beside > 0:
                before.append(tuple(statistics.median(k) for k in kernel_pairs(a.beside, a.size)))
            runs.append(bench.run_ours(plan, a.steps, a.warmup).step_ms)
            print(f"run {i + 1}/{a.runs}: {runs[-1]:.2f} ms/step", file=sys.stderr)
        windows = {}
        if a.long_steps > 0:
            trace = str(Path(tmp) / "long.trace.json")
            print(f"one run of {a.long_steps} steps, traced", file=sys.stderr)
            bench.run_ours(plan, a.long_steps, a.warmup, "--trace", trace)
            windows = window_levels(trace)
    both = side_by_side(a.side_by_side, a.size) if a.side_by_side > 0 else {}
    load1 = os.getloadavg()
    paired = [100 * (b / a_ - 1) for a_, b in zip(runs, runs[1:])]
    print(f"\nLoad average (1, 5, 15 min): before {', '.join(f'{x:.2f}' for x in load0)}; "
          f"after {', '.join(f'{x:.2f}' for x in load1)}; {os.cpu_count()} CPUs\n")
    print("| what | unit | n | median | p10 | p90 | min | max | max/min |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    print(row(f"kernel: 100 matmuls {a.size}x{a.size}, 1 thread, every 0.2 s for {a.seconds:g} s", "ms", kernel))
    print(row(f"beside it: 2 AdamW-like updates of {STREAM_FLOATS:,} floats (memory-bound)", "ms", stream))
    print(row("the two, sample by sample: matmuls over updates", "ratio", [k / s for k, s in zip(kernel, stream)], ".3f"))
    print(row(f"one plan, back-to-back runs of {a.steps} steps ({Path(a.profile).stem}, 1F1B, AdamW, 2 ranks)",
              "ms/step", runs))
    print(row("the same runs paired, each over the one before (0 in truth)", "% over", paired, "+.1f", ratio=False))
    if len(before) >= 3:
        r = [correlation(runs, [b[j] for b in before]) for j in (0, 1)]
        print(f"\nEach run against the kernels timed for {a.beside:g} s just before it ({len(runs)} runs): "
              f"Pearson's r of its ms/step with the matmuls' ms {r[0]:+.2f}, with the updates' ms {r[1]:+.2f}")
    if windows:
        print(f"\nOne run of {a.long_steps} steps: its passes' level (each op over its mean in the run) averaged "
              f"over consecutive windows\n")
        print("| window | windows | standard deviation | p10 | p90 | min | max |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for w, v in windows.items():
            if len(v) >= 2:
                s = sorted(v)
                print(f"| {w:g} s | {len(v)} | {statistics.pstdev(v):.3f} | {quantile(s, 0.1):.3f} | "
                      f"{quantile(s, 0.9):.3f} | {s[0]:.3f} | {s[-1]:.3f} |")
    if both:
        print(f"\nBoth kernels on both cores at once for {a.side_by_side:g} s (one process pinned to each, back to "
              f"back, no runtime): each core's windows over its median, the cores' correlation, and how often a "
              f"later window is within ±10% of an earlier one (the two cores' mean)\n")
        print("| window | kernel | windows | core 0 min–max | core 1 min–max | r | later within ±10% of earlier |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for w, kernels in both.items():
            for kernel, d in kernels.items():
                c0, c1 = d["cores"]
                print(f"| {w:g} s | {kernel} | {d['windows']} | {c0[0]:.3f}–{c0[1]:.3f} | {c1[0]:.3f}–{c1[1]:.3f} | "
                      f"{d['r']:+.2f} | {d['within_10']:.0%} |")


if __name__ == "__main__":
    main()
