"""The executor: models and stages (models), data (data), K-FAC math (kfac), the optimizer
(optim), the single-process reference trainer (train) and the plan interpreter.

Imports no ortools, networkx or graphviz; reads plans only through pfcompile.formats.plan.load_plan.
Kept import-free so `python -m runtime` and `import runtime.models` stay cheap.
"""
