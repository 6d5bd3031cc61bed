"""One native worker step's peak memory, as the planned memory is checked against it.

In: a worker's counters (``WorkerState.stats``: ``measure`` says whether to measure) around a
step (``PeakMeter``), or a call on every rank (``measure_memory``) that turns measuring on.
Out: ``stats['step_peak_bytes']``, the step's peak resident bytes above its start plus its
argument blocks; read from /proc/self/status (VmRSS, VmHWM; the peak reset through
/proc/self/clear_refs).
"""

from __future__ import annotations

import gc
import time


def _memory():
    """(resident KB, peak resident KB) of this process."""
    with open("/proc/self/status") as f:
        status = f.read()
    return tuple(int(status.split(key)[1].split()[0]) for key in ("VmRSS:", "VmHWM:"))


def measure_memory(comm) -> bool:
    """From the next step on, measure each step's peak memory (``stats()['step_peak_bytes']``;
    a measured step first waits for the memory still being freed, ``PeakMeter``). False
    where /proc/self/clear_refs cannot reset the peak. For tests and benchmarks, whose workers
    start with ``MALLOC_MMAP_THRESHOLD_=65536`` in their environment: malloc then gives every
    allocation of 64 KB or more its own mapping and returns it when freed, so the resident size
    follows what is live (without it the workers keep freed memory for reuse,
    ``worker.tune_malloc``)."""
    from .native_backend import WORKER

    WORKER.stats["measure"] = _reset_peak()
    return WORKER.stats["measure"]


class PeakMeter:
    """One step's peak memory: resident bytes above the level at the step's start, plus the
    arguments (resident before it starts).

    What the previous step left is released late: a numpy array XLA read in place is
    released only when jaxlib next collects its deferred references (at its next execution,
    or a garbage collection), and XLA's CPU client frees its own buffers on one of its
    threads. When measuring, the start therefore collects (``gc.collect(0)`` runs jaxlib's
    callback) and waits until the resident size stops falling (at most ``SETTLE`` seconds), so
    the level holds only what the step starts with."""

    SETTLE = 0.05

    def __init__(self, stats: dict):
        self.stats, self.on = stats, stats["measure"]
        if self.on:
            gc.collect(0)
            last, t0, steady = _memory()[0], time.monotonic(), 0
            while steady < 3 and time.monotonic() - t0 < self.SETTLE:
                time.sleep(5e-4)
                now = _memory()[0]
                steady = steady + 1 if now >= last else 0
                last = min(last, now)
            _reset_peak()
            self.base = _memory()[0]

    def stop(self, input_bytes: int) -> None:
        if self.on:
            self.stats["step_peak_bytes"] = (_memory()[1] - self.base) * 1024 + input_bytes


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM (Linux >= 4.0)
            f.write("5")
        return True
    except OSError:
        return False
