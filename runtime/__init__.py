"""The executor: models and stages (models), data (data), K-FAC math (kfac), the optimizer
(optim), the single-process reference trainer (train) and the plan interpreter.

`torchrun -m runtime PLAN`: __main__ (exit codes) -> config (flags; validation of flags,
plan and model against the job) -> build (this rank's stages) -> loop (the training loop:
interpreter, comm, checkpoint, measure; faults holds the test fault injection).

Imports no ortools, networkx or graphviz; reads plans only through pfcompile.formats.plan.load_plan.
Kept import-free so `python -m runtime` and `import runtime.models` stay cheap.
"""
