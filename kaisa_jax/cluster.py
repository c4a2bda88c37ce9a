"""The cluster a fraction is planned for: its devices' rates, links and memory.

`Cluster` describes identical devices in nodes; `DGX_A100`, `DGX_H100` and
`DGX_H200` take their figures from NVIDIA's data sheets (peak rates, so a time projected from
them is optimistic by the kernels' efficiency). `kaisa_jax.plan_fractions`
weighs each grad worker fraction on one, within a memory budget taken by
default from the device's memory (`kaisa_jax.planning.budget_for`), and
``grad_worker_fraction="auto"`` takes the preset of the first device's kind
(`cluster_of`).
`kaisa_jax.analysis.projection.measure_host` times this machine into one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

GB = 1e9
# The widths of the host's dense probes: two W x W layers on 128 rows, whose
# products of 2 * 128 * W^2 flops are the sizes by which a program's products
# are binned.
MATMUL_WIDTHS = (16, 32, 64, 128, 256, 512, 1024)
MATMUL_SIZES = tuple(2.0 * 128 * w * w for w in MATMUL_WIDTHS)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """A cluster of identical devices, as the projection sees it.

  Attributes:
    name: what it is, printed with every projection.
    flops_per_s: sustained float32 FLOP/s of one device.
    memory_bandwidth: bytes/s between one device and its memory.
    intra_node_bandwidth: bytes/s one device sends in a collective among
      devices of one node (one direction).
    inter_node_bandwidth: bytes/s one device sends in a collective that spans
      nodes (one direction).
    devices_per_node: devices in one node.
    latency: seconds each collective costs on top of its bytes.
    memory: bytes of memory per device; the planner's default budget for
      K-FAC's state is this less the model's memory
      (`kaisa_jax.planning.budget_for`).
    kernel_overhead: seconds each kernel (each operation a compiled program
      launches) costs on top of its flops and bytes.
    source: where the figures come from.
    matmul_rates: FLOP/s of the matrix products and convolutions of each
      of `MATMUL_SIZES` flops (`measure_host` times dense layers of each
      width: small products run far below a large one's rate); ``None``:
      every flop at ``flops_per_s``.
  """

  name: str
  flops_per_s: float
  memory_bandwidth: float
  intra_node_bandwidth: float
  inter_node_bandwidth: float
  devices_per_node: int
  latency: float
  memory: float
  kernel_overhead: float
  source: str = ""
  matmul_rates: tuple[float, ...] | None = None

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.type == "float" and not (np.isfinite(value) and value > 0):
        raise ValueError(f"Cluster {field.name} must be a positive number, got {value!r}")
    rates = self.matmul_rates
    if rates is not None and (
      len(rates) != len(MATMUL_SIZES) or not all(np.isfinite(r) and r > 0 for r in rates)
    ):
      raise ValueError(
        f"Cluster matmul_rates must be None or {len(MATMUL_SIZES)} positive FLOP/s, one per "
        f"kaisa_jax.cluster.MATMUL_SIZES, got {rates!r}"
      )
    if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
      raise ValueError(f"Cluster devices_per_node must be an int >= 1, got {self.devices_per_node}")

  def bandwidth(self, spans_nodes: bool) -> float:
    """Bytes/s per device of a collective within a node, or spanning nodes."""
    return self.inter_node_bandwidth if spans_nodes else self.intra_node_bandwidth


# NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB): FP32 19.5 TFLOP/s, HBM2e
# 2,039 GB/s, NVLink 600 GB/s (both directions); DGX A100 data sheet: 8 GPUs,
# 8 single-port 200 Gb/s InfiniBand adapters (one per GPU). Assumptions, not
# data-sheet figures: the latency of a small NCCL collective (10 us) and of a
# CUDA kernel launch (4 us; XLA's command buffers can hide part of it).
DGX_A100 = Cluster(
  name="DGX A100 (8x A100-SXM4-80GB, NVLink, 200 Gb/s InfiniBand per GPU)",
  flops_per_s=19.5e12,
  memory_bandwidth=2039 * GB,
  intra_node_bandwidth=300 * GB,
  inter_node_bandwidth=25 * GB,
  devices_per_node=8,
  latency=10e-6,
  memory=80 * GB,
  kernel_overhead=4e-6,
  source="NVIDIA A100 and DGX A100 data sheets (peak FP32); latency and kernel launch assumed",
)
# NVIDIA H100 Tensor Core GPU data sheet (SXM5): FP32 67 TFLOP/s, HBM3 3.35 TB/s,
# NVLink 900 GB/s (both directions); DGX H100 data sheet: 8 GPUs, 400 Gb/s
# ConnectX-7 per GPU.
DGX_H100 = Cluster(
  name="DGX H100 (8x H100-SXM5-80GB, NVLink, 400 Gb/s InfiniBand per GPU)",
  flops_per_s=67e12,
  memory_bandwidth=3350 * GB,
  intra_node_bandwidth=450 * GB,
  inter_node_bandwidth=50 * GB,
  devices_per_node=8,
  latency=10e-6,
  memory=80 * GB,
  kernel_overhead=4e-6,
  source="NVIDIA H100 and DGX H100 data sheets (peak FP32); latency and kernel launch assumed",
)
# NVIDIA H200 Tensor Core GPU data sheet (SXM): FP32 67 TFLOP/s, HBM3e 141 GB at
# 4.8 TB/s, NVLink 900 GB/s (both directions); DGX H200 data sheet: 8 GPUs, 400
# Gb/s ConnectX-7 per GPU. The H100's chip and links with more and faster memory.
DGX_H200 = dataclasses.replace(
  DGX_H100,
  name="DGX H200 (8x H200-SXM-141GB, NVLink, 400 Gb/s InfiniBand per GPU)",
  memory_bandwidth=4800 * GB,
  memory=141 * GB,
  source="NVIDIA H200 and DGX H200 data sheets (peak FP32); latency and kernel launch assumed",
)
PRESETS = {"dgx_a100": DGX_A100, "dgx_h100": DGX_H100, "dgx_h200": DGX_H200}
# The preset of each GPU, by the name its device kind holds (`cluster_of`).
KINDS = (("A100", DGX_A100), ("H100", DGX_H100), ("H200", DGX_H200))


def cluster_of(device: Any) -> Cluster:
  """The preset for a device's kind (A100, H100, H200); raises for any other kind.

  Its memory is what the device reports JAX may use (``memory_stats()["bytes_limit"]``) where it
  reports it: an A100 of 40 GB, or a process given a fraction of the device
  (``XLA_PYTHON_CLIENT_MEM_FRACTION``), is planned with what it has, not the preset's 80 GB.
  """
  kind = getattr(device, "device_kind", str(device))
  for key, preset in KINDS:
    if key in kind:
      stats = device.memory_stats() if hasattr(device, "memory_stats") else None
      limit = (stats or {}).get("bytes_limit")
      return dataclasses.replace(preset, memory=float(limit)) if limit else preset
  raise ValueError(
    f"no cluster preset for device kind {kind!r} (presets: "
    f"{', '.join(key for key, _ in KINDS)}): describe it with "
    "kaisa_jax.Cluster(...) and pass grad_worker_fraction="
    "kaisa_jax.plan_fractions(layers, n_devices, cluster).recommended"
  )
