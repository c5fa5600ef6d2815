"""The executor, in subpackages along the data flow:

- config: the run's settings as typed sections (job), the command line (cli), precision;
- models: the built-in transformers, `transformers` models, specs resolved to stages;
- optimizers: each optimizer's math (kfac, shampoo, soap, muon) and the stage optimizer (stage);
- pipeline: this rank's stages (build), the op interpreter, comm, the split backward, the
  training loop (loop);
- observe: the measured timeline, memory, metrics, fault injection;
- io: training data, checkpoints, the exported model.

`torchrun -m runtime PLAN`: __main__ (exit codes) -> config.cli (flags and validation) ->
pipeline.loop (build, then run the plan's ops step after step). `runtime.launch` starts that
from Python (the profiler's probe, the benchmarks). `runtime.train` is the
single-process reference trainer. Commands: `python -m runtime.prepare_data`,
`python -m runtime.evaluate`.

Imports no ortools, networkx or graphviz; reads plans only through pfcompile.formats.plan.load_plan.
Kept import-free so `python -m runtime` stays cheap.
"""
