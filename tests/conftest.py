"""Shared test set-up, kept minimal: the suite runs beside other jobs on 2 cores."""

import os

# One intra-op thread per test process: numbers do not depend on the machine's core count
# and parallel test jobs do not oversubscribe the CPU.
os.environ.setdefault("OMP_NUM_THREADS", "1")
