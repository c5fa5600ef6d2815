"""The profile's settings turned into torch objects, each bad one a one-line input error:
the dtype names, the seed, the device, the model spec; and a guard that turns an op torch
lacks for the chosen dtype and device into such an error too."""

from __future__ import annotations

import torch

from pfcompile.formats.errors import InputError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SEED = 0


def check_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise InputError("--device", None, f"not a device: {name!r} (use cpu or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise InputError("--device", None, f"{name} is not available: no CUDA device on this machine "
                                               f"(torch {torch.__version__}, {build})")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise InputError("--device", None, f"{name} is not available: this machine has "
                                               f"{torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise InputError("--device", None, f"unsupported device {name!r} (use cpu or cuda:N)")
    return device


def resolve_spec(model: str, seq_len: int):
    from runtime.models import ModelSpecError, resolve_model

    try:
        spec = resolve_model(model, seq_len=seq_len)
    except ModelSpecError as e:
        raise InputError("--model", None, str(e)) from None
    if seq_len > spec.cfg.max_seq_len:
        raise InputError("--seq-len", None, f"{seq_len} exceeds {model}'s maximum sequence length {spec.cfg.max_seq_len}")
    return spec


def guard_unsupported_op(dtype: str, device: torch.device, fn):
    """Run a measurement; an op torch lacks for this dtype/device is a one-line input error."""
    try:
        return fn()
    except NotImplementedError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError("--dtype", None, f"{dtype} on {device.type}: the runtime uses an op torch does not "
                                          f"implement there ({first})") from None
