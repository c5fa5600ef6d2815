"""Shared test set-up, kept minimal: the suite may share a small CPU with other jobs."""

import os

# One intra-op thread per test process: numbers do not depend on the machine's core count
# and parallel test jobs do not oversubscribe the CPU.
os.environ.setdefault("OMP_NUM_THREADS", "1")


import subprocess  # noqa: E402

import pytest  # noqa: E402

# The fast tier's promise, enforced: a test that starts a process, in its body or in a
# fixture it sets up, must be marked e2e (`make test-fast` runs `-m "not e2e"`), so the
# tiers cannot drift apart unnoticed.
_running: list = []
_popen_init = subprocess.Popen.__init__


def _popen_in_e2e_only(self, *args, **kwargs):
    item = _running[-1] if _running else None
    if item is not None and item.get_closest_marker("e2e") is None:
        cmd = args[0] if args else kwargs.get("args")
        raise AssertionError(f"{item.nodeid} starts a process ({cmd!r}): mark it @pytest.mark.e2e")
    _popen_init(self, *args, **kwargs)


subprocess.Popen.__init__ = _popen_in_e2e_only


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


@pytest.fixture(scope="session")
def ops_only_tiny(tmp_path_factory):
    """The committed bert-tiny profile without its runtime overheads (`runtime`: 0), for tests
    that need a plan shaped by the ops alone: the runtime work per step the profile records
    fills most of a 4-stage Chimera's bubble on bert-tiny, and its K-FAC work would then need
    a refresh cycle over the planner's limit."""
    from pathlib import Path

    from pfcompile.formats.profile import RuntimeOverheads, load_profile
    from pfcompile.profiler.optimizer_layers import estimated_optimizer_ms

    prof = load_profile(str(Path(__file__).resolve().parents[1] / "profiles" / "bert-tiny-cpu.json"))
    prof.runtime = RuntimeOverheads()
    for layer in prof.covered_layers:  # Shampoo's and Muon's ops at a CPU's GEMM rate (20 GFLOP/s): to plan them
        for opt in ("shampoo", "muon"):
            layer.optimizer_ms.setdefault(opt, estimated_optimizer_ms(opt, layer.in_features, layer.out_features, 2e7))
    path = tmp_path_factory.mktemp("profiles") / "bert-tiny-ops-only.json"
    prof.save(str(path))
    return path
