"""runtime.config.allocator against glibc itself: a fresh process allocates and frees a
tensor larger than glibc's largest dynamic mmap threshold (32 MiB on 64-bit), and its
minor page faults (getrusage) say whether the memory was mapped afresh each time."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT

from runtime.config.allocator import _glibc

pytestmark = [pytest.mark.e2e,  # a fresh process each: the setting lasts a process's life
              pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")]

CHILD = """
import resource, sys, torch
from runtime.config.allocator import freed_memory_kept, keep_freed_memory
kept = keep_freed_memory(sys.argv[1], sys.argv[2] == "on")
def churn():
    x = torch.empty(10 << 20)  # 40 MiB of float32
    x.fill_(1.0)  # touch every page
    del x
for _ in range(20):  # glibc's heap settles on a layout that holds the tensor
    churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    churn()
print(kept, freed_memory_kept(), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def faults(device: str, on: str) -> tuple[str, str, float]:
    r = subprocess.run([sys.executable, "-c", CHILD, device, on], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    kept, read_back, per = r.stdout.split()
    return kept, read_back, float(per)


def test_freed_memory_is_reused_not_mapped_afresh():
    """Kept: the 40 MiB come back from the heap, no page faults after the first time.
    Default glibc: each allocation is a new mapping, 10,240 pages of 4 KiB faulted in
    again. On a GPU run the host's malloc is left as it is."""
    kept, read_back, per = faults("cpu", "on")
    assert (kept, read_back) == ("True", "True") and per < 50, per
    kept, read_back, per = faults("cpu", "off")
    assert (kept, read_back) == ("False", "False") and per > 0.9 * (40 << 20) / 4096, per
    kept, _, per = faults("cuda", "on")
    assert kept == "False" and per > 0.9 * (40 << 20) / 4096, per
