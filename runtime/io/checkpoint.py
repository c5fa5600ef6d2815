"""Per-rank checkpoints: a rank's stages (parameters, optimizer, K-FAC state), the next
step and the RNG state, so a restarted job continues exactly where it stopped.

Layout: DIR/step-00000012/rank-3.pt. A checkpoint of step t is *complete* when every rank
has written its file; files appear atomically (torch.save to a temporary file, then
os.replace), so a rank killed mid-write leaves no half file and resume takes the last
complete step. A rank deletes its own older files only once a newer checkpoint is
complete, so there is always one to return to. Loading uses weights_only=True: a
checkpoint holds tensors, numbers and strings, never pickled code.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch

from pfcompile.formats.jsonio import atomic_file

_STEP_DIR = re.compile(r"^step-(\d{8})$")


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _rank_file(root: Path, step: int, rank: int) -> Path:
    return _step_dir(root, step) / f"rank-{rank}.pt"


def complete_steps(root: str | os.PathLike, world_size: int) -> list[int]:
    """Steps for which every rank's file exists, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and all((d / f"rank-{q}.pt").is_file() for q in range(world_size)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def save(root: str | os.PathLike, step: int, rank: int, world_size: int, state: dict, keep: int = 1) -> None:
    root = Path(root)
    target = _rank_file(root, step, rank)
    with atomic_file(target) as f:
        torch.save(state, f)
    prune(root, rank, world_size, keep)


def prune(root: str | os.PathLike, rank: int, world_size: int, keep: int = 1) -> None:
    """Delete this rank's files of steps older than the `keep`-th newest complete checkpoint
    (newer, still incomplete ones stay: they may become the next complete one). Called after
    each save and once more at the end of the run, when every rank has saved: the faster
    rank's previous file is pruned then, not left behind."""
    root = Path(root)
    done = complete_steps(root, world_size)
    if not done:
        return
    oldest_kept = done[-keep] if len(done) >= keep else done[0]
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and int(m.group(1)) < oldest_kept:
            try:
                (d / f"rank-{rank}.pt").unlink()
            except FileNotFoundError:
                pass
            try:
                d.rmdir()  # the last rank to prune removes the directory
            except OSError:
                pass


def clean_temporary(root: str | os.PathLike, rank: int) -> int:
    """Remove this rank's orphaned temporary files (a rank killed while writing leaves one:
    atomic_file's `.rank-Q.pt.XXXX.tmp`); called on start, before any rank writes. -> count."""
    root = Path(root)
    if not root.is_dir():
        return 0
    n = 0
    for d in root.iterdir():
        if _STEP_DIR.match(d.name) and d.is_dir():
            for f in d.glob(f".rank-{rank}.pt.*.tmp"):
                try:
                    f.unlink()
                    n += 1
                except FileNotFoundError:
                    pass
    return n


def load(root: str | os.PathLike, step: int, rank: int, map_location=None) -> dict:
    return torch.load(_rank_file(Path(root), step, rank), map_location=map_location, weights_only=True)


def capture_rng() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --- what a rank saves: its stages --------------------------------------------------------------
def stage_state(sr) -> dict:
    """One stage replica's parameters, optimizer and its optimizer layers' state (K-FAC,
    Shampoo, Muon). Mid-cycle K-FAC layers may also hold captures a later step's curv op will
    fold in (kept_captures)."""
    return {"params": sr.module.state_dict(), "optimizer": sr.optimizer.state_dict(),
            "layers": {layer.name: layer.state_dict() for layer in sr.layers.values()},
            "kept": {layer.name: layer.kept_captures() for layer in sr.layers.values()
                     if hasattr(layer, "kept_captures")}}


def load_stage_state(sr, state: dict) -> None:
    sr.module.load_state_dict(state["params"])
    sr.optimizer.load_state_dict(state["optimizer"])
    for layer in sr.layers.values():
        layer.load_state_dict(state["layers"][layer.name])
        if hasattr(layer, "load_kept_captures"):
            layer.load_kept_captures(state["kept"][layer.name])


def save_rank(root: str | os.PathLike, step: int, world, stages: dict, keep: int = 1) -> None:
    """This rank's checkpoint of the state after `step` steps: its stages and the RNG."""
    save(root, step, world.rank, world.world_size, {
        "step": step, "rng": capture_rng(),
        "stages": {s: stage_state(sr) for s, sr in stages.items()}}, keep)


def resume(root: str, world, stages: dict) -> int:
    """Load the last checkpoint complete on ALL ranks (agreed by an all-reduce MIN); returns
    its step (0: none, start from scratch). A checkpoint of another plan, or a damaged one,
    is an InputError naming the file."""
    import torch.distributed as dist

    from pfcompile.formats.errors import InputError
    from runtime.pipeline.comm import all_reduce

    done = complete_steps(root, world.world_size)
    latest = torch.tensor([done[-1] if done else 0], dtype=torch.int64, device=world.device)
    # ranks may see the folder at different moments
    all_reduce(latest, "agreeing on the checkpoint to resume", world.timeout, op=dist.ReduceOp.MIN)
    step = int(latest)
    if step == 0:
        return 0
    try:
        state = load(root, step, world.rank, map_location=world.device)
        for s, sr in stages.items():
            load_stage_state(sr, state["stages"][s])
        restore_rng(state["rng"])
    except (KeyError, RuntimeError, ValueError, OSError, TypeError, AttributeError, IndexError, EOFError,
            pickle.UnpicklingError) as e:  # a foreign, damaged or pickled-code file: one line, no traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(str(_rank_file(Path(root), step, world.rank)), None,
                         f"cannot resume this plan from it ({type(e).__name__}: {first})") from None
    if world.rank == 0:
        print(f"runtime: resumed from {root} at step {step}", flush=True)
    return step
