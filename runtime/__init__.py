"""The executor: models and stages (models), data (data), K-FAC math (kfac), the optimizer
(optim), the single-process reference trainer (train) and the plan interpreter.

`torchrun -m runtime PLAN`: __main__ (exit codes) -> config (the flags, shorthands for
job_config's keys; validation of the config, plan, model and data against the job;
job_config: the run's settings as typed sections) -> build (this rank's stages, the update
with clipping) -> loop (the training loop, given the job:
interpreter, comm, checkpoint, metrics, export, measure; faults holds the test fault
injection). Commands: `python -m runtime.prepare_data`, `python -m runtime.evaluate`.

Imports no ortools, networkx or graphviz; reads plans only through pfcompile.formats.plan.load_plan.
Kept import-free so `python -m runtime` and `import runtime.models` stay cheap.
"""
