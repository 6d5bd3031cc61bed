"""Whether a process is running or stuck, from the CPU time Linux counts for it.

In: process ids. Out: ``CpuProgress(pids)`` reads each one's user plus system CPU seconds
(/proc/<pid>/stat) when made; ``ran(pids)`` says whether any of them has used a core for at
least ``CPU_PROGRESS`` seconds since the last reading (and reads again). A stopped, sleeping or
swapped-out process uses none; a worker starting JAX and compiling uses one. Where /proc cannot
tell (another OS, a process gone), nothing counts as having run.
"""

from __future__ import annotations

import os

CPU_PROGRESS = 0.05  # seconds of CPU a process must have used since the last reading
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int):
    """User plus system CPU seconds of process ``pid`` so far, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


class CpuProgress:
    """The CPU seconds of some processes as last read (module docstring)."""

    def __init__(self, pids):
        self.seen = {p: cpu_seconds(p) for p in pids}

    def ran(self, pids) -> bool:
        ran = False
        for p in pids:
            now, before = cpu_seconds(p), self.seen.get(p)
            if now is not None and before is not None and now - before >= CPU_PROGRESS:
                ran = True
            self.seen[p] = now
        return ran
