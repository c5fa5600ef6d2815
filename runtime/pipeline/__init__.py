"""Executing a plan: this rank's stages (build), the op interpreter (interpreter), messages and
collectives (comm), the split backward (split_backward), core pinning (affinity) and the
training loop (loop)."""
