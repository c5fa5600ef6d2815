"""What a run reads and writes: training data (data), per-rank checkpoints (checkpoint), the
trained model as one file (export)."""
