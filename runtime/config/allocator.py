"""On a CPU, keep the memory torch frees for its next tensor, as CUDA's caching allocator does.

torch's CPU tensors come from the C library's malloc. glibc gives an allocation above its
mmap threshold (128 KiB at first, raised as such blocks are freed) a mapping of its own,
unmapped when freed, and hands the heap's free top back to the OS above its trim
threshold. The next tensor of that size then page-faults its memory in again, one fault
per 4 KiB page, zero-filled by the kernel. A pipeline step allocates and frees the same
activations every micro-batch, and an optimizer's temporaries (Newton-Schulz iterates,
eigenbases, preconditioned gradients) move both thresholds: the passes of a plan with
optimizer work fault where the same passes without it do not, a cost no profile of the
passes alone sees and no plan counts. With both thresholds high (`M_MMAP_THRESHOLD`,
`M_TRIM_THRESHOLD`, as `MALLOC_MMAP_THRESHOLD_`/`MALLOC_TRIM_THRESHOLD_` would set them at
start-up), freed memory stays in the process for the next allocation: the resident memory
stays at its peak until the process ends, which is what the run's memory model plans for.

The setting is the process's for the rest of its life: glibc has no call back to its
dynamic thresholds.
"""

from __future__ import annotations

import ctypes
import functools

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# mallopt takes an int: the largest threshold it can be given, far above any tensor of ours
# that is not as large as the machine's memory
KEEP_BYTES = 2**31 - 1


@functools.cache
def _glibc():
    """The C library when it is glibc (it has mallopt and gnu_get_libc_version), else None.
    The process's own symbols hold it: no ctypes.util.find_library, which starts ldconfig."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version, libc.mallopt  # noqa: B018 (AttributeError when not glibc)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


_kept = False


def keep_freed_memory(device_type: str, on: bool = True) -> bool:
    """On a CPU under glibc with `on`, raise malloc's mmap and trim thresholds so memory
    torch frees is reused, never mapped afresh. -> whether this process keeps freed memory
    (freed_memory_kept). Off leaves malloc as it is (a process that kept it keeps it)."""
    global _kept
    if device_type == "cpu" and on and not _kept:
        libc = _glibc()
        if libc is not None:
            mapped = libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)
            trimmed = libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
            _kept = bool(mapped and trimmed)
    return freed_memory_kept()


def freed_memory_kept() -> bool:
    """Whether this process's malloc keeps what torch frees (set by keep_freed_memory)."""
    return _kept
