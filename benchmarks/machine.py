"""What machine a benchmark ran on: figures are comparable only within one run on one machine,
and a report must say which CPU (model, widest matmul ISA) it came from."""

from __future__ import annotations

import platform
import re
from pathlib import Path


def cpu_info() -> tuple[str, str]:
    """The CPU's model name and its widest matmul ISA: AMX, AVX-512 (with or without BF16) or
    AVX2, from /proc/cpuinfo (the processor string elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), "unknown"
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    flags = set(flags.group(1).split()) if flags else set()
    if flags & {"amx_bf16", "amx_tile"}:
        isa = "AMX"
    elif "avx512f" in flags:
        isa = "AVX-512+BF16" if "avx512_bf16" in flags else "AVX-512 (no BF16)"
    else:
        isa = "AVX2" if "avx2" in flags else "pre-AVX2"
    return (name.group(1).strip() if name else platform.machine()), isa
