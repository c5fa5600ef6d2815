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


def save(root: str | os.PathLike, step: int, rank: int, world_size: int, state: dict) -> None:
    root = Path(root)
    target = _rank_file(root, step, rank)
    with atomic_file(target) as f:
        torch.save(state, f)
    _prune(root, rank, world_size)


def _prune(root: Path, rank: int, world_size: int) -> None:
    done = complete_steps(root, world_size)
    if not done:
        return
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and int(m.group(1)) < done[-1]:
            try:
                (d / f"rank-{rank}.pt").unlink()
            except FileNotFoundError:
                pass
            try:
                d.rmdir()  # the last rank to prune removes the directory
            except OSError:
                pass


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
