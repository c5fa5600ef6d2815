"""Each rank on its own cores (`runtime.pin_cpus`: the default on a cpu where they suffice,
`--pin-cpus`, `--no-pin-cpus`): the node's usable cores split among its ranks.

torchrun starts every rank free to run on every core, so the kernel moves a rank between
cores (its caches left behind) and lets two ranks share one while another idles. Pinned,
local rank i of n gets the i-th contiguous share of the cores this job may use
(os.sched_getaffinity, which taskset and cgroups narrow): len(cores) // n each. Contiguous
shares keep a rank's cores together on the usual numbering (one socket, then the next);
hyperthread siblings and NUMA are not modelled.
"""

from __future__ import annotations

import os

from pfcompile.formats.errors import InputError


def _local() -> tuple[int, int]:
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def fits(threads: int) -> bool:
    """Whether every local rank gets `threads` cores of its own (the default: pinned where
    so). Only where the launcher says how many ranks share the node (torchrun sets
    LOCAL_WORLD_SIZE): ranks started otherwise may share it unannounced."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return False
    try:
        share(threads)
    except InputError:  # what --pin-cpus would refuse
        return False
    return True


def pin_by_default(threads: int) -> None:
    """Pin this process to its share where the runtime's ranks are pinned by default (fits):
    for other processes that stand in for ranks (the profiler's, the benchmarks')."""
    if fits(threads):
        pin(share(threads))


def share(threads: int) -> list[int]:
    """This rank's cores, checked against its torch threads (before any work: a one-line
    InputError when the node has fewer cores than ranks, or fewer per rank than threads)."""
    if not hasattr(os, "sched_setaffinity"):
        raise InputError("--pin-cpus", None, "needs Linux (os.sched_setaffinity)")
    cores = sorted(os.sched_getaffinity(0))
    local_rank, local_ranks = _local()
    if not 0 <= local_rank < local_ranks:
        raise InputError("--pin-cpus", None, f"local rank {local_rank} of {local_ranks} on this node (LOCAL_RANK, "
                                             "LOCAL_WORLD_SIZE): launch with torchrun")
    each = len(cores) // local_ranks
    if each < 1:
        raise InputError("--pin-cpus", None, f"{local_ranks} ranks on this node but {len(cores)} usable cores "
                         f"({cores}): one core per rank at least")
    if threads > each:
        raise InputError("--threads", None, f"{threads} threads per rank but --pin-cpus gives each rank "
                         f"{each} of the node's {len(cores)} cores (fewer --threads, or no --pin-cpus)")
    return cores[local_rank * each:(local_rank + 1) * each]


def pin(cores: list[int]) -> None:
    """Bind every thread this process has to `cores`; threads it starts later inherit them
    (gloo's, and torch's intra-op pool, which starts at the first parallel op)."""
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def allowed() -> list[int]:
    """The cores this process's threads may run on now (their union), as the kernel says."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    cores: set[int] = set()
    for tid in _threads():
        try:
            cores |= os.sched_getaffinity(tid)
        except ProcessLookupError:
            pass
    return sorted(cores)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        return [0]
