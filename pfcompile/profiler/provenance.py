"""What a profile records about where and what it measured: the device's name, the
machine's load average, and the profiled model's shape."""

from __future__ import annotations

import os
import platform

import torch


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_json(model: str, cfg, micro_batch: int, seq_len: int, dtype: str) -> dict:
    return {"name": model, "kind": cfg.kind, "layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
            "ffn": cfg.ffn, "vocab": cfg.vocab, "seq_len": seq_len, "micro_batch": micro_batch, "dtype": dtype}
