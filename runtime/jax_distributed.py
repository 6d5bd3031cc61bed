"""JAX's multi-process runtime for autopar: start it, agree across processes, move host data.

In: the coordinator address, the process count and this process's id, as arguments, or from
the environment ``autopar launch`` sets (``AUTOPAR_COORDINATOR``, ``AUTOPAR_NUM_PROCESSES``,
``AUTOPAR_PROCESS_ID``, ``AUTOPAR_DEVICES_PER_PROCESS``, ``AUTOPAR_LOCAL_RANK``: the launcher's
protocol, as torchrun's ``RANK``/``WORLD_SIZE``), or else from JAX's own cluster detection
(SLURM, Open MPI, Kubernetes, Cloud TPU).
Out: an initialised ``jax.distributed`` runtime (on CPU: gloo collectives, ``K`` host devices
per process) and the helpers the jax backend runs
on under it, each called by every process in the same order:
- ``broadcast_text``: process 0's string, on every process;
- ``check_same``: every process's digest (or its failure) compared; ConfigError on a mismatch;
- ``place``: a global host array (or this process's slice of the batch) -> a global jax.Array;
- ``fetch``: a global jax.Array -> the whole value as a numpy array, on every process;
- ``move``: a stack of blocks, one per device, onto the same number of other devices (a
  pipeline's transfer between stages: a ``ppermute`` over both stages' devices, as JAX's CPU
  runtime moves nothing between processes with ``device_put``).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.errors import ConfigError

ENV = (
    "AUTOPAR_COORDINATOR",
    "AUTOPAR_NUM_PROCESSES",
    "AUTOPAR_PROCESS_ID",
    "AUTOPAR_DEVICES_PER_PROCESS",
    "AUTOPAR_LOCAL_RANK",
)


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} must be an integer (autopar launch sets it).") from None


def init_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    devices_per_process: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    timeout: int = 300,
) -> None:
    """Start JAX's multi-process runtime for this process (``jax.distributed.initialize``),
    before any JAX computation. Arguments left out come from ``autopar launch``'s environment,
    else from JAX's cluster detection. ``devices_per_process``: on CPU, that many host
    devices in this process (``--xla_force_host_platform_device_count``); on GPUs, this
    process's devices are ``local_rank * K .. local_rank * K + K - 1`` unless
    ``local_device_ids`` names them. ``timeout``: seconds to wait for every process to join.
    Calling it again with the same arguments does nothing."""
    coordinator_address = coordinator_address or os.environ.get("AUTOPAR_COORDINATOR")
    num_processes = (
        num_processes if num_processes is not None else _env_int("AUTOPAR_NUM_PROCESSES")
    )
    process_id = process_id if process_id is not None else _env_int("AUTOPAR_PROCESS_ID")
    k = (
        devices_per_process
        if devices_per_process is not None
        else _env_int("AUTOPAR_DEVICES_PER_PROCESS")
    )
    if jax.distributed.is_initialized():
        if (num_processes is None or num_processes == jax.process_count()) and (
            process_id is None or process_id == jax.process_index()
        ):
            return
        raise ConfigError(
            f"JAX's distributed runtime is already running as process "
            f"{jax.process_index()} of {jax.process_count()}, not {process_id} of "
            f"{num_processes}; call init_distributed once per process."
        )
    if num_processes is not None and (
        num_processes < 1 or process_id is None or not 0 <= process_id < num_processes
    ):
        raise ConfigError(
            f"process_id={process_id} of num_processes={num_processes}: the id "
            "must be in 0 .. num_processes - 1."
        )
    if k is not None and k < 1:
        raise ConfigError(f"devices_per_process={k} must be at least 1.")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise ConfigError(
            "init_distributed must run before any JAX computation in this process "
            "(JAX's devices are already set up); call it first in the script."
        )
    if k is not None:
        flags = re.sub(
            r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
        )
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={k}".strip()
        if local_device_ids is None:
            local = _env_int("AUTOPAR_LOCAL_RANK") or 0
            local_device_ids = list(range(local * k, local * k + k))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=timeout,
    )
    sys.excepthook = _exit_at_once(sys.excepthook)


def _exit_at_once(hook):
    """An excepthook that reports an uncaught exception and ends the process with status 1 at
    once: JAX's exit would wait up to 5 minutes in a shutdown barrier for the other processes,
    which may be blocked in a collective waiting for this one (``autopar launch`` stops them)."""

    def report_and_exit(kind, value, tb):
        hook(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    return report_and_exit


def multi_process() -> bool:
    """Whether this process is one of several in JAX's distributed runtime."""
    return jax.distributed.is_initialized() and jax.process_count() > 1


def broadcast_text(text: str) -> str:
    """Process 0's ``text`` on every process (the others' ``text`` is ignored)."""
    data = (
        np.frombuffer(text.encode(), np.uint8)
        if jax.process_index() == 0
        else np.zeros(0, np.uint8)
    )
    n = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
    buf = np.zeros(n, np.uint8)
    buf[: data.size] = data[:n]
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).decode()


def check_same(digest: bytes | None, what: str) -> None:
    """Every process's 32-byte ``digest`` of ``what`` compared with process 0's; None: this
    process failed to make it (it raises its own error; the others raise ConfigError here
    instead of waiting for it)."""
    row = np.zeros(33, np.uint8)
    if digest is not None:
        row[0] = 1
        row[1:] = np.frombuffer(digest, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, 33)
    if digest is None:
        return
    failed = [int(p) for p in np.flatnonzero(rows[:, 0] == 0)]
    if failed:
        raise ConfigError(
            f"process(es) {failed} could not make {what} (see their error); every "
            "process must call compile with the same step and argument shapes."
        )
    differ = [p for p in range(len(rows)) if not np.array_equal(rows[p], rows[0])]
    if differ:
        raise ConfigError(
            f"{what} differs between process 0 and process(es) {differ}: every "
            "process must call compile with the same step, arguments, config and "
            "autopar/JAX versions."
        )


def _rows(sharding, shape) -> list:
    """(process, first row, end row) of dimension 0 that every device of ``sharding`` holds."""
    out = []
    for d, idx in sharding.devices_indices_map(tuple(shape)).items():
        s = idx[0] if idx else slice(None)
        out.append((d.process_index, s.start or 0, shape[0] if s.stop is None else s.stop))
    return out


def place(x, sharding: NamedSharding, process_local: bool = False):
    """``x`` as a global jax.Array laid out by ``sharding``: ``x`` is the whole value (the same
    on every process), or with ``process_local`` this process's slice of dimension 0 (process
    p holds rows ``p * n .. p * n + n - 1``). A slice moves between processes only when the
    layout puts a row on a device of another process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding != sharding:
            raise ConfigError(
                f"a global argument laid out as {x.sharding} where the plan needs "
                f"{sharding}; pass host arrays, or the arrays the step returned."
            )
        return x
    x = np.asarray(x)
    if not process_local or x.ndim == 0:
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
    n, p = x.shape[0], jax.process_count()
    shape = (n * p,) + x.shape[1:]
    if all(q * n <= a and b <= (q + 1) * n for q, a, b in _rows(sharding, shape)):
        lo = jax.process_index() * n

        def block(idx):
            s = idx[0]
            a = s.start or 0
            b = shape[0] if s.stop is None else s.stop
            return x[(slice(a - lo, b - lo),) + tuple(idx[1:])]

        return jax.make_array_from_callback(shape, sharding, block)
    whole = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.make_array_from_callback(shape, sharding, lambda idx: whole[idx])


def fetch(a) -> np.ndarray:
    """The whole value of the global array ``a`` as numpy, on every process (each takes the
    same path: what one process can read alone, another may hold none of)."""
    if not isinstance(a, jax.Array) or not multi_process():
        return np.asarray(a)
    everywhere = set(jax.devices())
    if a.sharding.device_set == everywhere:
        if a.is_fully_replicated:
            return np.asarray(a.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    # the value lives on some processes' devices only (a pipeline stage's): made whole on those
    # devices, then sent from the first process holding it to every process
    devs: list[jax.Device] = sorted(a.sharding.device_set, key=lambda d: d.id)
    source = min(d.process_index for d in devs)
    me = jax.process_index() == source
    if any(d.process_index == jax.process_index() for d in devs):  # the holders only
        a = jax.device_put(a, NamedSharding(Mesh(np.array(devs), ("d",)), PartitionSpec()))
    x = np.asarray(a.addressable_data(0)) if me else np.zeros(a.shape, a.dtype)
    flag = x.dtype == np.bool_  # psum carries numbers
    got = multihost_utils.broadcast_one_to_all(x.astype(np.uint8) if flag else x, is_source=me)
    return np.asarray(got).astype(np.bool_) if flag else np.asarray(got)


def _block_order(sharding, shape) -> list:
    """The devices of ``sharding`` by the index of the dimension-0 block each holds."""
    m = sharding.devices_indices_map(tuple(shape))
    return sorted(m, key=lambda d: m[d][0].start or 0)


def move(v, sharding: NamedSharding):
    """The stack ``v`` (shape ``(K, ...)``, block i on its i-th device) with block i on the i-th
    device of ``sharding`` (K devices as well)."""
    if not multi_process() or v.sharding.device_set == sharding.device_set:
        return jax.device_put(v, sharding)
    src, dst = _block_order(v.sharding, v.shape), _block_order(sharding, v.shape)
    k = len(src)
    if len(dst) != k or v.shape[0] != k:
        raise ConfigError(
            f"a pipeline transfer from {k} devices to {len(dst)}: in a multi-process "
            "JAX runtime every stage must have as many devices as the others "
            "(pipeline_stage_devices='equal')."
        )
    both = Mesh(np.array(src + dst), ("u",))
    mine = {sh.device: sh.data for sh in v.addressable_shards}
    block = (1,) + v.shape[1:]
    local = [
        mine[d] if d in mine else jax.device_put(np.zeros(block, v.dtype), d)
        for d in src + dst
        if d.process_index == jax.process_index()
    ]
    pair = jax.make_array_from_single_device_arrays(
        (2 * k,) + v.shape[1:], NamedSharding(both, PartitionSpec("u")), local, dtype=v.dtype
    )
    out = _permute(both, k)(pair)
    there = set(dst)
    return jax.make_array_from_single_device_arrays(
        v.shape,
        sharding,
        [sh.data for sh in out.addressable_shards if sh.device in there],
        dtype=v.dtype,
    )


@functools.lru_cache(maxsize=64)
def _permute(mesh, k):
    """The jitted ``ppermute`` sending block i of ``mesh``'s first k devices to device k + i."""
    perm = [(i, k + i) for i in range(k)]
    return jax.jit(
        jax.shard_map(
            lambda b: jax.lax.ppermute(b, "u", perm),
            mesh=mesh,
            in_specs=PartitionSpec("u"),
            out_specs=PartitionSpec("u"),
        )
    )
