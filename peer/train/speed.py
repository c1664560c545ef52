"""How fast the inner loop runs: tokens per second and, on a known CUDA device, model FLOPs
utilization (MFU: 6 x parameters x tokens/s over the device's dense bf16 peak; Kaplan et al. 2020's
6N per token, attention left out, as nanoGPT and INTELLECT-1 report it)."""

from __future__ import annotations

# name substring -> (dense bf16 FLOP/s, memory bytes/s), vendor datasheets without sparsity. First match
# wins, so the longer names come first ("GH200" contains "H200", "L40S" contains "L4").
DEVICE_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("GH200", 989.4e12, 4.0e12),
    ("H200 NVL", 835.5e12, 4.8e12),
    ("H200", 989.4e12, 4.8e12),
    ("H100 NVL", 835.5e12, 3.9e12),
    ("H100 PCIe", 756.0e12, 2.0e12),
    ("H100", 989.4e12, 3.35e12),
    ("A100-SXM4-80GB", 312e12, 2.039e12),
    ("A100 80GB PCIe", 312e12, 1.935e12),
    ("A100", 312e12, 1.555e12),
    ("L40S", 362.05e12, 0.864e12),
    ("L4", 121e12, 0.3e12),
    ("RTX 4090", 165.2e12, 1.008e12),
    ("RTX 3090", 71e12, 0.936e12),
    ("B200", 2250e12, 8.0e12),
)


def peak_bf16(device_name: str) -> float | None:
    """The dense bf16 FLOP/s of a CUDA device by its name, or None if it is not in the table."""
    row = next((r for r in DEVICE_PEAKS if r[0] in device_name), None)
    return row[1] if row else None


def mfu(parameters: int, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilization, or None without a known peak."""
    return 6 * parameters * tokens_per_s / peak if peak else None
