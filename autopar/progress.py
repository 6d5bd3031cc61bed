"""Logging and progress: the ``autopar`` logger and a progress display for long phases.

In: messages from long phases (a strategy search, starting the workers). Out: records of the
standard ``logging`` logger ``autopar`` (configure it as any other: ``logging.basicConfig(
level=logging.INFO)`` shows the compile phases) and, while stderr is a terminal, a one-line bar
redrawn in place once a phase has run for ``after`` seconds, and every ``TICK`` seconds after
that by a timer while the phase runs, message or not (a solver that reports rarely does not
freeze the clock). Nothing is drawn when stderr is not a terminal (a log file, CI, a
notebook's captured stream): the messages go to the logger only.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

logger = logging.getLogger("autopar")

WIDTH = 24
TICK = 0.5  # seconds between the timer's redraws


class Progress:
    """``progress(message)`` reports; ``close()`` ends the line. ``total``: the seconds the
    phase may take (the bar fills with the time used), or None (the bar shows the time only)."""

    def __init__(
        self, label: str, total=None, enabled: bool = True, after: float = 1.0, stream=None
    ):
        self.label, self.total, self.enabled, self.after = label, total, enabled, after
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.monotonic()
        self.drawn = False
        self.message = ""
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._timer = None
        if self.bar:
            self._timer = threading.Thread(target=self._tick, daemon=True, name="autopar-progress")
            self._timer.start()

    def _tick(self) -> None:
        while not self._done.wait(TICK):
            self._draw()

    @property
    def bar(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return self.enabled and bool(isatty and isatty())

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - self.start
        logger.info("%s %.1fs: %s", self.label, elapsed, message)
        self.message = message
        if self.bar:
            self._draw()

    def _draw(self) -> None:
        with self._lock:
            elapsed = time.monotonic() - self.start
            if self._done.is_set() or elapsed < self.after:
                return
            if self.total:
                k = min(WIDTH, int(WIDTH * elapsed / self.total))
                gauge = f"[{'#' * k}{'.' * (WIDTH - k)}] {elapsed:5.1f}/{self.total:.0f}s"
            else:
                gauge = f"{elapsed:5.1f}s"
            self.stream.write(f"\r{self.label} {gauge} {self.message[:70]:<70}")
            self.stream.flush()
            self.drawn = True

    def close(self) -> None:
        self._done.set()
        if self._timer is not None:
            self._timer.join()
        with self._lock:
            if self.drawn:
                self.stream.write("\n")
                self.stream.flush()
                self.drawn = False
