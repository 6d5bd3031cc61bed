"""Report the user's line, not autopar's, as the source of a traced operation. In: nothing.
Out: ``hide_autopar_frames()``, which registers autopar's folder with JAX's traceback filter,
once per process (JAX keeps that list; it is the one piece of global state autopar touches).

Called by whatever traces JAX code: the tracer (``autopar.trace``: ``ap.shard`` and friends)
and a worker's whole-step or pipeline-stage executable (``runtime.native_step.Tracer``), whose
HLO would otherwise name the worker's own frames (the forkserver, the loader) in its
metadata."""

import functools
import os


@functools.cache
def hide_autopar_frames() -> None:
    from jax._src import source_info_util

    source_info_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))
