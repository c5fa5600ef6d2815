"""The message benchmark: `runtime.pipeline.comm.Mailbox` ping-pong and `runtime.pipeline.comm.all_reduce_sum`
in a real two-rank process group (gloo on CPU, NCCL with two GPUs), fitted as latency plus
bytes over bandwidth, and the runtime's own cost of posting a send and completing a receive."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from pfcompile.formats.errors import InputError
from pfcompile.formats.profile import Comm, RuntimeOverheads, fit_link
from pfcompile.profiler.reference import LINK as MODEL_LINK
from runtime.observe.memory import nbytes
from runtime.pipeline.comm import free_port


def _comm_worker(rank: int, port: int, sizes: list[int], repeats: int, warmup: int, queue,
                 device_type: str = "cpu") -> None:
    """One of two ranks: ping-pong (one way = half the round trip) and all-reduce per size.
    Sizes are interleaved within each round, so a burst of load from other processes hits
    every size alike instead of bending the fit at one size."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from runtime.pipeline import affinity, comm

    if device_type == "cpu":
        affinity.pin_by_default(1)  # each on its own core, as a run's ranks are

    # the backend follows the profiled device (gloo for CPU tensors even on a GPU host);
    # tag-free as the runtime runs on NCCL: ping and pong are the pair's only messages
    world = comm.init_world(60.0, device_type)  # gloo's network threads idle, as a run's ranks have them
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
    note = (f"{method}: 2 ranks on this host, 1 thread each (each on its own cores where the host has them), runtime.pipeline.comm Mailbox ping-pong (one way = "
            f"half the round trip) and all_reduce_sum; median of {repeats} per size; the send's posting and a "
            f"receive posted 5 ms after its send timed alone (runtime.send_ms/recv_ms, at the stage "
            f"message's size); fit latency + bytes/bandwidth")
    return Comm(method, act_bytes, p2p, allreduce), {
        "comm_note": note, "comm_samples": [{"bytes": n, "p2p_ms": a, "allreduce_ms": b, "send_ms": s, "recv_ms": r}
                                            for (n, a, b), s, r in zip(samples, send_ms, recv_ms)]}, runtime
