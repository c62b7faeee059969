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


def inference_dtype(dtype: str, device: torch.device) -> str:
    """For decoding: auto is bf16 on CUDA and fp32 on the CPU, where the output is then the
    same however the lines are batched. `--dtype bf16` on a CPU with native bf16 (AMX,
    AVX512-BF16) converts the weights once and runs beam search 1.1-1.3x faster, BLEU within
    ±0.05 (benchmarks/README.md), but a few lines may differ with the batching."""
    if dtype == "bf16" and device.type == "cpu" and \
            not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise AttnError("--dtype bf16: this CPU has no native bf16 matmuls; use fp32")
    return resolve_dtype(dtype, device)


def autocast(device: torch.device, dtype: str):
    """Mixed precision for the forward pass; weights and optimizer state stay float32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)
