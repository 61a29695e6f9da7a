"""Abstract GPUs for compiling without one: each supported device's `GpuTargetConfig`, from its spec sheet.

XLA's GPU compiler reads the device it compiles for from a `GpuTargetConfig` (protobuf text): SM count,
shared memory, registers, memory size and bandwidth, compute capability. With the `jax[cuda12]` plugin,
`jax.experimental.topologies.get_topology_desc(..., target_config=TEXT)` turns one into abstract devices
that `jit(...).lower(...).compile()` compiles for on a machine without a GPU (`serving.aot`).

Figures are the vendors' published ones (decimal memory units as sold: 80 GB = 80e9 bytes); `bf16_flops`
is the dense tensor-core peak, not the 2:4-sparse headline figure.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    name: str  # the description string the config carries
    sm_count: int
    compute_capability: tuple[int, int]
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    l2_cache_bytes: int
    clock_ghz: float
    shared_per_sm: int  # bytes
    shared_per_block_optin: int  # bytes: the most one block may ask for
    interconnect_bandwidth: float  # bytes/s per GPU (NVLink, total)

    @property
    def sm_arch(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

    def target_config(self) -> str:
        """This device as `GpuTargetConfig` protobuf text."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {self.l2_cache_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.shared_per_block_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
runtime_version {{
  major: 12
  minor: 8
}}
device_description_str: "{self.name}"
"""


KiB = 1024
GPU_TARGETS: dict[str, GpuTarget] = {
    "h100-sxm": GpuTarget("NVIDIA H100 80GB HBM3", sm_count=132, compute_capability=(9, 0), memory_bytes=80 * 10**9,
                          memory_bandwidth=3.35e12, bf16_flops=989e12, l2_cache_bytes=50 * KiB * KiB, clock_ghz=1.98,
                          shared_per_sm=228 * KiB, shared_per_block_optin=227 * KiB, interconnect_bandwidth=900e9),
    "h200": GpuTarget("NVIDIA H200", sm_count=132, compute_capability=(9, 0), memory_bytes=141 * 10**9,
                      memory_bandwidth=4.8e12, bf16_flops=989e12, l2_cache_bytes=50 * KiB * KiB, clock_ghz=1.98,
                      shared_per_sm=228 * KiB, shared_per_block_optin=227 * KiB, interconnect_bandwidth=900e9),
    "a100-80g": GpuTarget("NVIDIA A100-SXM4-80GB", sm_count=108, compute_capability=(8, 0), memory_bytes=80 * 10**9,
                          memory_bandwidth=2.039e12, bf16_flops=312e12, l2_cache_bytes=40 * KiB * KiB, clock_ghz=1.41,
                          shared_per_sm=164 * KiB, shared_per_block_optin=163 * KiB, interconnect_bandwidth=600e9),
}


def get_target(name: str) -> GpuTarget:
    if name not in GPU_TARGETS:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(GPU_TARGETS)}")
    return GPU_TARGETS[name]
