"""Print the device line a GPU figure is reported with: GPU, driver, CUDA, torch, triton.

One ``key value`` per line (``gpu``, ``driver``, ``cuda``, ``torch``, ``triton``);
``unknown`` where a part is absent (no GPU, no ``nvidia-smi``, no triton).
"""

from __future__ import annotations

import subprocess


def _nvidia_smi(query: str) -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"


def device_facts() -> dict[str, str]:
    """The device line's parts."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "unknown"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (cpu)"
    return {
        "gpu": gpu, "driver": _nvidia_smi("driver_version"),
        "memory": _nvidia_smi("memory.total"), "cuda": str(torch.version.cuda),
        "torch": torch.__version__, "triton": triton_version,
    }  # fmt: skip


if __name__ == "__main__":
    for key, value in device_facts().items():
        print(f"{key} {value}")
