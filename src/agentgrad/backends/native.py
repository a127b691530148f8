"""The compiled decode-step attention (`decode_attention.c`), built on first use and called through ctypes.

Built with the machine's C compiler (`$CC`, else `cc`) at `-O3 -march=native` into the user's cache
(`$XDG_CACHE_HOME/agentgrad/native`, else `~/.cache/agentgrad/native`), keyed by the source, the compiler and
the CPU's flags, so a home directory shared between machines never loads another CPU's build. It has no Python or
torch headers to compile against (a fraction of a second). Where no compiler works, or with
`rollout.native_attention=false`, decoding keeps torch's ops: the same numbers up to float rounding
(tests/unit/test_native_attention.py compares them).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared")
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the kernel's stack buffers (decode_attention.c)


def _cpu_signature() -> str:
    """What the compiled code depends on beyond the source: the CPU's instruction set."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "agentgrad" / "native"


def _build() -> Path:
    """The shared library's path, compiling it unless this source, compiler and CPU already have one."""
    compiler = shlex.split(os.environ.get("CC", "cc"))
    if not compiler or shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C compiler ({' '.join(compiler) or '$CC'} not found)")
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(compiler + list(FLAGS)),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(compiler)} failed: {proc.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


@cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The compiled `decode_attention`, or None (logged once) when it cannot be built or loaded here."""
    try:
        path = _build()
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native decode attention unavailable, decoding with torch ops: %s", exc)
        return None
    log.debug("native decode attention: %s", path)
    fn = lib.decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
    return fn


def supports(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel handles a model of this shape and placement (fp32 on CPU, the buffers it has)."""
    return (device.type == "cpu" and dtype == torch.float32 and heads % kv_heads == 0
            and heads // kv_heads <= MAX_GROUP and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM)


def decode_attention(fn, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                     scratch: torch.Tensor, src: torch.Tensor | None = None,
                     shared: torch.Tensor | None = None) -> torch.Tensor:
    """One layer for N tokens, in order: their projections qkv (N, (heads + 2 kv_heads) d), RoPE rows by
    position from cos, sin (P, d); each token's key and value written at `positions` (N,) of cache slots `slots`
    (N,) in k_cache, v_cache (S, kv_heads, C, d), and its queries attending over positions 0..position of its
    slot. Positions below shared[n] (N,) are read from slot src[n] (N,), which must hold the same keys and values
    there (None: every token reads its own slot). (N, heads*d)."""
    N = qkv.shape[0]
    _, kv_heads, capacity, d = k_cache.shape
    qkv, slots, positions = qkv.contiguous(), slots.contiguous(), positions.contiguous()
    if src is None or shared is None:
        src, shared = slots, torch.zeros_like(slots)
    src, shared = src.contiguous(), shared.contiguous()
    out = qkv.new_empty((N, heads * d))
    rc = fn(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), positions.data_ptr(),
            src.data_ptr(), shared.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), N, heads,
            kv_heads, d, capacity, scratch.data_ptr())
    if rc != 0:
        raise ValueError(f"decode_attention: unsupported shape (heads {heads}, kv heads {kv_heads}, head dim {d})")
    return out
