"""Accelerators as their datasheets give them, and what their kernels reach of that.

In: a preset name (``Chip.named("a100-80gb")``) or the fields. Out: a frozen ``Chip`` whose
methods price one kernel on one device: ``matmul_seconds`` (a matmul of a given shape and
dtype), ``stream_seconds`` (a memory-bound kernel: bytes through HBM and elementwise FLOPs).
``Topology.chip`` carries one; the cost model (``strategies.cost_model``) prices operators with
it, and with the calibrated CPU rates of this machine when there is none.

The model, per kernel (every figure from the presets' sources below, none fitted to a run):
- a matmul of ``batch`` independent (m x k) @ (k x n) products, in dtype d, reading and
  writing ``nbytes``: ``max(2 m n k batch / (peak_d x matmul_efficiency x fill), nbytes /
  (hbm x memory_efficiency)) + launch``, where ``fill`` is tile and wave quantization as
  NVIDIA's GEMM performance guide describes them: the output is computed in ``tile``-sized
  blocks spread over ``cores`` streaming multiprocessors in waves, so
  ``fill = m n batch / (waves x cores x tile_m x tile_n)`` with ``waves = ceil(tiles / cores)``
  (a 2048 x 4608 output on an A100: 288 tiles of 256 x 128, three waves of 108, fill 0.89);
  ``matmul_efficiency`` is the share of the peak a large, well-shaped GEMM reaches in cuBLAS;
- a memory-bound kernel (a fusion of elementwise operators and reductions: XLA emits one per
  fusion, ``strategies.fusion``): ``max(flops / vector_flops, nbytes / (hbm x
  memory_efficiency)) + launch``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError
from .frozen import cached_hash


@cached_hash
@dataclass(frozen=True)
class Chip:
    """One accelerator. ``matmul_peak``: ``(dtype name, dense FLOP/s of its matrix units)``
    pairs (float32 as JAX runs it there by default: TF32 on Ampere and Hopper); a dtype not
    listed runs at ``vector_flops``."""

    name: str
    matmul_peak: tuple[tuple[str, float], ...]
    vector_flops: float  # FLOP/s of elementwise arithmetic (fp32 CUDA cores)
    hbm_bandwidth: float  # bytes/s of device memory, peak
    memory: int  # bytes of device memory
    cores: int  # streaming multiprocessors a matmul's tiles spread over
    tile: tuple[int, int] = (256, 128)  # a large GEMM's output block (rows, columns)
    matmul_efficiency: float = 0.8  # share of the peak large GEMMs reach
    memory_efficiency: float = 0.85  # share of ``hbm_bandwidth`` a streaming kernel reaches
    launch: float = 4e-6  # seconds every kernel takes at least
    sources: str = ""  # where the figures come from

    def __post_init__(self):
        peaks = tuple(sorted((_name(d), float(f)) for d, f in dict(self.matmul_peak).items()))
        object.__setattr__(self, "matmul_peak", peaks)
        object.__setattr__(self, "tile", tuple(int(t) for t in self.tile))
        if not (
            peaks
            and all(f > 0 for _, f in peaks)
            and self.vector_flops > 0
            and self.hbm_bandwidth > 0
            and self.memory > 0
            and self.cores >= 1
            and len(self.tile) == 2
            and min(self.tile) >= 1
            and 0 < self.matmul_efficiency <= 1
            and 0 < self.memory_efficiency <= 1
            and self.launch >= 0
        ):
            raise ConfigError(
                f"Chip {self.name!r}: needs matmul peaks > 0, vector_flops, "
                "hbm_bandwidth, memory > 0, cores >= 1, a 2-number tile, "
                "efficiencies in (0, 1] and launch >= 0."
            )

    def peak(self, dtype) -> float:
        """Dense FLOP/s of a matmul in ``dtype`` (the vector rate where no matrix unit runs it)."""
        name = _name(dtype)
        return next((f for d, f in self.matmul_peak if d == name), self.vector_flops)

    def fill(self, m: int, n: int, batch: int = 1) -> float:
        """The share of the computed tiles' work that is the output's (module docstring)."""
        tm, tn = self.tile
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        waves = math.ceil(tiles / self.cores)
        return m * n * batch / (waves * self.cores * tm * tn)

    def matmul_seconds(self, m: int, n: int, k: int, batch: int, dtype, nbytes: float) -> float:
        """Seconds of ``batch`` (m x k) @ (k x n) products in ``dtype`` moving ``nbytes``."""
        if min(m, n, k, batch) <= 0:
            return 0.0
        flops = 2.0 * m * n * k * batch
        compute = flops / (self.peak(dtype) * self.matmul_efficiency * self.fill(m, n, batch))
        return max(compute, nbytes / self.stream_rate) + self.launch

    @property
    def stream_rate(self) -> float:
        """Bytes/s a streaming kernel moves through device memory."""
        return self.hbm_bandwidth * self.memory_efficiency

    def stream_seconds(self, nbytes: float, flops: float = 0.0, launch: bool = True) -> float:
        """Seconds of a memory-bound kernel moving ``nbytes`` and computing ``flops``
        (``launch``: it opens a kernel of its own)."""
        return max(flops / self.vector_flops, nbytes / self.stream_rate) + (
            self.launch if launch else 0.0
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "matmul_peak": dict(self.matmul_peak),
            "vector_flops": self.vector_flops,
            "hbm_bandwidth": self.hbm_bandwidth,
            "memory": self.memory,
            "cores": self.cores,
            "tile": list(self.tile),
            "matmul_efficiency": self.matmul_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "launch": self.launch,
            "sources": self.sources,
        }

    @staticmethod
    def from_dict(d: dict) -> Chip:
        return Chip(
            **{
                **d,
                "matmul_peak": tuple(dict(d["matmul_peak"]).items()),
                "tile": tuple(d.get("tile", (256, 128))),
            }
        )

    @staticmethod
    def named(name: str) -> Chip:
        """A preset (``CHIPS``) by name."""
        try:
            return CHIPS[name]
        except KeyError:
            raise ConfigError(f"unknown chip {name!r}; choose one of {', '.join(CHIPS)}.") from None

    def __str__(self) -> str:
        top = max(self.peak("bfloat16"), self.peak("float16"))
        return (
            f"{self.name}({top / 1e12:g} TFLOP/s 16-bit, {self.hbm_bandwidth / 1e12:g} TB/s, "
            f"{self.memory / 2**30:g} GiB)"
        )


def _name(dtype) -> str:
    """A dtype's name ("bfloat16"), from a name or a dtype."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


GiB = 2**30
_GEMM = (
    "matmul_efficiency 0.8: large bf16/fp16 GEMMs reach 75-85% of the dense peak in cuBLAS "
    "on Volta, Ampere and Hopper; memory_efficiency 0.85: streaming kernels (STREAM-like "
    "copy and triad) reach 85-92% of the HBM peak; tile 256 x 128 and wave quantization as "
    "in NVIDIA's Matrix Multiplication Background user guide"
)

CHIPS = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s bf16/fp16 dense, 156 TF32,
    # 19.5 FP32 and FP64 tensor, 624 INT8; 2,039 GB/s HBM2e; 108 SMs (A100 whitepaper)
    "a100-80gb": Chip(
        "a100-80gb",
        (
            ("bfloat16", 312e12),
            ("float16", 312e12),
            ("float32", 156e12),
            ("float64", 19.5e12),
            ("int8", 624e12),
        ),
        vector_flops=19.5e12,
        hbm_bandwidth=2.039e12,
        memory=80 * GiB,
        cores=108,
        sources="NVIDIA A100 datasheet and whitepaper; " + _GEMM,
    ),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16/fp16 dense (1,979 with sparsity), 494.7
    # TF32, 66.9 FP32, 66.9 FP64 tensor, 1,979 INT8/FP8; 3.35 TB/s HBM3; 132 SMs
    "h100-sxm": Chip(
        "h100-sxm",
        (
            ("bfloat16", 989.4e12),
            ("float16", 989.4e12),
            ("float32", 494.7e12),
            ("float64", 66.9e12),
            ("int8", 1979e12),
            ("float8_e4m3fn", 1979e12),
        ),
        vector_flops=66.9e12,
        hbm_bandwidth=3.35e12,
        memory=80 * GiB,
        cores=132,
        sources="NVIDIA H100 datasheet and Hopper whitepaper; " + _GEMM,
    ),
    # NVIDIA V100 datasheet (SXM2 16GB, as in AWS p3.16xlarge): 125 TFLOP/s fp16 tensor cores,
    # 15.7 FP32, 7.8 FP64 (no bf16 or TF32 units); 900 GB/s HBM2; 80 SMs
    "v100-16gb": Chip(
        "v100-16gb",
        (("float16", 125e12), ("float64", 7.8e12)),
        vector_flops=15.7e12,
        hbm_bandwidth=900e9,
        memory=16 * GiB,
        cores=80,
        sources="NVIDIA V100 datasheet and Volta whitepaper; " + _GEMM,
    ),
}
