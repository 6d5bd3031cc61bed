"""How the native runtime runs a program (``RuntimeOptions``): overlap, single-copy transfers,
namespace hosts, TCP streams per pair of ranks, whole-step executables. In: the fields, or the
caller's environment (``from_env``). Out: a frozen value the runner ships with the program."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from autopar.errors import ConfigError


def _caller_x64() -> bool:
    import jax

    return bool(jax.config.read("jax_enable_x64"))


@dataclass(frozen=True)
class RuntimeOptions:
    """How the native runtime runs a program, shipped with it (``overlap`` in the payload,
    ``direct`` and ``tcp_streams`` to the job's workers as they build their ``Comm``).
    ``from_env`` reads ``AUTOPAR_OVERLAP=0``, ``AUTOPAR_DIRECT=0``, ``AUTOPAR_TCP_STREAMS=S``,
    ``AUTOPAR_WHOLE_STEP=0`` and ``AUTOPAR_RESIDENT=0`` in the caller, so a benchmark may still
    set them; nothing below reads the environment."""

    # all-reduce buckets run while the compute after them does (False: each is awaited as
    # issued, to measure what the overlap gains)
    overlap: bool = True
    # single-copy transfers between ranks on shared memory, through process_vm_readv/writev: a
    # message of 1 MiB or more is read by the receiver straight from the sender's memory, and
    # the "direct" all-reduce and the large all-gathers, all-to-alls and broadcasts read their
    # peers' buffers themselves. On only where every rank of the job can reach the others'
    # memory. False: everything goes through the shared-memory slots (two copies; the
    # "direct" all-reduce runs the ring) -- to measure what single-copy gains
    direct: bool = True
    # (Linux network namespace, IPv4 address) per host of the program's topology: each host's
    # ranks run in its namespace and reach the other hosts over TCP (``tools.netns`` makes
    # such hosts on one machine). Empty: every rank on this host, shared memory between all
    hosts: tuple = ()
    # TCP connections per pair of ranks on different hosts: a message is cut into chunks that
    # go out on whichever connection is free (more than one pays where one flow is capped
    # below the link, as a NIC's per-flow limits or one core per flow do)
    tcp_streams: int = 1
    # each rank's whole step as one compiled executable, its collectives XLA custom calls
    # (runtime.native_step): Python runs once per step, not once per instruction; all-reduces
    # in buckets, full ones overlapping the compute after them (``overlap``) on the
    # communicator's own thread. Programs it cannot run (a Reduction Server) run instruction
    # by instruction, as all do with False (a Python interpreter in each worker walking the
    # program, one compiled segment per call)
    whole_step: bool = True
    # results of 64 KiB or more stay in the workers between calls (runtime.resident): the
    # caller gets read-only numpy arrays, and passing one back unchanged to its step sends only
    # its key, so parameters and optimizer state do not go to the workers again
    resident: bool = True
    # the caller's jax_enable_x64: a rank traces and compiles its step with the same dtypes
    # (without it a rank's JAX made every 64-bit value of the caller's plan 32-bit)
    x64: bool = field(default_factory=_caller_x64)

    def apply_x64(self) -> None:
        """Set this process's jax_enable_x64 as the caller had it (a worker, on loading)."""
        import jax

        if bool(jax.config.read("jax_enable_x64")) != self.x64:
            jax.config.update("jax_enable_x64", self.x64)

    @classmethod
    def from_env(cls) -> RuntimeOptions:
        return cls(
            overlap=os.environ.get("AUTOPAR_OVERLAP", "1") != "0",
            direct=os.environ.get("AUTOPAR_DIRECT", "1") != "0",
            tcp_streams=_streams(os.environ.get("AUTOPAR_TCP_STREAMS", "1")),
            whole_step=os.environ.get("AUTOPAR_WHOLE_STEP", "1") != "0",
            resident=os.environ.get("AUTOPAR_RESIDENT", "1") != "0",
        )


def _streams(text: str) -> int:
    if not text.strip().isdigit():
        raise ConfigError(
            f"AUTOPAR_TCP_STREAMS={text!r}: give a whole number of TCP connections "
            "per pair of ranks, 1 to 16."
        )
    return int(text)
