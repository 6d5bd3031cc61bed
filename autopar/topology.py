"""Physical topology: the device hierarchy with per-level alpha/beta link costs.

In: level sizes and link constants (or a preset name, or a topology file). Out: a frozen
``Topology`` whose ``levels`` are outermost first; ``save``/``load`` write and read it as JSON.
All communication constants live here; solvers read them from a Topology, never hard-code them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .chip import Chip
from .errors import ConfigError
from .frozen import cached_hash

SMALL_DOT = 2 * 256 * 512 * 512  # FLOPs of the reference matmuls (tools/calibrate.py)
LARGE_DOT = 2 * 1024**3
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")  # what betas may name


@cached_hash
@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: ``size`` children joined by links of latency ``alpha``
    (seconds per message) and inverse bandwidth ``beta`` (seconds per byte); ``launch``:
    seconds each collective call costs once, on top of its messages (waking the ranks,
    a kernel launch), so one all-reduce is cheaper than a reduce-scatter plus an all-gather.
    ``betas``: ``(kind, seconds per byte)`` pairs for the collective kinds whose bytes a runtime
    moves at another rate than its all-reduce's (``beta``), sorted by kind (``autopar
    calibrate`` measures all-gather, reduce-scatter and all-to-all on the runtime it calibrates:
    a runtime's own buffers and copies around each kind differ). ``share``: how many devices
    share one link of this level (a host's one NIC serving its 8 GPUs: 8; a NIC per GPU: 1);
    every device communicates at once in an SPMD step, so each gets ``1 / share`` of the link:
    its seconds per byte there are ``beta x share``."""

    name: str
    size: int
    alpha: float
    beta: float
    launch: float = 0.0
    betas: tuple[tuple[str, float], ...] = ()
    share: int = 1

    def __post_init__(self):
        try:
            betas = tuple(sorted((str(k), float(b)) for k, b in dict(self.betas).items()))
        except (TypeError, ValueError):
            betas = None
        if betas is None or any(k not in KINDS for k, _ in betas):
            raise ConfigError(
                f"Topology level {self.name!r}: betas={self.betas!r} must map "
                f"collective kinds ({', '.join(KINDS)}) to seconds per byte."
            )
        object.__setattr__(self, "betas", betas)
        if isinstance(self.share, bool) or not isinstance(self.share, int) or self.share < 1:
            raise ConfigError(
                f"Topology level {self.name!r}: share={self.share!r} must be a "
                "whole number of devices per link, at least 1."
            )

    def beta_for(self, kind) -> float:
        """Seconds per byte one device moves in a collective ``kind`` (a StepKind or its name,
        or "send") at this level, its link shared ``share`` ways."""
        for k, b in self.betas:
            if k == kind:
                return b * self.share
        return self.beta * self.share

    def __str__(self) -> str:
        kinds = "".join(f",{k}:{1e-9 / b:g}GB/s" for k, b in self.betas)
        shared = f"/{self.share}" if self.share > 1 else ""
        return (
            f"{self.name}={self.size}@{self.alpha * 1e6:g}us,{1e-9 / self.beta:g}GB/s"
            f"{shared}{kinds}"
        )


@cached_hash
@dataclass(frozen=True)
class Topology:
    """The device hierarchy, outermost level first, plus per-device compute throughput and
    what one call of a compiled step costs on top of its operators: ``step_overhead`` seconds
    (dispatch, the runtime's bookkeeping), ``host_beta`` seconds per byte of arguments in and
    results out (the caller's arrays placed on the devices and fetched back) and
    ``arg_overhead`` seconds per such array (each is split, sent, received and handed to XLA
    on its own). ``flops`` is the
    rate of a matmul of ``LARGE_DOT`` FLOPs or more, ``small_dot_flops`` (0: the same) that of
    one of ``SMALL_DOT`` or fewer; ``matmul_rate`` interpolates between them (small matmuls run
    below the peak rate). ``reducers``: CPU-only reducer processes, each on a host of its
    own with a NIC like the outermost level's, that an all-reduce over every device may go
    through (the native runtime's Reduction Server; 0: none). ``reference_compute``: the
    seconds of the calibration's reference step's compute as it ran when these constants were
    measured, every device busy (its call less its priced communication and overhead; 0: not
    measured); a later profile (one rank alone on a core) times that step beside the plans and
    scales their figures to it (``compiler.api``). ``chip``: the accelerator every device is
    (``autopar.chip``; None: this machine's CPU, priced by the calibrated rates above); with a
    chip the cost model prices operators by its matmul and memory model, and ``flops`` and
    ``mem_bandwidth`` are its bf16 matmul and streaming rates."""

    levels: tuple[Level, ...]
    flops: float = 50e9  # sustained float32 FLOP/s of one device
    mem_bandwidth: float = 10e9  # bytes/s of one device's memory
    step_overhead: float = 0.0  # seconds per call of the step
    host_beta: float = 0.0  # seconds per byte of the step's arguments and results
    small_dot_flops: float = 0.0  # FLOP/s of a matmul of SMALL_DOT FLOPs (0: flops)
    reducers: int = 0  # Reduction Server processes (hosts of their own)
    reference_compute: float = 0.0  # seconds: the reference step's compute as run (0: none)
    arg_overhead: float = 0.0  # seconds per array argument or result of a call
    chip: Chip | None = None  # the accelerator (None: this machine's CPU, calibrated)
    source: str = ""  # what the figures are: a preset and its sources, a file

    def __post_init__(self):
        if not self.levels:
            raise ConfigError("Topology needs at least one level; use Topology.local(n).")
        for lv in self.levels:
            if (
                lv.size < 1
                or lv.alpha < 0
                or lv.beta <= 0
                or lv.launch < 0
                or any(not b > 0 for _, b in lv.betas)
            ):
                raise ConfigError(
                    f"Topology level {lv!r} needs size >= 1, alpha >= 0, beta > 0, "
                    "launch >= 0 and every kind's beta > 0."
                )
        if not (
            self.flops > 0
            and self.mem_bandwidth > 0
            and self.step_overhead >= 0
            and self.host_beta >= 0
            and self.small_dot_flops >= 0
            and self.reference_compute >= 0
            and self.arg_overhead >= 0
        ):
            raise ConfigError(
                f"{self} needs flops > 0, mem_bandwidth > 0 and step_overhead, "
                "host_beta, small_dot_flops, reference_compute, arg_overhead "
                ">= 0."
            )
        if (
            isinstance(self.reducers, bool)
            or not isinstance(self.reducers, int)
            or not 0 <= self.reducers <= 64
        ):
            raise ConfigError(
                f"Topology reducers={self.reducers!r}: give 0 to 64 reducer "
                "processes (the Reduction Server all-reduce's)."
            )

    def matmul_rate(self, flops: float) -> float:
        """FLOP/s of one matmul of ``flops`` FLOPs on a device: ``small_dot_flops`` up to
        ``SMALL_DOT``, ``flops`` from ``LARGE_DOT``, linear in log(FLOPs) between."""
        if not self.small_dot_flops or flops >= LARGE_DOT:
            return self.flops
        if flops <= SMALL_DOT:
            return self.small_dot_flops
        w = math.log(flops / SMALL_DOT) / math.log(LARGE_DOT / SMALL_DOT)
        return self.small_dot_flops + w * (self.flops - self.small_dot_flops)

    @property
    def num_devices(self) -> int:
        return math.prod(lv.size for lv in self.levels)

    def inner(self, k: int) -> Topology:
        """The innermost levels holding ``k`` devices (one pipeline stage's topology). A stage
        takes whole levels, or part of one level that its stages tile (6 of a host's 8 GPUs
        would put a stage across two hosts, refused), or any part of the outermost level."""
        levels: list[Level] = []
        n = 1
        for lv in reversed(self.levels):
            if n * lv.size <= k:
                levels.insert(0, lv)
                n *= lv.size
            elif k % n == 0 and (lv is self.levels[0] or lv.size % (k // n) == 0):
                levels.insert(0, replace(lv, size=k // n))
                n = k
            if n == k or k % n:
                break
        if n != k:
            raise ConfigError(
                f"{k} devices per pipeline stage do not fill whole inner levels of "
                f"{self} (a stage would span two of them); choose "
                "pipeline_stages so that they do."
            )
        # a stage reduces over its own devices only: the reducers serve whole-mesh groups; the
        # reference step was profiled on all of them
        return replace(
            self,
            levels=tuple(lv for lv in levels if lv.size > 1) or (levels[-1],),
            reducers=0,
            reference_compute=self.reference_compute if k == self.num_devices else 0.0,
        )

    @staticmethod
    def local(n: int) -> Topology:
        """This machine: ``n`` ranks sharing one host's memory (constants from ../shared/PEERS.md:
        a few microseconds per hand-off, a few GB/s of shared-memory bus bandwidth).
        A fixed preset (``launch``, ``step_overhead`` and ``host_beta`` 0): plans on this
        machine use its measurement instead (``autopar.tools.calibrate``) unless a topology is
        given or ``AUTOPAR_TOPOLOGY`` names this preset."""
        return Topology((Level("host", n, alpha=5e-6, beta=1 / 4e9),), source="preset local")

    @staticmethod
    def machine(name: str, hosts: int, per_host: int | None = None) -> Topology:
        """``hosts`` of the real machine ``name`` (``MACHINES``), ``per_host`` of its GPUs each
        (default: all of them): the chip's datasheet figures and the links' (module
        ``MACHINES`` notes say where each figure comes from)."""
        try:
            m = MACHINES[name]
        except KeyError:
            raise ConfigError(
                f"unknown machine {name!r}; choose one of {', '.join(MACHINES)}."
            ) from None
        per = m.gpus if per_host is None else per_host
        if not 1 <= per <= m.gpus or hosts < 1:
            raise ConfigError(f"{name}: {hosts} hosts of {per} GPUs; a host has 1 to {m.gpus}.")
        chip = Chip.named(m.chip)
        nic_share = max(1, per // m.nics) if m.nics < m.gpus else 1
        return Topology(
            (
                Level("node", hosts, alpha=m.nic_alpha, beta=1 / m.nic_bw, share=nic_share),
                Level("gpu", per, alpha=m.link_alpha, beta=1 / m.link_bw),
            ),
            flops=chip.peak("bfloat16") * chip.matmul_efficiency,
            mem_bandwidth=chip.stream_rate,
            chip=chip,
            source=f"{name}: {m.sources}",
        )

    @staticmethod
    def cluster(hosts: int, per_host: int = 8, nic_gbps: float | None = None) -> Topology:
        """``hosts`` DGX A100 80GB nodes of ``per_host`` GPUs (``machine("dgx-a100", ...)``);
        ``nic_gbps``: another per-GPU NIC speed than its 200 Gb/s HDR InfiniBand."""
        topo = Topology.machine("dgx-a100", hosts, per_host)
        if nic_gbps is None:
            return topo
        node = replace(topo.levels[0], beta=1 / (nic_gbps / 8 * 1e9 * NIC_EFFICIENCY))
        return replace(topo, levels=(node,) + topo.levels[1:])

    @staticmethod
    def preset(name: str, devices: int) -> Topology:
        """A named topology for ``devices`` devices: ``local`` (this host), a real machine
        ``MACHINE:H`` or ``MACHINE:HxG`` (H hosts of it, G of its GPUs each; ``MACHINES``:
        ``dgx-a100``, ``dgx-h100``, ``v100-cloud``), ``cluster:HxG`` (DGX A100 nodes;
        ``cluster`` alone: 8 per host), or a topology file (``save``,
        ``autopar calibrate``), whose one level is stretched to ``devices`` if it has one; a
        ``+rN`` suffix adds N Reduction Server processes (``cluster:4x1+r4``)."""
        import os

        if name == "local":
            return Topology.local(devices)
        base, plus, servers = name.partition("+r")
        if plus:
            if not servers.isdigit():
                raise ConfigError(
                    f"topology {name!r}: write +rN for N reducer processes (e.g. cluster:4x1+r4)."
                )
            return replace(Topology.preset(base, devices), reducers=int(servers))
        kind, _, shape = name.partition(":")
        if kind == "cluster" or kind in MACHINES:
            gpus = MACHINES.get(kind, MACHINES["dgx-a100"]).gpus
            try:
                dims = [int(x) for x in shape.lower().split("x")] if shape else []
                hosts, per = (
                    dims
                    if len(dims) == 2
                    else (dims[0], gpus)
                    if dims
                    else (max(devices // gpus, 1), min(devices, gpus))
                )
            except ValueError:
                hosts = per = 0
            if hosts * per != devices:
                raise ConfigError(
                    f"topology {name!r} does not describe {devices} devices; write "
                    f"{kind}:HOSTSxPER_HOST with HOSTS x PER_HOST = {devices}."
                )
            return Topology.machine("dgx-a100" if kind == "cluster" else kind, hosts, per)
        if os.path.exists(name):
            topo = Topology.load(name)
            if topo.num_devices != devices and len(topo.levels) == 1:
                topo = replace(
                    topo, levels=(replace(topo.levels[0], size=devices),), reference_compute=0.0
                )  # profiled on other devices
            if topo.num_devices != devices:
                raise ConfigError(
                    f"topology file {name} describes {topo.num_devices} devices, not {devices}."
                )
            return topo
        raise ConfigError(
            f"unknown topology {name!r}; choose local, cluster:HOSTSxPER_HOST, "
            f"one of {', '.join(m + ':HOSTS' for m in MACHINES)} or the path of a "
            "topology file (autopar calibrate writes one)."
        )

    def to_dict(self) -> dict:
        return {
            "format": "autopar-topology",
            "flops": self.flops,
            "mem_bandwidth": self.mem_bandwidth,
            "step_overhead": self.step_overhead,
            "host_beta": self.host_beta,
            "small_dot_flops": self.small_dot_flops,
            "levels": [
                {
                    "name": lv.name,
                    "size": lv.size,
                    "alpha": lv.alpha,
                    "beta": lv.beta,
                    "launch": lv.launch,
                    **({"betas": dict(lv.betas)} if lv.betas else {}),
                    **({"share": lv.share} if lv.share > 1 else {}),
                }
                for lv in self.levels
            ],
            **({"chip": self.chip.to_dict()} if self.chip else {}),
            **({"source": self.source} if self.source else {}),
            **({"reducers": self.reducers} if self.reducers else {}),
            **({"reference_compute": self.reference_compute} if self.reference_compute else {}),
            **({"arg_overhead": self.arg_overhead} if self.arg_overhead else {}),
        }

    def save(self, path) -> None:
        import json

        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @staticmethod
    def load(path) -> Topology:
        """The topology saved at ``path``; its ``source`` says so, and when it was measured
        (the file's time) where the file names none."""
        import json
        import os
        import time
        from dataclasses import replace

        with open(path) as f:
            d = json.load(f)
        topo = Topology.from_dict(d, str(path))
        if topo.source:
            return topo
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(path)))
        return replace(topo, source=f"{path} (measured {when})")

    @staticmethod
    def from_dict(d, where: str = "the topology") -> Topology:
        """The Topology ``to_dict`` gave; ConfigError naming ``where`` when it is not one."""
        if not isinstance(d, dict) or d.get("format") != "autopar-topology":
            raise ConfigError(
                f"{where} is not an autopar topology file (autopar calibrate writes one)."
            )
        try:
            return Topology(
                tuple(Level(**lv) for lv in d["levels"]),
                d["flops"],
                d["mem_bandwidth"],
                d.get("step_overhead", 0.0),
                d.get("host_beta", 0.0),
                d.get("small_dot_flops", 0.0),
                d.get("reducers", 0),
                d.get("reference_compute", 0.0),
                d.get("arg_overhead", 0.0),
                Chip.from_dict(d["chip"]) if d.get("chip") else None,
                d.get("source", ""),
            )
        except (KeyError, TypeError) as e:
            raise ConfigError(
                f"{where} is a damaged autopar topology file ({e!r}); write it "
                "again with autopar calibrate."
            ) from None

    def __str__(self) -> str:
        servers = f" + {self.reducers} reducers" if self.reducers else ""
        chip = f" of {self.chip}" if self.chip else ""
        return "Topology(" + " x ".join(str(lv) for lv in self.levels) + servers + chip + ")"


# What a collective reaches of a link's datasheet bandwidth (NCCL-tests' bus bandwidth against
# the link's rate, one direction): NVLink/NVSwitch all-reduces reach ~78% (DGX A100: ~235 of 300
# GB/s), InfiniBand ~94% (23.5 of 25 GB/s per HDR port), TCP over a cloud NIC ~90%.
NVLINK_EFFICIENCY, NIC_EFFICIENCY, TCP_EFFICIENCY = 0.78, 0.94, 0.9


@dataclass(frozen=True)
class Machine:
    """A real GPU host: its chip, GPUs, NICs and the bandwidths (bytes/s, as collectives
    reach them) and latencies of its GPU links and NICs, with the sources of each figure."""

    chip: str
    gpus: int
    nics: int  # NICs per host (fewer than ``gpus``: shared by the GPUs)
    link_bw: float  # GPU-to-GPU bytes/s one direction, as an all-reduce's bus bandwidth
    link_alpha: float
    nic_bw: float  # bytes/s of one NIC, one direction
    nic_alpha: float
    sources: str


MACHINES = {
    # DGX A100 80GB: 8 A100 SXM4 on NVLink 3 through NVSwitch (12 links x 25 GB/s = 300 GB/s
    # per direction per GPU), 8 ConnectX-6 HDR InfiniBand 200 Gb/s NICs, one per GPU (DGX
    # A100 user guide and datasheet)
    "dgx-a100": Machine(
        "a100-80gb",
        8,
        8,
        300e9 * NVLINK_EFFICIENCY,
        3e-6,
        200e9 / 8 * NIC_EFFICIENCY,
        8e-6,
        "DGX A100 datasheet (8 x A100 80GB, NVSwitch, 300 GB/s NVLink per "
        "direction per GPU, 8 x 200 Gb/s HDR InfiniBand)",
    ),
    # DGX H100: 8 H100 SXM5 on NVLink 4 through NVSwitch (18 links, 450 GB/s per direction per
    # GPU), 8 ConnectX-7 NDR 400 Gb/s NICs for the compute fabric, one per GPU
    "dgx-h100": Machine(
        "h100-sxm",
        8,
        8,
        450e9 * NVLINK_EFFICIENCY,
        3e-6,
        400e9 / 8 * NIC_EFFICIENCY,
        8e-6,
        "DGX H100 datasheet (8 x H100 SXM5, NVSwitch, 450 GB/s NVLink per "
        "direction per GPU, 8 x 400 Gb/s NDR InfiniBand)",
    ),
    # a V100 cloud host as AWS p3.16xlarge: 8 V100 SXM2 16GB on NVLink 2 in a hybrid cube
    # mesh (6 links x 25 GB/s = 150 GB/s per direction per GPU), one 25 Gb/s Ethernet NIC
    # serving all eight (TCP)
    "v100-cloud": Machine(
        "v100-16gb",
        8,
        1,
        150e9 * NVLINK_EFFICIENCY,
        4e-6,
        25e9 / 8 * TCP_EFFICIENCY,
        30e-6,
        "AWS p3.16xlarge (8 x V100 SXM2 16GB, NVLink 2 hybrid cube mesh, "
        "150 GB/s per direction per GPU, one 25 Gb/s NIC for the host)",
    ),
}
