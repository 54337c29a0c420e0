"""Timing that survives a noisy machine: warm-up, medians, and variants compared in alternation.

The rules (see the course's measuring conventions):

- discard the first calls (warm-up: lazy initialisation, allocator growth, caches, compilation);
- quote the median of many samples, not the mean (one hiccup of the OS does not move a median);
- compare variants in the same run, taking turns A B A B ..., so a slow minute hurts both equally;
- threads: one process alone gets as many torch threads as cores (`setup_threads()`); several ranks
  share the cores (ranks x threads <= cores).

    from course_lib.observability.timing import setup_threads, time_fn, time_alternating
    setup_threads()                                   # one process: as many threads as cores
    t = time_fn(lambda: a @ b, warmup=2, repeats=10)  # Timing; t.median in seconds
    ts = time_alternating({"sdpa": f, "explicit": g}, warmup=2, rounds=10)
    speedup = ts["explicit"].median / ts["sdpa"].median

    python -m course_lib.observability.timing      # prints the machine line and a 1024^3 matmul timed both ways
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from course_lib.core.checks import positive_int


@dataclass(frozen=True)
class Timing:
    """Wall-clock samples of one operation, in seconds, warm-up excluded."""

    samples: tuple[float, ...]

    def __post_init__(self):
        if not self.samples:
            raise ValueError("a Timing needs at least one sample")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        """(25th, 75th) percentile: how far the middle half of the samples spreads around the median."""
        if len(self.samples) < 2:
            return (self.samples[0], self.samples[0])
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return (q1, q3)

    @property
    def relative_spread(self) -> float:
        """Interquartile range / median: 0.05 means the middle half of the samples lies within ~5%."""
        q1, q3 = self.quartiles
        return (q3 - q1) / self.median


def _check_counts(warmup: int, repeats: int, repeats_name: str) -> None:
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"{repeats_name} must be an integer >= 1, got {repeats!r}")


def _timed_call(fn: Callable[[], object], clock: Callable[[], float], sync: Callable[[], None] | None) -> float:
    # On a GPU, kernels run asynchronously: without a sync the clock would stop at the launch.
    if sync is not None:
        sync()
    start = clock()
    fn()
    if sync is not None:
        sync()
    return clock() - start


def time_fn(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 10,
            clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None) -> Timing:
    """Call fn() `warmup` times untimed, then `repeats` times timed; returns the timed samples.

    sync: called before and after each timed call (torch.cuda.synchronize on a GPU; None on a CPU).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    _check_counts(warmup, repeats, "repeats")
    for _ in range(warmup):
        fn()
    return Timing(tuple(_timed_call(fn, clock, sync) for _ in range(repeats)))


def williams_orders(n: int) -> list[list[int]]:
    """Orders of range(n) in which each ordered pair (a, b), a != b, stands back to back equally often.

    Williams' design: the first order is 0, 1, n-1, 2, n-2, ...; order i adds i to each entry mod n.
    For even n the n orders hold each pair once; for odd n they are followed by their reverses (2n orders,
    each pair twice).
    """
    positive_int("n", n)
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(j + i) % n for j in first] for i in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


def time_alternating(fns: Mapping[str, Callable[[], object]], *, warmup: int = 2, rounds: int = 10,
                     clock: Callable[[], float] = time.perf_counter,
                     sync: Callable[[], None] | None = None, balanced: bool = False) -> dict[str, Timing]:
    """Time several variants taking turns: A B A B ... (`rounds` timed calls of each, after `warmup` rounds).

    Each variant sees the same stretches of machine load, so the ratio of two medians is a fair
    comparison even when the absolute times drift. Returns {name: Timing} in the order given.

    balanced=True changes the order from round to round so that every variant runs right after every
    other one equally often (the rows of a Williams design: for n variants, each block of n rounds, 2n when
    n is odd, holds each ordered pair once or twice back to back). Use it when the variants disturb each
    other: one that always ran right after a variant that flushes the caches or frees much memory would pay
    for it every round. Merely rotating which variant starts (A B C, B C A, ...) does not do that: B would
    still always follow A.
    """
    if not isinstance(fns, Mapping) or not fns:
        raise ValueError("fns must be a non-empty mapping {name: callable}")
    for name, fn in fns.items():
        if not callable(fn):
            raise TypeError(f"fns[{name!r}] must be callable, got {type(fn).__name__}")
    _check_counts(warmup, rounds, "rounds")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples = {name: [] for name in fns}
    names = list(fns)
    orders = williams_orders(len(names)) if balanced else [list(range(len(names)))]
    for i in range(rounds):
        for index in orders[i % len(orders)]:
            samples[names[index]].append(_timed_call(fns[names[index]], clock, sync))
    return {name: Timing(tuple(values)) for name, values in samples.items()}


def setup_threads(num_threads: int | None = None) -> int:
    """torch.set_num_threads(num_threads or the number of cores); returns the threads torch now uses.

    One process alone on the machine should use every core. Several processes (ranks) must share
    them: pass cores // ranks so that ranks x threads <= cores. With more busy threads than cores, the
    threads of one operator wait for each other at its end whenever one of them is descheduled, so a
    step made of many small operators slows down far more than its share of the CPU would suggest.
    """
    if num_threads is None:
        num_threads = os.cpu_count() or 1
    positive_int("num_threads", num_threads)
    torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else platform.processor(), else 'unknown CPU'."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info() -> dict:
    """What a reader needs next to any figure: CPU, cores, torch threads of this process, torch version.

    load_average is the 1-minute load average when the run started (None where the OS has none):
    above the number of cores, other processes compete for the CPUs and every figure suffers.
    """
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 1,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def machine_line(info: dict | None = None, setup: str | None = None) -> str:
    """One line such as 'AMD EPYC | 2 cores | 2 torch threads (one process) | torch 2.13.0+cpu | load 0.3'.

    setup replaces the threads part when the work is spread differently, e.g. '2 ranks x 1 thread'.
    """
    info = info or machine_info()
    threads = info["torch_threads"]
    setup = setup or f"{threads} torch thread{'s' * (threads != 1)} (one process)"
    parts = [info["cpu"], f"{info['cores']} cores", setup, f"torch {info['torch_version']}"]
    if info.get("cuda"):
        parts.append(f"GPU {info['cuda']}")
    load = info.get("load_average")
    if load is not None:
        busy = " (busy machine: figures are low and noisy)" if load > info["cores"] else ""
        parts.append(f"load {load:.1f}{busy}")
    return " | ".join(parts)


def main() -> None:
    setup_threads()
    print(machine_line())
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = time_fn(lambda: a @ b, warmup=2, repeats=10)
    print(f"{n}x{n} fp32 matmul: median {t.median * 1e3:.2f} ms "
          f"(middle half within {t.relative_spread:.0%}), {2 * n**3 / t.median / 1e9:.1f} GFLOP/s")
    both = time_alternating({"a @ b": lambda: a @ b, "b @ a": lambda: b @ a}, warmup=1, rounds=10)
    print("alternating: " + ", ".join(f"{k} {v.median * 1e3:.2f} ms" for k, v in both.items()))


if __name__ == "__main__":
    main()
