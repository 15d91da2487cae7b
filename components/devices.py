"""The device a step runs on: `--device` checked (auto, cpu, cuda, cuda:N) and resolved against
the GPUs this machine shows."""

from __future__ import annotations

import os
from pathlib import Path

from components.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def check_device_name(device: str) -> None:
    if device in DEVICES or (device.startswith("cuda:") and device[5:].isdigit()):
        return
    hint = " (did you mean cuda?)" if device.lower() in ("gpu", "nvidia", "cuda0") else ""
    raise ConfigError(f"--device {device!r}: must be auto, cpu, cuda or cuda:N{hint}")


def check_cuda_present(device: str) -> None:
    """A cuda device asked for on a machine that shows no NVIDIA GPU: a ConfigError, found without
    importing torch or initialising CUDA (resolve_device asks torch later)."""
    check_device_name(device)
    if not device.startswith("cuda"):
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = visible is not None and visible.strip() in ("", "-1")
    if hidden or not (Path("/dev/nvidiactl").exists() or any(Path("/proc/driver/nvidia/gpus").glob("*"))):
        why = f"CUDA_VISIBLE_DEVICES={visible!r}" if hidden else "no NVIDIA driver device in /dev"
        raise ConfigError(f"--device {device}: no CUDA GPU is visible ({why}); use --device cpu or auto")


def resolve_device(device: str) -> str:
    """auto -> cuda if there is one, else cpu; cuda without a GPU is a ConfigError."""
    check_device_name(device)
    if device == "cpu":
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is visible to torch {torch.__version__} "
                          f"(CUDA build: {torch.version.cuda or 'no'}); use --device cpu or auto")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible")
    return device
