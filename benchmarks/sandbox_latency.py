"""Latency of a trivial sandboxed call (`print(1)`): p50/p99 over N runs through a warm SandboxPool.

    .venv/bin/python benchmarks/sandbox_latency.py [--runs 1000] [--isolation auto] [--no-private-proc]
"""

from __future__ import annotations

import argparse
import statistics
import time

from agentgrad.tools.sandbox import SandboxConfig, SandboxPool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--isolation", default="auto", choices=["auto", "namespaces", "userns", "rlimits"])
    ap.add_argument("--no-private-proc", action="store_true")
    ap.add_argument("--code", default="print(1)")
    args = ap.parse_args()
    config = SandboxConfig(timeout_s=5.0, isolation=args.isolation, private_proc=not args.no_private_proc)
    with SandboxPool(config, size=1) as pool:
        t0 = time.perf_counter()
        pool.warmup()
        start_s = time.perf_counter() - t0
        caps = pool.capabilities()
        for _ in range(10):  # warm the page cache and the server
            pool.run(args.code)
        lat, inner = [], []
        for _ in range(args.runs):
            t = time.perf_counter()
            r = pool.run(args.code)
            lat.append(time.perf_counter() - t)
            inner.append(r.duration_s)
            assert r.ok and r.stdout == "1\n" or args.code != "print(1)", r
    lat.sort()
    inner.sort()
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3  # noqa: E731
    print(f"isolation: mode={caps['mode']} net={caps['network_isolated']} ipc={caps['ipc_isolated']} "
          f"fs={caps['filesystem_isolated']} (allow-list) pidns={caps['pid_namespace']} proc={caps['proc']!r} "
          f"seccomp={caps['syscall_filter']} ({caps['privileges']})")
    print(f"server start-up: {start_s * 1e3:.1f} ms")
    print(f"{args.runs} x {args.code!r}: p50 {q(lat, 0.5):.2f} ms  p99 {q(lat, 0.99):.2f} ms  "
          f"mean {statistics.fmean(lat) * 1e3:.2f} ms  (in-server p50 {q(inner, 0.5):.2f} ms)")


if __name__ == "__main__":
    main()
