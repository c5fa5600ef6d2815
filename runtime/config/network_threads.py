"""On gloo, its network threads run only where the rank's own thread does not (SCHED_IDLE).

Each gloo process group has a device thread (named `gloo_tcp_loop`) that waits in epoll on
its sockets and handles a ready one under the pair's lock, taken with a try-lock: when
another thread holds it, the event is left for the next tick. epoll is level-triggered,
so the next tick comes at once. The rank's thread holds that lock whenever it posts a
receive or a send, and a message arriving meanwhile wakes the device thread, often on the
same core: it preempts the rank's thread, which holds the lock it polls for, and spins
until the scheduler's slice ends, milliseconds later. Under SCHED_IDLE a woken device
thread does not preempt the rank's thread and gets well under 1% of a busy core: it runs
when the rank's thread waits (for a message, when its socket work is the work left) or a
core is idle.

The policy is per thread and set once the process groups exist (their device threads are
started by then): runtime.pipeline.comm sets it as it makes them.
Lowering a thread to SCHED_IDLE needs no privilege; raising it back does, so off leaves the
threads as they are.
"""

from __future__ import annotations

import os

GLOO_DEVICE_THREAD = "gloo_tcp_loop"


def _gloo_threads() -> list[int]:
    """This process's gloo device threads (their thread ids), by the name gloo gives them."""
    tids = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # no /proc: none found
        return []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().strip() == GLOO_DEVICE_THREAD:
                    tids.append(int(t))
        except OSError:  # the thread ended meanwhile
            pass
    return tids


def idle_network_threads(backend: str, on: bool = True) -> None:
    """With `on` and gloo on Linux, put this process's gloo device threads under SCHED_IDLE
    (network_threads_idle reads them back)."""
    if on and backend == "gloo" and hasattr(os, "SCHED_IDLE"):
        for tid in _gloo_threads():
            try:
                if os.sched_getscheduler(tid) != os.SCHED_IDLE:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except (ProcessLookupError, PermissionError):  # ended meanwhile; or a sandbox forbids it
                pass


def network_threads_idle(backend: str) -> int | None:
    """How many of this process's gloo device threads run under SCHED_IDLE, read back from
    the kernel (None where the backend is not gloo or the platform has no SCHED_IDLE)."""
    if backend != "gloo" or not hasattr(os, "SCHED_IDLE"):
        return None
    n = 0
    for tid in _gloo_threads():
        try:
            n += os.sched_getscheduler(tid) == os.SCHED_IDLE
        except ProcessLookupError:
            pass
    return n
