"""Independent checks of a plan: the replay (timing simulator and validity check, written
from the plan semantics alone) and the dependency rules it and the renderer share."""
