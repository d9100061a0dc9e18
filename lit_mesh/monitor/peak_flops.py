"""Peak dense bf16 tensor-core FLOP/s per GPU, from the exact device name (what MFU is quoted against).

Figures from NVIDIA's datasheets, dense (the datasheets print the 2:4-sparsity figure, twice these):
  H100 SXM5 989.4 TFLOP/s, H100 PCIe 756.5, H100 NVL 835.5 (H100 Tensor Core GPU datasheet, 2023);
  H200 SXM 989.4, H200 NVL 835.5 (H200 datasheet, 2024); A100 40 GB and 80 GB, SXM and PCIe, 312
  (A100 datasheet, 2021); L40S 362.05 (L40S datasheet, 2023); B200 2,250 (HGX B200 datasheet, 2024: 4.5
  PFLOP/s FP16/BF16 with sparsity per GPU).
"""

from __future__ import annotations

# (every substring the upper-cased name must contain, FLOP/s); the first match wins. torch.cuda names:
# "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL",
# "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA L40S", "NVIDIA B200"
PEAK_BF16_DENSE_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "NVL"), 835.5e12),
    (("H100", "PCIE"), 756.5e12),
    (("H100",), 989.4e12),  # SXM5 (HBM3)
    (("H200", "NVL"), 835.5e12),
    (("H200",), 989.4e12),
    (("A100",), 312e12),
    (("L40S",), 362.05e12),
    (("B200",), 2250e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense bf16 peak of the GPU named `device_name` (torch.cuda.get_device_name), or None if not in the table."""
    name = device_name.upper()
    for needed, flops in PEAK_BF16_DENSE_FLOPS:
        if all(s in name for s in needed):
            return flops
    return None
