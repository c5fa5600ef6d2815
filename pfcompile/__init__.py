"""pfcompile: a profiling-driven schedule compiler for pipeline-parallel K-FAC training.

The data flow is one direction, one file format at each arrow:
model spec --profile--> profile JSON --plan--> plan JSON --torchrun -m runtime--> trained model.
Planning, rendering and inspecting import no torch; only the profiler does.
"""

__version__ = "0.1.0"
