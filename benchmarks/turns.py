"""Calls of several steps timed in turns (step_time.py, plan_truth.py).

In: name -> a function making one call, and the number of rounds. Out: per name, each round's
median seconds per call. Each round every call takes a turn, the rounds starting one name later
each time (so the machine's drift reaches them alike and none always runs first); a turn is one
untimed call, then back-to-back calls for about ``BLOCK_SECONDS`` (at least one), of which the
median counts. Steps alternated call by call run cold: the small GPT's ran 2x slower on both
runtimes that way, where a training loop runs its step back to back.
"""
import time

import numpy as np

BLOCK_SECONDS = 0.1    # a turn of one call in ``timed``: back-to-back calls for about this long


def timed(calls: dict, iters) -> dict:
    """Per name of ``calls`` (name -> function), its median seconds per call in each of
    ``iters`` rounds (the module docstring)."""
    took = {}
    for name, call in calls.items():
        for _ in range(2):
            call()
        t = time.perf_counter()
        call()
        took[name] = time.perf_counter() - t
    names, times = list(calls), {name: [] for name in calls}
    for i in range(iters):
        for name in names[i % len(names):] + names[:i % len(names)]:
            calls[name]()
            block = []
            for _ in range(max(1, round(BLOCK_SECONDS / took[name]))):
                t = time.perf_counter()
                calls[name]()
                block.append(time.perf_counter() - t)
            times[name].append(float(np.median(block)))
    return {name: np.array(t) for name, t in times.items()}
