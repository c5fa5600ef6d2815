"""Upper bounds on what pfcompile reads and plans, checked before any work.

Each bound is far above any real pipeline and far below what would exhaust a machine:
without them a typo (`--micro-batches 1000000000000`) or a hostile file makes the planner
or the runtime allocate without end instead of failing at once.
"""

from __future__ import annotations

# JSON files: the deepest object pfcompile writes is 5 levels; integers are sizes and
# indices (bytes fit in 20 digits). Python's own JSON reader overflows its stack near
# 1,000 levels and refuses integers over 4,300 digits with a traceback.
MAX_JSON_DEPTH = 64
MAX_JSON_INT_DIGITS = 20
MAX_JSON_BYTES = 1 << 30

# A pipeline: stages are devices (and model chunks), micro-batches are the step's split of
# the batch. Each bound keeps the task graph (ops per refresh cycle) within MAX_TASKS.
MAX_STAGES = 512            # devices per pipeline
MAX_VIRTUAL_STAGES = 64     # model chunks per device (interleaved)
MAX_REPLICAS = 256          # copies of each stage
MAX_WORLD_SIZE = 4096       # ranks of one plan
MAX_MICRO_BATCHES = 16384   # micro-batches per step, all replicas together
# Steps of one refresh cycle: the greedy needs k >= K-FAC work / bubble per step, and the
# plan lists every step's ops k times, so a pipeline with almost no bubble (gpipe, 2 stages,
# 256 micro-batches of bert-tiny needs k = 129: 272,000 ops) takes minutes to plan.
MAX_REFRESH_STEPS = 64
# The planners hold every op of the cycle as Python objects (task graph, orders, replay
# state), about 2.5 kB per op, so a million ops is about 2.5 GB, the most a planning host
# is assumed to spare. A plan file lists as many ops.
MAX_TASKS = 1_000_000

# Predicted times: a cycle longer than a day is a corrupt number, not a schedule; so is a
# profile's op (or message, or overhead) timed at more than a day.
MAX_TIME_MS = 86_400_000.0
# A profile's sizes: an exbibyte is far beyond any device's memory, far below what the
# reader's 20-digit integers allow (2**64 and up).
MAX_BYTES = 1 << 60
