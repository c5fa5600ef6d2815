"""What a run reports while it trains (rank 0): a JSON-lines log, TensorBoard event files
when the `tensorboard` package is installed, and a live progress line (rich) on a terminal.

metrics.jsonl has one object per line:
    {"step": 12, "loss": 3.91, "lr": 0.1, "grad_norm": 0.84, "step_ms": 41.2, "refresh": true}
        after each training step: steps done (1-based), the step's loss, the K-FAC layers' learning
        rate it used (AdamW's without K-FAC), the global gradient norm before clipping and
        preconditioning, rank 0's wall time, and whether a refresh cycle started
    {"step": 20, "eval": true, "loss": 3.75, "perplexity": 42.5, "batches": 8}   per evaluation
A resumed run appends: for a step logged twice, the last line is the one that counts.

The log folder (log.dir, else a new run folder, `make_run_folder`) also gets train.toml,
the effective config (runtime.pipeline.loop), and summary.json, the run's summary: the object
`--json` prints.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time

from pfcompile.formats.jsonio import write_json

RUNS_DIR = "runs"  # without log.dir, a run's folder is made in here, in the current folder


def make_run_folder(root: str, name: str) -> str:
    """A new folder root/NAME-UTCTIME (YYYYMMDD-HHMMSS), as Lightning's lightning_logs/ and
    torchtitan's outputs/ give every run its own; a run started in the same second as
    another gets -2, -3, ..."""
    base = os.path.join(root, f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    os.makedirs(root, exist_ok=True)
    for n in itertools.count(1):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(path)  # atomic: of two runs, one makes it, the other takes the next suffix
            return path
        except FileExistsError:
            continue


class Metrics:
    def __init__(self, log_dir: str | None, total_steps: int, first_step: int, tokens_per_step: int):
        self.dir = log_dir
        self.total, self.first, self.tokens_per_step = total_steps, first_step, tokens_per_step
        self.file = None
        self.tb = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self.file = open(os.path.join(log_dir, "metrics.jsonl"), "a", buffering=1)
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package
                self.tb = SummaryWriter(os.path.join(log_dir, "tensorboard"))
            except ImportError:
                self.tb = None
        self.progress = self.task = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TextColumn("{task.fields[status]}"), TimeRemainingColumn(), transient=True)
            self.task = self.progress.add_task("train", total=total_steps, completed=first_step, status="")
            self.progress.start()
        self.t0 = time.perf_counter()
        self.last_loss = None

    def steps(self, rows: list[dict]) -> None:
        for row in rows:
            self._write(row)
            if self.tb:
                for key in ("loss", "lr", "grad_norm", "step_ms"):
                    self.tb.add_scalar(f"train/{key}", row[key], row["step"])
        if rows and self.progress:
            done = rows[-1]["step"]
            rate = (done - self.first) * self.tokens_per_step / max(1e-9, time.perf_counter() - self.t0)
            self.progress.update(self.task, completed=done,
                                 status=f"loss {rows[-1]['loss']:.4f}  {rate:,.0f} tokens/s")

    def evaluation(self, step: int, loss: float, batches: int) -> dict:
        row = {"step": step, "eval": True, "loss": loss, "perplexity": math.exp(min(loss, 700.0)), "batches": batches}
        self._write(row)
        if self.tb:
            self.tb.add_scalar("eval/loss", loss, step)
            self.tb.add_scalar("eval/perplexity", row["perplexity"], step)
        return row

    def summary(self, summary: dict) -> None:
        if self.dir:
            write_json(os.path.join(self.dir, "summary.json"), summary)

    def _write(self, row: dict) -> None:
        if self.file:
            self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.progress:
            self.progress.stop()
        if self.tb:
            self.tb.close()
        if self.file:
            self.file.close()
