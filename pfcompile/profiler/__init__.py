"""Measure a model's costs with the runtime's own code: what is timed is what runs.

`profile_model` (below) profiles a model end to end; each module holds one concern:

- clocks: `Clock` times one callable (perf_counter, the thread's CPU time or CUDA events;
  optionally from a cold cache), `Timing` its median and [p10, p90];
- parts: `PartBench` builds one part as the runtime builds a stage; its forward, backward,
  split backward (B and W) and optimizer step timed, with the bytes each keeps;
- kfac_ops: each K-FAC layer's curvature, inversions and preconditioning timed;
- optimizer_layers: the other optimizers' per-layer ops (Shampoo's, Muon's) timed, or
  estimated from their FLOPs for reference profiles;
- messages: the two-rank message benchmark (p2p and all-reduce link fits, send/receive costs);
- runtime_probe: short runs of the runtime itself for its overheads, the link a run sees,
  and every entry's time in a run;
- neighbours: the other ranks' processes that share the machine under `--ranks`;
- settings: dtypes, seed, device and model resolved with one-line input errors;
- provenance: the device's name, the load average and the model's shape a profile records;
- reference: profiles converted from PipeFisher's published numbers;
- add_split: adds measured B/W to a measured profile that predates them.

Every entry is timed by calling the function the runtime's interpreter calls for that op,
first alone in a loop (its median and spread), then in a run: the runtime probe runs a
2-stage 1F1B plan without optimizer work and one with each profiled optimizer's work
appended, and the entries become those runs' mean occupancies (an op in a run finds its
caches as the ops before it left them, shares memory bandwidth with the other rank, and is
stalled now and then; a step adds means), all put at the runs' common speed. One more
run with K-FAC in the bubbles gives the op times' spread of a busier plan (runtime.busy).
`provenance.in_run`: each entry's in-run time over its time alone. Without the probe
(`--no-runtime-probe`) the entries are the medians.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
import time

import torch

from pfcompile import __version__
from pfcompile.formats.errors import InputError
from pfcompile.formats.profile import Comm, Profile, RuntimeOverheads
from pfcompile.profiler.clocks import Clock
from pfcompile.profiler.kfac_ops import capture_layer_tensors, measure_kfac_layer
from pfcompile.profiler.messages import measure_comm
from pfcompile.profiler.neighbours import Neighbours
from pfcompile.profiler.optimizer_layers import measure_optimizer_layer
from pfcompile.profiler.parts import PartBench, measure_part
from pfcompile.profiler.provenance import device_name, load_average, model_json
from pfcompile.profiler.reference import LINK as MODEL_LINK
from pfcompile.profiler.runtime_probe import in_run_levels, measure_busy, measure_runtime, probe_trace
from pfcompile.profiler.settings import DTYPES, SEED, check_device, guard_unsupported_op, resolve_spec
from runtime.config.allocator import freed_memory_kept, keep_freed_memory
from runtime.config.precision import denormals_flushed, flushing_denormals


def profile_model(model: str, micro_batch: int, seq_len: int, device: str = "cpu", **kw) -> Profile:
    """`measure_model`, with subnormal floats flushed on a CPU as a run's ranks flush them by
    default (runtime.flush_denormal; the caller's setting is restored), and the memory torch
    frees kept for its next tensor as theirs is (runtime.keep_freed_memory; for the rest of
    this process, runtime.config.allocator)."""
    device_type = str(device).split(":")[0]
    keep_freed_memory(device_type)
    with flushing_denormals(device_type):
        return measure_model(model, micro_batch, seq_len, device, **kw)


def measure_model(model: str, micro_batch: int, seq_len: int, device: str = "cpu", dtype: str = "float32",
                  repeats: int = 20, warmup: int = 5, threads: int = 1, comm: bool = True,
                  entry_budget_s: float = 2.0, clock: str = "wall", progress: bool = True,
                  ranks: int = 1, probe: bool = True, cold: bool = False,
                  optimizers: tuple[str, ...] = ("kfac",), muon_ns_dtype: str = "bfloat16") -> Profile:
    """Measure every part and K-FAC layer of `model`, and the links between two ranks.

    `optimizers`: whose per-layer ops to time besides K-FAC's, which every profile holds
    ("shampoo", "muon": runtime.optimizers.shampoo, runtime.optimizers.muon on each covered layer); `muon_ns_dtype`
    the dtype Muon's Newton-Schulz iteration is timed in (the run's muon.ns_dtype).

    `ranks` > 1: measure under the run's conditions, with ranks - 1 other processes working
    at once (each the model's forward and backward in a loop, `threads` threads, the same
    device), so shared caches, memory bandwidth and core sharing are in the numbers."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if micro_batch <= 0 or seq_len <= 0 or repeats <= 0 or warmup < 0 or threads <= 0:
        raise InputError("profile", None, "micro-batch, seq-len, repeats and threads must be positive, warmup >= 0")
    if dtype not in DTYPES:
        raise InputError("--dtype", None, f"unknown dtype {dtype!r} (have: {', '.join(DTYPES)})")
    dev = check_device(device)
    if clock not in ("wall", "thread"):
        raise InputError("--clock", None, f"must be 'wall' or 'thread', got {clock!r}")
    if clock == "thread" and (dev.type != "cpu" or threads != 1):
        raise InputError("--clock", None, "'thread' needs --device cpu and --threads 1 (it counts one thread's CPU time)")
    spec = resolve_spec(model, seq_len)
    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    timer = Clock(dev, repeats, warmup, entry_budget_s, clock, cold=cold)
    cfg = spec.cfg
    if ranks < 1:
        raise InputError("--ranks", None, f"must be >= 1, got {ranks}")
    if dev.type == "cuda" and ranks > 1:
        raise InputError("--ranks", None, "> 1 is for CPUs (one rank per core); on CUDA each rank has its own GPU")
    started = time.perf_counter()
    neighbours = Neighbours(model, micro_batch, seq_len, dtype, threads, ranks - 1)
    load_before = load_average()

    parts, layers, spread = [], [], {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True, disable=not progress) as bar:
        task = bar.add_task(f"profiling {model}", total=len(spec.part_names) + int(comm))
        # the R - 1 neighbours share the CPU while the ops are timed; the two-rank message
        # benchmark and the runtime probe are R processes of their own, so they run alone
        with neighbours:
            for name in spec.part_names:
                bar.update(task, description=f"{name}: fwd/bwd")
                bench = PartBench(spec, name, micro_batch, seq_len, dev, DTYPES[dtype])
                part, t = guard_unsupported_op(dtype, dev, lambda bench=bench: measure_part(bench, timer, optimizers))
                parts.append(part)
                spread.update({f"parts.{name}.{k}": [v.p10, v.p90] for k, v in t.items()})
                bar.advance(task)
                if not bench.kfac:
                    continue
                bar.update(task, total=bar.tasks[0].total + len(bench.kfac))
                captured = capture_layer_tensors(bench)
                for layer in bench.kfac:
                    bar.update(task, description=f"{layer.name}: K-FAC")
                    x, gy = captured[layer.name]
                    entry, t = guard_unsupported_op(dtype, dev, lambda layer=layer, name=name, x=x, gy=gy: measure_kfac_layer(layer, name, x, gy, timer))
                    layers.append(entry)
                    spread.update({f"covered_layers.{layer.name}.optimizer_ms.kfac.{k}": [v.p10, v.p90] for k, v in t.items()})
                    for opt in optimizers:
                        if opt == "kfac":
                            continue
                        bar.update(task, description=f"{layer.name}: {opt}")
                        entry.optimizer_ms[opt], t = guard_unsupported_op(
                            dtype, dev, lambda opt=opt, layer=layer, x=x, gy=gy: measure_optimizer_layer(
                                opt, layer.name, layer.module, timer, muon_ns_dtype, x, gy))
                        spread.update({f"covered_layers.{layer.name}.optimizer_ms.{opt}.{k}": [v.p10, v.p90]
                                       for k, v in t.items()})
                    bar.advance(task)
        act_bytes = micro_batch * seq_len * cfg.hidden * DTYPES[dtype].itemsize
        if comm:
            bar.update(task, description="communication (2 ranks)")
            link, comm_prov, runtime = measure_comm(act_bytes, dev, repeats, warmup)
            bar.advance(task)
            if probe:
                bar.update(task, description="the runtime itself (2 ranks, a short 1F1B run)")
                draft = Profile(source="measured", provenance={}, model=model_json(model, cfg, micro_batch, seq_len, dtype),
                                parts=parts, covered_layers=layers, comm=link)
                measured_rt, probe_link, note, trace = measure_runtime(draft, dev)
                comm_prov.update(note)
                if trace is not None:
                    traces = {}
                    for opt in dict.fromkeys(("kfac", *optimizers)):
                        bar.update(task, description=f"the runtime itself: {opt}'s work appended (2 ranks)")
                        sets = (f"muon.ns_dtype={muon_ns_dtype}",) if opt == "muon" else ()
                        traces[opt], error = probe_trace(draft, dev, opt, sets=sets)
                        if traces[opt] is None:
                            del traces[opt]
                            comm_prov[f"in_run_note.{opt}"] = f"probe run failed ({error}): its entries are timed alone"
                    comm_prov["in_run"], comm_prov["in_run_level"] = in_run_levels(draft, trace, traces)
                    bar.update(task, description="the runtime itself: K-FAC in the bubbles (2 ranks)")
                    measured_rt.busy, comm_prov["busy_note"] = measure_busy(draft, dev, trace, measured_rt, probe_link)
                    ran = ", ".join(f"{o} {t.meta.get('steps')}" for o, t in traces.items())
                    comm_prov["runtime_note"] += (
                        f"; the parts' entries are this run's (mean occupancy, in proportion within a stage), "
                        f"each optimizer's from a run with its work appended to its refresh steps "
                        f"({ran} steps; K-FAC refreshes "
                        f"every other step, its capture_ms is its refresh steps' ops over its others'): "
                        f"in_run holds each entry's in-run time over its time alone; every entry is put at the "
                        f"runs' common speed (in_run_level.common: the runs' passes' levels, their mean weighted by "
                        f"steps), in_run_level holding each optimizer's run's passes over the first run's")
                if measured_rt.any():
                    runtime = measured_rt
                if probe_link is not None:
                    # A message in a running pipeline lags more than in a ping-pong between two
                    # waiting ranks (the receiver is busy, then wakes): the plan's messages
                    # cost what the probe's did, the ping-pong stays in the provenance.
                    comm_prov["p2p_pingpong"] = {"latency_ms": link.p2p.latency_ms,
                                                 "bytes_per_ms": link.p2p.bytes_per_ms}
                    comm_prov["comm_note"] += ("; the p2p latency is the runtime probe's (its receives posted "
                                               "before their send ended, at the ping-pong's bandwidth); the "
                                               "ping-pong's fit is p2p_pingpong")
                    link = Comm(link.method, link.act_bytes, probe_link, link.allreduce)
        else:
            link, runtime = Comm("model", act_bytes, MODEL_LINK, MODEL_LINK), RuntimeOverheads()
            comm_prov = {"comm_note": "model (not measured: --no-comm); latency/bandwidth of pfcompile.profiler.reference.LINK"}

    provenance = {
        "device": device_name(dev), "device_type": dev.type, "torch": torch.__version__,
        "cuda": torch.version.cuda, "dtype": dtype, "threads": threads,
        "micro_batch": micro_batch, "seq_len": seq_len, "repeats": repeats, "warmup": warmup,
        "entry_budget_s": entry_budget_s, "ranks": ranks, "cold_cache": cold,
        "clock": {"wall": "cuda events" if dev.type == "cuda" else "time.perf_counter",
                  "thread": "time.thread_time (CPU time of the one torch thread)"}[clock],
        "host": socket.gethostname(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "pfcompile": __version__, "wall_s": round(time.perf_counter() - started, 2),
        # other processes share the CPU: the 1-minute load average before and after says how much
        "load_avg": [load_before, load_average()], "cpus": os.cpu_count(),
        "optimizers": list(dict.fromkeys(("kfac", *optimizers))),
        "denormals_flushed": denormals_flushed(),
        "freed_memory_kept": freed_memory_kept(),
        **({"muon_ns_dtype": muon_ns_dtype} if "muon" in optimizers else {}),
        "note": ("measured by pfcompile profile with the runtime's own ops: fwd/bwd per part with K-FAC's "
                 "hooks idle, and the split backward's B/W (runtime.pipeline.split_backward) likewise; capture_ms "
                 "what capturing (a K-FAC refresh step) adds; K-FAC's precond with Cholesky inverses; inverse_*_bytes the larger of "
                 "Cholesky and eigen ([Q | eigenvalues]); act_bytes = storages saved for backward, "
                 "parameters excluded"),
        **comm_prov,
    }
    return Profile(
        source="measured", provenance=provenance,
        model=model_json(model, cfg, micro_batch, seq_len, dtype),
        parts=parts, covered_layers=layers, comm=link, spread=spread, runtime=runtime,
    )
