"""Watching a run: the measured timeline (measure), peak memory (memory), the training log
(metrics), and fault injection for tests (faults)."""
