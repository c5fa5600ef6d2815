"""Add measured split-backward costs (schema 3) to a measured profile that predates them.

(A profile that has B and W but not `wgrad_bytes` gets only the bytes: its times stay.)

    python -m pfcompile.profiler.add_split PROFILE [PROFILE ...]

For each part, under the profile's own settings (model, micro-batch, sequence length, dtype,
threads, clock, repeats, warm-up: read from the file), times in one sitting the whole
backward and the split backward's B and W exactly as `pfcompile profile` does
(pfcompile.profiler.parts.measure_passes, in turn), and stores

    bwd_input_ms = bwd_ms * B / bwd_now,   bwd_weight_ms = bwd_ms * W / bwd_now

so the split keeps the ratio measured side by side (B + W against the whole backward, the
quantity the planner needs) on the scale of the profile's other entries, measured at
another time. Everything else of the profile — its numbers and its provenance — is kept;
`provenance.split_note` says when and how the split was added (date, load average, the
ratios). A fresh `pfcompile profile` measures the split directly.
"""

from __future__ import annotations

import datetime as _dt
import sys

import torch

from pfcompile.formats.errors import InputError
from pfcompile.formats.profile import Profile, load_profile, upgraded
from pfcompile.profiler.clocks import Clock
from pfcompile.profiler.parts import PartBench, measure_passes, weight_pass_kept_bytes
from pfcompile.profiler.provenance import load_average
from pfcompile.profiler.settings import DTYPES, check_device, resolve_spec


def add_split(prof: Profile, where: str) -> Profile:
    pv = prof.provenance
    if prof.source != "measured" or pv.get("device_type") != "cpu":
        raise InputError(where, "source", "only a measured CPU profile can be completed on this machine")
    clock = "thread" if str(pv.get("clock", "")).startswith("time.thread_time") else "wall"
    threads = int(pv.get("threads", 1))
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dev = check_device("cpu")
    timer = Clock(dev, int(pv.get("repeats", 20)), int(pv.get("warmup", 5)), float(pv.get("entry_budget_s", 2.0)), clock)
    mb, seq, dtype = int(prof.model["micro_batch"]), int(prof.model["seq_len"]), str(prof.model["dtype"])
    spec = resolve_spec(prof.name, seq)
    load_before = load_average()
    ratios = {}
    timed = not all(p.split_measured for p in prof.parts)
    for part in prof.parts:
        bench = PartBench(spec, part.name, mb, seq, dev, DTYPES[dtype])
        out = bench.forward()
        if not bench.is_last:
            g = torch.Generator().manual_seed(1)
            bench.grad_out = torch.randn(out.shape, generator=g).to(dtype=out.dtype)
        part.wgrad_bytes = weight_pass_kept_bytes(bench)
        if part.split_measured:  # only the bytes were missing: the times stay as measured
            continue
        timed_now = measure_passes(bench, timer)
        whole = timed_now["bwd_ms"]
        split = {k: timed_now[k] for k in ("bwd_input_ms", "bwd_weight_ms")}
        scale = part.bwd_ms / whole.median if whole.median > 0 else 1.0
        part.bwd_input_ms = split["bwd_input_ms"].median * scale
        part.bwd_weight_ms = split["bwd_weight_ms"].median * scale
        for k, t in split.items():
            prof.spread[f"parts.{part.name}.{k}"] = [t.p10 * scale, t.p90 * scale]
        ratios[part.name] = round((split["bwd_input_ms"].median + split["bwd_weight_ms"].median) / whole.median, 3) \
            if whole.median > 0 else None
    if not timed:
        prof.provenance = {**pv, "wgrad_note": (
            f"wgrad_bytes added {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} by "
            f"pfcompile.profiler.add_split: the nn.Linear output gradients W keeps, after one B")}
        return upgraded(prof)  # in the current schema, its layers' names with it
    prof.provenance = {**pv, "split_note": (
        f"bwd_input_ms/bwd_weight_ms added {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} by "
        f"pfcompile.profiler.add_split (load_avg {[load_before, load_average()]}): B and W timed as "
        f"runtime.pipeline.split_backward runs them, next to the whole backward in the same sitting, and scaled to this "
        f"profile's bwd_ms; (B + W) / whole backward per part: {ratios}")}
    return upgraded(prof)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        for path in argv:
            prof = add_split(load_profile(path), path)
            prof.save(path)
            print(f"{path}: {prof.provenance['split_note']}")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
