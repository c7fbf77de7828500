"""What this host computes per second, timed when asked (`eagle3pipe plan`), and a duration in
words: the oracle's time is its FLOP count (eagle3pipe.estimates.figures.oracle_flop) at this
rate."""
from __future__ import annotations

import time

MATMUL_N = 1024  # the side of the matrices float32_flops multiplies


def float32_flops(n: int = MATMUL_N, at_least_s: float = 0.3) -> float:
    """This host's float32 matmul rate (FLOP/s) at torch's thread count: n x n matrices
    multiplied for at least `at_least_s`, the fastest call counted (the first calls pay for
    the threads' and the clock's ramp-up): what the transformers oracle's layers run at."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < at_least_s:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def about(seconds: float) -> str:
    """'40 s', '12 min', '3.4 h', '2.1 days'."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.2g} {unit}" if seconds < 10 * size else \
                f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"
