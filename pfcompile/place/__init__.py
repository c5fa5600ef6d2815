"""Placement: greedy first-fit, list scheduler, CP-SAT model and its decomposition, bounds.

`build_plan` is the stage's entry point (profile + configuration -> replayed plan)."""
