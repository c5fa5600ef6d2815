"""The executor: models and stages (models), data (data), K-FAC math (kfac), the optimizer
(optim), the single-process reference trainer (train) and the plan interpreter.

`torchrun -m runtime PLAN`: __main__ (exit codes) -> config (flags; validation of flags,
config, plan, model and data against the job; train_config: the TOML training config) ->
build (this rank's stages, the update with clipping) -> loop (the training loop:
interpreter, comm, checkpoint, metrics, export, measure; faults holds the test fault
injection). Commands: `python -m runtime.prepare_data`, `python -m runtime.evaluate`.

Imports no ortools, networkx or graphviz; reads plans only through pfcompile.formats.plan.load_plan.
Kept import-free so `python -m runtime` and `import runtime.models` stay cheap.
"""
