"""The learner's compute dtype (`model.compute_dtype`): bf16 autocast over fp32 master weights, where the CPU
computes bf16 natively.

On a CPU with avx512_bf16 or AMX (amx_bf16) oneDNN runs bf16 matmuls 5-9x faster than fp32 at training shapes
(docs/benchmarks.md); elsewhere bf16 is emulated and slower than fp32, so `auto` keeps fp32 there and says why.
Only the learner's forward (and so its backward) runs under autocast: weights, gradients and optimizer state
stay fp32, and logits are scored in fp32 (`scoring.tempered`). Sampling stays fp32, so an RL run's sampler and
learner logprobs differ by the bf16 rounding (docs/learning.md "bf16").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The feature flags of the first CPU in /proc/cpuinfo; empty where there is none (macOS, Windows)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_has_bf16(flags: set[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in BF16_CPU_FLAGS)


@dataclass(frozen=True)
class ComputeDtype:
    """What `model.compute_dtype` resolved to: `dtype` None means plain fp32; `note` says why, for the log."""

    dtype: torch.dtype | None
    device_type: str
    note: str

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield


FP32 = ComputeDtype(None, "cpu", "learner computes in fp32")


def resolve_compute_dtype(choice: str, device: str, flags: set[str] | None = None) -> ComputeDtype:
    """`choice` is fp32, bf16 or auto. auto picks bf16 on a CUDA device that supports it and on a CPU with
    avx512_bf16 or amx_bf16, fp32 elsewhere; bf16 is honoured everywhere (with a note where it is emulated)."""
    device_type = torch.device(device).type
    if choice == "fp32":
        return FP32
    if device_type == "cuda":
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        where = "this GPU"
    else:
        native = cpu_has_bf16(flags)
        where = f"this CPU ({' or '.join(BF16_CPU_FLAGS)})"
    if native:
        return ComputeDtype(torch.bfloat16, device_type, f"learner computes in bf16 (autocast, fp32 master "
                                                         f"weights): {where} has bf16 arithmetic")
    if choice == "auto":
        return ComputeDtype(None, device_type, f"model.compute_dtype=auto: learner computes in fp32: {where} "
                                               f"has no bf16 arithmetic")
    return ComputeDtype(torch.bfloat16, device_type, f"warning: model.compute_dtype=bf16 but {where} lacks bf16 "
                                                     f"arithmetic: bf16 is emulated and likely slower than fp32")
