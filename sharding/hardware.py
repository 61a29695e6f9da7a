"""Known GPUs for layout arithmetic: spec-sheet figures, decimal units (1 GB = 1e9 B).

Bandwidths are per GPU and per direction as vendors quote them for one card
(NVLink: the card's total NVLink bandwidth; PCIe: one x16 link). Compute is
the *dense* BF16 tensor-core peak: the headline figures with 2:4 sparsity are
twice these and never apply to ordinary checkpoints. Real SKUs and clocks
vary; the planner's conclusions are about ratios, which these preserve.

Collective latency floors are per collective (launch + synchronisation), the
part of a small all-reduce that does not shrink with its payload.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    nvlink_bandwidth: float | None  # bytes/s per GPU; None: no NVLink
    pcie_bandwidth: float  # bytes/s, one direction of an x16 link
    nvlink_latency: float = 5e-6  # s per collective
    pcie_latency: float = 25e-6  # s per collective

    @property
    def ridge_point(self) -> float:
        """FLOP per byte at which the compute roof meets the memory roof."""
        return self.bf16_flops / self.hbm_bandwidth

    def link(self, interconnect: str) -> tuple[float, float]:
        """(bandwidth, per-collective latency) of "nvlink" or "pcie"."""
        if interconnect == "nvlink":
            if self.nvlink_bandwidth is None:
                raise ValueError(f"{self.name} has no NVLink; use --interconnect pcie")
            return self.nvlink_bandwidth, self.nvlink_latency
        if interconnect == "pcie":
            return self.pcie_bandwidth, self.pcie_latency
        raise ValueError(f"interconnect must be 'nvlink' or 'pcie', got {interconnect!r}")


GPUS: dict[str, GPU] = {
    "h100-sxm": GPU("H100 SXM 80GB", hbm_bytes=80e9, hbm_bandwidth=3.35e12, bf16_flops=989e12,
                    nvlink_bandwidth=900e9, pcie_bandwidth=64e9),
    "h100-pcie": GPU("H100 PCIe 80GB", hbm_bytes=80e9, hbm_bandwidth=2.0e12, bf16_flops=756e12,
                     nvlink_bandwidth=600e9, pcie_bandwidth=64e9),
    "h200": GPU("H200 SXM 141GB", hbm_bytes=141e9, hbm_bandwidth=4.8e12, bf16_flops=989e12,
                nvlink_bandwidth=900e9, pcie_bandwidth=64e9),
    "a100-80gb": GPU("A100 SXM 80GB", hbm_bytes=80e9, hbm_bandwidth=2.039e12, bf16_flops=312e12,
                     nvlink_bandwidth=600e9, pcie_bandwidth=32e9),
    "l4": GPU("L4 24GB", hbm_bytes=24e9, hbm_bandwidth=300e9, bf16_flops=121e12,
              nvlink_bandwidth=None, pcie_bandwidth=32e9),
}

ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "h200-sxm": "h200"}


def get_gpu(name: str) -> GPU:
    key = name.lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(f"unknown device {name!r}; known: {sorted(GPUS)}")
    return GPUS[key]
