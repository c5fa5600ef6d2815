"""Measure a model's costs with the runtime's own code: what is timed is what runs.

Every entry is timed by calling the function the runtime's interpreter calls for that op:
a part's forward/backward is `runtime.models.Stage` over that one part with the K-FAC hooks
attached and capturing (a refresh step, the costlier case); curvature, inversion and
preconditioning are `runtime.kfac.KfacLayer.curv_a/curv_b/invert/precondition`;
messages go through `runtime.comm.Mailbox` and `runtime.comm.all_reduce_sum` in a real
two-rank process group.

Timing: warm-up runs first, then `repeats` samples; an entry stops early once its samples
add up to `entry_budget_s` (keeping at least 3), so a 1000x1000 eigendecomposition does not
dominate the profiling time. CUDA entries are timed with events, CPU ones with
perf_counter (or, with clock="thread", the CPU time of the one torch thread, which leaves
out time taken by other processes on a shared machine); median into the entry, [p10, p90]
into `spread`. Then the runtime probe (a short run of the runtime itself) raises the
parts' fwd, bwd and optimizer-step medians to their expected time in a run: each times its
kind's mean over median in the probe (`provenance.run_tail`, calibrate.fit.run_tail; 1.00-
1.13 on bert-tiny and bert-mini, 2 CPU ranks). Alone in a loop an op's time is tight around its median; in
a run it is stalled now and then, and a step adds the ops' means. K-FAC entries, which the
probe does not run, stay medians.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pfcompile import __version__
from pfcompile.formats.errors import InputError
from pfcompile.formats.profile import Comm, KfacLayer, LinkModel, Part, Profile, RuntimeOverheads, fit_link
from pfcompile.profiler.reference import LINK as MODEL_LINK
from runtime.comm import free_port

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SEED = 0


# --- timing ------------------------------------------------------------------------------------
@dataclass
class Timing:
    median: float
    p10: float
    p90: float
    samples: int


COLD_SWEEP_BYTES = 64 << 20  # above the last-level cache of the CPUs we profile on


class Clock:
    """Times a callable on one device: warm-up, then repeats, each optionally after an untimed setup."""

    def __init__(self, device: torch.device, repeats: int, warmup: int, entry_budget_s: float = 2.0,
                 kind: str = "wall", cold: bool = False):
        self.device, self.repeats, self.warmup, self.budget = device, repeats, warmup, entry_budget_s
        # cold: before each repeat, untimed, sweep a buffer larger than the CPU's caches, so an
        # op starts from memory as it does in a run, where other ops ran in between (a repeat
        # right after the last one finds its weights and inputs in cache)
        self._sweep = torch.empty(COLD_SWEEP_BYTES // 4, dtype=torch.float32) if cold and device.type == "cpu" else None
        # "thread": CPU time of this thread (time.thread_time). With one torch thread all the
        # work runs on it, so time spent descheduled by other processes is not counted.
        self.now = time.thread_time if kind == "thread" else time.perf_counter

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _once(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        t0 = self.now()
        fn()
        return (self.now() - t0) * 1e3

    def time(self, fn: Callable[[], object], setup: Callable[[], object] | None = None) -> Timing:
        samples: list[float] = []
        for i in range(self.warmup + self.repeats):
            if setup is not None:
                setup()
            if self._sweep is not None:
                self._sweep.fill_(float(i))
            self._sync()
            ms = self._once(fn)
            if i >= self.warmup:
                samples.append(ms)
                if len(samples) >= 3 and sum(samples) > self.budget * 1e3:
                    break
        p10, p50, p90 = np.percentile(samples, [10, 50, 90])
        return Timing(float(p50), float(p10), float(p90), len(samples))


# --- bytes --------------------------------------------------------------------------------------
# One definition with the runtime's memory count (runtime.memory), so the planner's model and
# the run count the same bytes.
from runtime.memory import nbytes, saved_activation_bytes  # noqa: E402


# --- the model's parts and K-FAC layers ------------------------------------------------------------
class PartBench:
    """One part built as the runtime builds a stage, with its K-FAC layers attached."""

    def __init__(self, spec, name: str, micro_batch: int, seq_len: int, device, dtype):
        from runtime import kfac
        from runtime.models import Stage, kfac_linears
        from runtime.precision import precision

        self.name, self.cfg = name, spec.cfg
        # bfloat16 is mixed precision as the runtime runs it: float32 parameters and K-FAC
        # state, autocast forward, bf16 activations between parts (runtime.precision)
        self.precision = precision(str(dtype).removeprefix("torch."))
        self.device_type = torch.device(device).type
        dtype = self.precision.compute_dtype
        self.stage = Stage(spec, [name], seed=SEED, dtype=self.precision.param_dtype).to(device)
        self.is_first, self.is_last = name == spec.part_names[0], name == spec.part_names[-1]
        self.kfac = kfac.make_layers(kfac_linears(self.stage), kfac.KfacConfig(), loss_divisor=1.0)
        self._capturing = kfac.capturing
        g = torch.Generator().manual_seed(SEED)
        shape = (micro_batch, seq_len)
        if self.is_first:
            self.x = torch.randint(self.cfg.vocab, shape, generator=g).to(device)
        else:
            self.x = torch.randn(*shape, self.cfg.hidden, generator=g).to(device=device, dtype=dtype)
        self.targets = torch.randint(self.cfg.vocab, shape, generator=g).to(device) if self.is_last else None
        self.out = None
        self.grad_out = None

    def forward(self):
        x = self.x if self.is_first else self.x.detach().requires_grad_(True)
        self.last_input = x  # the split backward's B asks for its gradient
        with self._capturing(self.kfac, 0), self.precision.autocast(self.device_type):
            self.out = self.stage(x, self.targets) if self.is_last else self.precision.boundary(self.stage(x))
        return self.out

    def backward(self):
        with self._capturing(self.kfac, 0):
            if self.is_last:
                torch.autograd.backward(self.out)
            else:
                torch.autograd.backward(self.out, self.grad_out)
        self.out = None

    def param_storages(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self.stage.parameters()}


def measure_part(bench: PartBench, clock: Clock) -> tuple[Part, dict[str, Timing]]:
    out, act = saved_activation_bytes(bench.forward, bench.param_storages())
    out_bytes = 0 if bench.is_last else nbytes(out)
    if not bench.is_last:
        g = torch.Generator().manual_seed(SEED + 1)
        bench.grad_out = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    fwd = clock.time(bench.forward)
    bwd = clock.time(bench.backward, setup=bench.forward)
    params = list(bench.stage.parameters())
    grad_bytes = sum(nbytes(p.grad) for p in params if p.grad is not None)
    split = measure_split_backward(bench, clock)
    steps = measure_step(bench, clock)
    part = Part(name=bench.name, fwd_ms=fwd.median, bwd_ms=bwd.median, act_bytes=act,
                param_bytes=sum(nbytes(p) for p in params), grad_bytes=grad_bytes, out_bytes=out_bytes,
                step_ms={k: t.median for k, t in steps.items()},
                bwd_input_ms=split["bwd_input_ms"].median, bwd_weight_ms=split["bwd_weight_ms"].median,
                wgrad_bytes=weight_pass_kept_bytes(bench))
    return part, {"fwd_ms": fwd, "bwd_ms": bwd, **split, **{f"step_ms.{k}": t for k, t in steps.items()}}


def weight_pass_kept_bytes(bench: PartBench) -> int:
    """What the part's W keeps besides its activations after B: every nn.Linear's output
    gradient (runtime.split_backward.WeightPasses.kept), counted as runtime.memory counts it."""
    from runtime.split_backward import WeightPasses

    split = WeightPasses(bench.stage)
    try:
        with split.recording(0):
            bench.forward()
        split.backward_input(0, bench.out, None if bench.is_last else bench.grad_out,
                             None if bench.is_first else bench.last_input)
        bench.out = None
        return sum(nbytes(g) for _, _, g in split.kept.pop(0) if g is not None)
    finally:
        split.close()
        split.saved.clear()
        split.kept.clear()


def measure_split_backward(bench: PartBench, clock: Clock) -> dict[str, Timing]:
    """The zero-bubble families' split backward of this part, as the runtime's interpreter
    runs it (runtime.split_backward.WeightPasses): the forward recorded for the split, B
    (`backward_input`: input gradient, non-Linear parameters', Linear output gradients kept)
    and W (`backward_weight`: each Linear's weight gradient from the kept tensors), with
    K-FAC capture on as for bwd_ms. Each timed run starts from its own forward (and B)."""
    from runtime.split_backward import WeightPasses

    split = WeightPasses(bench.stage)
    x = None

    def forward():
        nonlocal x
        with split.recording(0):
            bench.forward()
        x = bench.last_input

    def backward_input():
        with bench._capturing(bench.kfac, 0):
            split.backward_input(0, bench.out, None if bench.is_last else bench.grad_out,
                                 None if bench.is_first else x)
        bench.out = None

    def backward_weight():
        split.backward_weight(0)

    def forward_and_b():
        forward()
        backward_input()

    try:
        b = clock.time(backward_input, setup=forward)
        w = clock.time(backward_weight, setup=forward_and_b)
    finally:
        split.close()
        split.saved.clear()
        split.kept.clear()
    return {"bwd_input_ms": b, "bwd_weight_ms": w}


def measure_step(bench: PartBench, clock: Clock) -> dict[str, Timing]:
    """The `step` op over this part's parameters, as runtime.build.make_update runs it: KL clip
    over its K-FAC layers then the K-FAC optimizer (SGD-momentum + AdamW), and the first-order
    baseline's AdamW. Each run starts from the gradients of a real backward (and, for the KL
    clip, a preconditioned-gradient term per layer); the optimizers' state exists from the
    warm-up on, as in every step after the first. The parameters are restored afterwards."""
    from runtime.kfac import KfacConfig, apply_kl_clip
    from runtime.optim import build_optimizer

    params = list(bench.stage.parameters())
    saved = [p.detach().clone() for p in params]
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    def fresh():
        for p, g in zip(params, grads):
            p.grad = g.clone()
        for l in bench.kfac:
            l.kl_term = (l.module.weight.grad * l.module.weight.grad).sum()

    out = {}
    for kind, layers in (("kfac", bench.kfac), ("adamw", [])):
        opt = build_optimizer(bench.stage, layers)
        kl_clip = KfacConfig().kl_clip

        def step(opt=opt, layers=layers, kl_clip=kl_clip):
            if layers:
                apply_kl_clip(layers, opt.lr, kl_clip)
            opt.step()
            opt.zero_grad()
        out[kind] = clock.time(step, setup=fresh)
    with torch.no_grad():
        for p, v, g in zip(params, saved, grads):
            p.copy_(v)
            p.grad = g
    for l in bench.kfac:
        l.kl_term = None
    return out


def capture_layer_tensors(bench: PartBench) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each K-FAC layer's real input and output gradient of one micro-batch (for re-saving
    before every timed curvature op, which consumes what was saved)."""
    got: dict[str, list] = {l.name: [None, None] for l in bench.kfac}
    handles = []
    for l in bench.kfac:
        def hook(module, inputs, output, name=l.name):
            got[name][0] = inputs[0].detach()
            output.register_hook(lambda gy: got[name].__setitem__(1, gy.detach()))
        handles.append(l.module.register_forward_hook(hook))
    bench.forward()
    bench.backward()
    for h in handles:
        h.remove()
    return {n: (x, gy) for n, (x, gy) in got.items()}


def measure_kfac_layer(layer, part: str, x: torch.Tensor, gy: torch.Tensor,
                       clock: Clock) -> tuple[KfacLayer, dict[str, Timing]]:
    from runtime.kfac import KfacConfig

    t: dict[str, Timing] = {}
    t["curv_a_ms"] = clock.time(lambda: layer.curv_a(0), setup=lambda: layer.save_input(0, x))
    t["curv_b_ms"] = clock.time(lambda: layer.curv_b(0), setup=lambda: layer.save_grad(0, gy))
    # An inversion EMA-updates its own factor first (runtime.kfac: once per cycle): timed
    # with it, in the steady state (a previous cycle's factor exists, updated in place).
    layer.update_factors()
    inverse_bytes = {"A": 0, "B": 0}
    for method in ("cholesky", "eigen"):
        layer.cfg = KfacConfig(inverse=method)
        for f in ("A", "B"):
            t[f"inv_{f.lower()}_ms.{method}"] = clock.time(lambda f=f: layer.invert(f),
                                                            setup=lambda f=f: layer.undo_update_mark(f))
            # the larger of the two methods' inverses (eigen packs [Q | eigenvalues]):
            # the memory a plan needs whichever method it picks
            inverse_bytes[f] = max(inverse_bytes[f], nbytes(layer.pending(f)))
    # preconditioning with Cholesky inverses in force (the runtime's default method)
    layer.cfg = KfacConfig(inverse="cholesky")
    layer.invert("A")
    layer.invert("B")
    layer.activate()
    w, b = layer.module.weight, layer.module.bias
    w_grad = w.grad.detach().clone()
    b_grad = b.grad.detach().clone() if b is not None else None

    def fresh_grads():  # precondition() replaces the gradients: start each run from the same ones
        w.grad = w_grad.clone()
        if b is not None:
            b.grad = b_grad.clone()

    t["precond_ms"] = clock.time(layer.precondition, setup=fresh_grads)
    fresh_grads()
    lin = layer.module
    entry = KfacLayer(
        name=layer.name, part=part, in_features=lin.in_features, out_features=lin.out_features,
        bias=lin.bias is not None,
        curv_a_ms=t["curv_a_ms"].median, curv_b_ms=t["curv_b_ms"].median,
        inv_a_ms={m: t[f"inv_a_ms.{m}"].median for m in ("cholesky", "eigen")},
        inv_b_ms={m: t[f"inv_b_ms.{m}"].median for m in ("cholesky", "eigen")},
        precond_ms=t["precond_ms"].median,
        kept_a_bytes=nbytes(x), kept_b_bytes=nbytes(gy),
        factor_a_bytes=nbytes(layer.factors["A"]), factor_b_bytes=nbytes(layer.factors["B"]),
        inverse_a_bytes=inverse_bytes["A"], inverse_b_bytes=inverse_bytes["B"],
    )
    return entry, t


# --- communication ---------------------------------------------------------------------------------
def _comm_worker(rank: int, port: int, sizes: list[int], repeats: int, warmup: int, queue,
                 device_type: str = "cpu") -> None:
    """One of two ranks: ping-pong (one way = half the round trip) and all-reduce per size.
    Sizes are interleaved within each round, so a burst of load from other processes hits
    every size alike instead of bending the fit at one size."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from runtime import comm

    # the backend follows the profiled device (gloo for CPU tensors even on a GPU host);
    # tag-free as the runtime runs on NCCL: ping and pong are the pair's only messages
    world = comm.init_world(60.0, device_type)
    try:
        mailbox = comm.Mailbox(world, tags=False)
        bufs = [torch.zeros(max(1, n // 4), dtype=torch.float32, device=world.device) for n in sizes]
        p2p: list[list[float]] = [[] for _ in sizes]
        ar: list[list[float]] = [[] for _ in sizes]
        around: list[list[float]] = [[] for _ in sizes]
        for i in range(warmup + repeats):
            for j, buf in enumerate(bufs):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    mailbox.send("ping", buf, 1, 0)
                    mailbox.recv("pong", buf.shape, buf.dtype, 1, 1)
                else:
                    mailbox.recv("ping", buf.shape, buf.dtype, 0, 0)
                    mailbox.send("pong", buf, 0, 1)
                mailbox.drain()
                if world.device.type == "cuda":
                    torch.cuda.synchronize()
                t1 = time.perf_counter()
                dist.barrier()
                t2 = time.perf_counter()
                comm.all_reduce_sum([buf], None, world.timeout, "all-reduce")
                if world.device.type == "cuda":
                    torch.cuda.synchronize()
                t3 = time.perf_counter()
                # what the runtime pays around a message: posting the send, and completing a
                # receive whose data is already there (posted 5 ms after the send)
                dist.barrier()
                if rank == 0:
                    t4 = time.perf_counter()
                    mailbox.send("probe", buf, 1, 0)
                    own = time.perf_counter() - t4
                    mailbox.drain()
                else:
                    time.sleep(0.005)
                    t4 = time.perf_counter()
                    mailbox.recv("probe", buf.shape, buf.dtype, 0, 0)
                    if world.device.type == "cuda":
                        torch.cuda.synchronize()
                    own = time.perf_counter() - t4
                if i >= warmup:
                    p2p[j].append((t1 - t0) * 1e3 / 2)
                    ar[j].append((t3 - t2) * 1e3)
                    around[j].append(own * 1e3)
        # rank 0 reports the exchanges and its sends; rank 1 its receives
        queue.put({"rank": rank, "backend": world.backend, "around": [float(np.median(a)) for a in around],
                   "samples": [(nbytes(b), float(np.median(a)), float(np.median(c))) for b, a, c in zip(bufs, p2p, ar)]})
    finally:
        comm.shutdown()


def message_sizes(act_bytes: int) -> list[int]:
    """A spread of sizes around the inter-stage message, for the latency/bandwidth fit."""
    return sorted({4096, 65536, 1 << 20, max(4096, act_bytes // 4), max(4096, act_bytes), 4 * max(4096, act_bytes)})


def measure_comm(act_bytes: int, device: torch.device, repeats: int,
                 warmup: int) -> tuple[Comm, dict, RuntimeOverheads]:
    """gloo on CPU, NCCL with two GPUs, both real two-rank groups; one GPU: a stated model
    (and no runtime overheads measured around messages)."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        note = ("model: one GPU, no peer to measure; latency/bandwidth of pfcompile.profiler.reference.LINK "
                f"({MODEL_LINK.latency_ms} ms, {MODEL_LINK.bytes_per_ms / 1e6:g} GB/s)")
        return Comm("model", act_bytes, MODEL_LINK, MODEL_LINK), {"comm_note": note}, RuntimeOverheads()
    import torch.multiprocessing as mp

    sizes = message_sizes(act_bytes)
    repeats = max(repeats, 30)  # cheap next to the compute entries, and the noisiest
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    try:
        mp.start_processes(_comm_worker, args=(free_port(), sizes, repeats, warmup, queue, device.type), nprocs=2,
                           join=True, start_method="spawn")
    except Exception as e:  # noqa: BLE001 - a rank died: say so in one line, not two tracebacks
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        raise InputError("communication", None, f"the 2-rank measurement failed ({lines[-1] if lines else type(e).__name__}); "
                                                "rerun, or use --no-comm for a stated model") from None
    got = {d["rank"]: d for d in (queue.get(), queue.get())}
    samples, send_ms, recv_ms = got[0]["samples"], got[0]["around"], got[1]["around"]
    # the link: a one-way message to a waiting receiver; a receive posted after its send
    # still pays recv_ms (gloo and NCCL pair the two before moving data: Costs.message_ms)
    p2p = fit_link([(n, t) for n, t, _ in samples])
    at = min(range(len(samples)), key=lambda j: abs(samples[j][0] - act_bytes))
    runtime = RuntimeOverheads(send_ms=send_ms[at], recv_ms=recv_ms[at])
    # two ranks: a ring all-reduce moves 2(r-1)/r = 1 times the bytes, as Comm.allreduce_ms assumes
    allreduce = fit_link([(n, t) for n, _, t in samples])
    method = f"measured-{got[0]['backend']}"
    note = (f"{method}: 2 ranks on this host, 1 thread each, runtime.comm Mailbox ping-pong (one way = "
            f"half the round trip) and all_reduce_sum; median of {repeats} per size; the send's posting and a "
            f"receive posted 5 ms after its send timed alone (runtime.send_ms/recv_ms, at the stage "
            f"message's size); fit latency + bytes/bandwidth")
    return Comm(method, act_bytes, p2p, allreduce), {
        "comm_note": note, "comm_samples": [{"bytes": n, "p2p_ms": a, "allreduce_ms": b, "send_ms": s, "recv_ms": r}
                                            for (n, a, b), s, r in zip(samples, send_ms, recv_ms)]}, runtime


def measure_runtime(profile: Profile, device: torch.device,
                    steps: int = 24) -> tuple[RuntimeOverheads, LinkModel | None, dict[str, float], dict]:
    """The runtime's own costs around the ops, measured by running it: a 2-stage GPipe plan of
    the profiled model without K-FAC, `steps` steps on 2 ranks (torchrun, one thread each,
    synthetic tokens), its measured trace fitted as `pfcompile calibrate` fits one
    (pfcompile.calibrate.fit): the dispatch gap per op, the work between steps, a send's
    posting, a receive's completion, and the op times' spread (runtime.op_spread: 24 steps
    give each stage's fwd and bwd ~90 samples), and the p2p link as the run sees it: the
    latency of its receives posted before their send ended, at the benchmark's bandwidth
    (None when none was); and the run's tail per op kind (calibrate.fit.run_tail: fwd, bwd
    and the optimizer step's mean over median in the run; {} when it failed). Kept only where
    the run worked; otherwise the message benchmark's link and send/receive times stand (said
    in the provenance)."""
    import subprocess
    import tempfile

    from pfcompile.calibrate.fit import fit_runtime
    from pfcompile.calibrate.measured import load_measured
    from pfcompile.graph.schedules import PipelineConfig
    from pfcompile.place.build import build_plan

    with tempfile.TemporaryDirectory(prefix="pfcompile-probe-") as tmp:
        plan, _, _ = build_plan(profile, PipelineConfig("gpipe", stages=2, micro_batches=4, kfac=False), "none")
        plan_path, trace_path = os.path.join(tmp, "probe.plan.json"), os.path.join(tmp, "probe.trace.json")
        plan.save(plan_path)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "runtime",
               plan_path, "--steps", str(steps), "--warmup", "2", "--data", "synthetic", "--trace", trace_path,
               "--device", device.type]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode or not os.path.exists(trace_path):
            tail = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-1:] or ["no output"]
            return RuntimeOverheads(), None, {}, {"runtime_note": f"runtime probe failed ({tail[0][:200]}); overheads "
                                                              f"from the message benchmark only"}
        trace = load_measured(trace_path)
    fit = fit_runtime([trace], profile, "mean")  # sums of op times add means
    link = fit.link if fit.link is not profile.comm.p2p else None
    return fit.overheads, link, fit.tail, {"runtime_note": f"runtime overheads measured by running the runtime: 2-stage GPipe without "
                                       f"K-FAC, 4 micro-batches, {steps} steps (2 warm-up), 2 ranks, 1 thread each, the "
                                       f"runtime's default --recv-ahead; "
                                       f"fitted like pfcompile calibrate (mean occupancy)"}


def raise_to_run_mean(parts: list[Part], tail: dict[str, float]) -> None:
    """Each part's fwd, bwd (and its split halves, B and W, which the probe does not run: the
    backward's) and optimizer-step entries times its kind's run tail (calibrate.fit.run_tail):
    an op's median timed alone becomes its expected time in a run."""
    for p in parts:
        p.fwd_ms *= tail.get("fwd", 1.0)
        b = tail.get("bwd", 1.0)
        p.bwd_ms *= b
        if p.bwd_input_ms is not None and p.bwd_weight_ms is not None:
            p.bwd_input_ms, p.bwd_weight_ms = p.bwd_input_ms * b, p.bwd_weight_ms * b
        p.step_ms = {k: v * tail.get("step", 1.0) for k, v in p.step_ms.items()}


def _runtime_op(dtype: str, device: torch.device, fn):
    """Run a measurement; an op torch lacks for this dtype/device is a one-line input error."""
    try:
        return fn()
    except NotImplementedError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError("--dtype", None, f"{dtype} on {device.type}: the runtime uses an op torch does not "
                                          f"implement there ({first})") from None


# --- profiling under the run's conditions: other ranks working at once -----------------------------
def _neighbour(model: str, micro_batch: int, seq_len: int, dtype: str, threads: int, stop) -> None:
    """One other 'rank': the whole model's forward and backward, again and again, until stopped."""
    torch.set_num_threads(threads)
    spec = resolve_spec(model, seq_len)
    benches = [PartBench(spec, name, micro_batch, seq_len, torch.device("cpu"), DTYPES[dtype])
               for name in spec.part_names]
    for b in benches:
        out = b.forward()
        if not b.is_last:
            b.grad_out = torch.ones_like(out)
        b.out = None
    while not stop.is_set():
        for b in benches:
            b.forward()
            b.backward()


class _Neighbours:
    """ranks - 1 neighbour processes for the duration of a `with` block (none for one rank)."""

    def __init__(self, model, micro_batch, seq_len, dtype, threads, count):
        self.args, self.count, self.procs = (model, micro_batch, seq_len, dtype, threads), count, []

    def __enter__(self):
        if self.count:
            import torch.multiprocessing as mp
            ctx = mp.get_context("spawn")
            self.stop = ctx.Event()
            self.procs = [ctx.Process(target=_neighbour, args=(*self.args, self.stop), daemon=True)
                          for _ in range(self.count)]
            for p in self.procs:
                p.start()
            time.sleep(1.0)  # let them build their model and start working
        return self

    def __exit__(self, *exc):
        if self.procs:
            self.stop.set()
            for p in self.procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
        return False


# --- the whole profile -------------------------------------------------------------------------------
def check_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise InputError("--device", None, f"not a device: {name!r} (use cpu or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise InputError("--device", None, f"{name} is not available: no CUDA device on this machine "
                                               f"(torch {torch.__version__}, {build})")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise InputError("--device", None, f"{name} is not available: this machine has "
                                               f"{torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise InputError("--device", None, f"unsupported device {name!r} (use cpu or cuda:N)")
    return device


def resolve_spec(model: str, seq_len: int):
    from runtime.models import ModelSpecError, resolve_model

    try:
        spec = resolve_model(model, seq_len=seq_len)
    except ModelSpecError as e:
        raise InputError("--model", None, str(e)) from None
    if seq_len > spec.cfg.max_seq_len:
        raise InputError("--seq-len", None, f"{seq_len} exceeds {model}'s maximum sequence length {spec.cfg.max_seq_len}")
    return spec


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _model_json(model: str, cfg, micro_batch: int, seq_len: int, dtype: str) -> dict:
    return {"name": model, "kind": cfg.kind, "layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
            "ffn": cfg.ffn, "vocab": cfg.vocab, "seq_len": seq_len, "micro_batch": micro_batch, "dtype": dtype}


def profile_model(model: str, micro_batch: int, seq_len: int, device: str = "cpu", dtype: str = "float32",
                  repeats: int = 20, warmup: int = 5, threads: int = 1, comm: bool = True,
                  entry_budget_s: float = 2.0, clock: str = "wall", progress: bool = True,
                  ranks: int = 1, probe: bool = True, cold: bool = False) -> Profile:
    """Measure every part and K-FAC layer of `model`, and the links between two ranks.

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
    neighbours = _Neighbours(model, micro_batch, seq_len, dtype, threads, ranks - 1)
    load_before = _load_average()

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
                part, t = _runtime_op(dtype, dev, lambda bench=bench: measure_part(bench, timer))
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
                    entry, t = _runtime_op(dtype, dev, lambda layer=layer, name=name, x=x, gy=gy: measure_kfac_layer(layer, name, x, gy, timer))
                    layers.append(entry)
                    spread.update({f"kfac_layers.{layer.name}.{k}": [v.p10, v.p90] for k, v in t.items()})
                    bar.advance(task)
        act_bytes = micro_batch * seq_len * cfg.hidden * DTYPES[dtype].itemsize
        if comm:
            bar.update(task, description="communication (2 ranks)")
            link, comm_prov, runtime = measure_comm(act_bytes, dev, repeats, warmup)
            bar.advance(task)
            if probe:
                bar.update(task, description="the runtime itself (2 ranks, a short GPipe run)")
                draft = Profile(source="measured", provenance={}, model=_model_json(model, cfg, micro_batch, seq_len, dtype),
                                parts=parts, kfac_layers=layers, comm=link)
                measured_rt, probe_link, tail, note = measure_runtime(draft, dev)
                comm_prov.update(note)
                if tail:
                    raise_to_run_mean(parts, tail)
                    comm_prov["run_tail"] = tail
                    comm_prov["runtime_note"] += (
                        "; fwd/bwd/step entries: the op's median timed alone x its kind's mean/median "
                        "in this run (run_tail): a run stalls an op now and then, and a step adds means")
                if measured_rt.any():
                    runtime = measured_rt
                if probe_link is not None:
                    # A message in a running pipeline lags more than in a ping-pong between two
                    # waiting ranks (the receiver is busy, then wakes; bert-tiny on this VM: 0.39-
                    # 0.57 ms in runs against a 0.18-0.27 ms ping-pong): the plan's messages
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
        "load_avg": [load_before, _load_average()], "cpus": os.cpu_count(),
        "note": ("measured by pfcompile profile with the runtime's own ops: fwd/bwd per part with K-FAC "
                 "capture on (a refresh step), and the split backward's B/W (runtime.split_backward) likewise; precond_ms with Cholesky inverses; inverse_*_bytes the larger of "
                 "Cholesky and eigen ([Q | eigenvalues]); act_bytes = storages saved for backward, "
                 "parameters excluded"),
        **comm_prov,
    }
    return Profile(
        source="measured", provenance=provenance,
        model=_model_json(model, cfg, micro_batch, seq_len, dtype),
        parts=parts, kfac_layers=layers, comm=link, spread=spread, runtime=runtime,
    )
