"""Device and precision choices shared by train, decode and score."""

from __future__ import annotations

import contextlib

import torch

from .files import AttnError


def pick_device(option: str, index: int = 0) -> torch.device:
    """auto: the GPU when torch sees one, else the CPU."""
    if option == "auto":
        option = "cuda" if torch.cuda.is_available() else "cpu"
    if option == "cuda":
        if not torch.cuda.is_available():
            raise AttnError("--device cuda, but torch sees no CUDA device")
        return torch.device("cuda", index % torch.cuda.device_count())
    if option == "cpu":
        return torch.device("cpu")
    raise AttnError(f"--device must be auto, cpu or cuda, not {option!r}")


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """auto: bf16 on a GPU that has it, fp32 on the CPU. fp16 needs CUDA."""
    if dtype == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if dtype not in ("fp32", "bf16", "fp16"):
        raise AttnError(f"--dtype must be fp32, bf16, fp16 or auto, not {dtype!r}")
    if dtype == "fp16" and device.type != "cuda":
        raise AttnError("--dtype fp16 needs CUDA; use fp32 or bf16 on the CPU")
    return dtype


def inference_dtype(dtype: str, device: torch.device, beam: int) -> str:
    """For decoding: auto is bf16 on CUDA; on a CPU with native bf16 matmuls (AMX or
    AVX512-BF16) it is bf16 for beam search (1.4x the fp32 speed at the same BLEU, measured in
    benchmarks/) and fp32 for greedy search (fast enough, and bit-identical however batched)."""
    if dtype == "auto" and device.type == "cpu":
        native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return "bf16" if native and beam > 1 else "fp32"
    return resolve_dtype(dtype, device)


def autocast(device: torch.device, dtype: str):
    """Mixed precision for the forward pass; weights and optimizer state stay float32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)
