"""Device and precision choices shared by train, decode and score, and the packed weights that
decoding on a CPU runs with (oneDNN's blocked layout, prepared once per model)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

from .errors import AttnError
from .formats import BATCH_TOKENS, GPU_BATCH_TOKENS


def pick_device(option: str, index: int = 0) -> torch.device:
    """auto: the GPU when torch sees one, else the CPU. `index`: which of the GPUs torch sees
    (a training process's local rank)."""
    if option == "auto":
        option = "cuda" if torch.cuda.is_available() else "cpu"
    if option == "cuda":
        if not torch.cuda.is_available():
            raise AttnError("--device cuda, but torch sees no CUDA device")
        if index >= torch.cuda.device_count():
            raise AttnError(f"GPU {index} asked for, but torch sees {torch.cuda.device_count()} "
                            "(CUDA_VISIBLE_DEVICES)")
        return torch.device("cuda", index)
    if option == "cpu":
        return torch.device("cpu")
    raise AttnError(f"--device must be auto, cpu or cuda, not {option!r}")


def gpu_has_native_bf16(device: torch.device) -> bool:
    """bf16 tensor cores: compute capability 8.0 (A100) and later. torch's is_bf16_supported()
    also says yes below it (V100, T4), where bf16 is emulated and slower than fp32."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def search_batch_tokens(device: torch.device) -> int:
    """The default token budget of a search batch (decode, parse, validation) on `device`."""
    return GPU_BATCH_TOKENS if device.type == "cuda" else BATCH_TOKENS


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """auto: bf16 on a GPU that has it natively, else fp32 (fp16 is a choice made knowingly:
    it needs loss scaling). fp16 needs CUDA."""
    if dtype == "auto":
        return "bf16" if device.type == "cuda" and gpu_has_native_bf16(device) else "fp32"
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


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) and oneDNN may use it
    (ONEDNN_MAX_CPU_ISA can hold it to AVX2 or AVX-512 core). Without it oneDNN emulates bf16:
    measured ~18x slower than float32 for training on an AVX2-only CPU."""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if limit != "ALL" and not any(isa in limit for isa in ("BF16", "AMX", "FP16", "AVX10")):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: what oneDNN says it supports
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def warn_if_bf16_is_emulated(dtype: str, device: torch.device, command: str) -> None:
    """One line on stderr when bf16 is asked for on a CPU or GPU that would emulate it."""
    if dtype == "bf16" and device.type == "cuda" and not gpu_has_native_bf16(device):
        name = torch.cuda.get_device_name(device)
        print(f"{command}: warning: --dtype bf16 on {name}, which has no bf16 tensor cores "
              "(compute capability below 8.0): emulated, slower than fp32; fp16 or fp32 is the "
              "fast choice", file=sys.stderr, flush=True)
    if dtype == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        print(f"{command}: warning: --dtype bf16 on a CPU without native bf16 (AVX512-BF16 or "
              "AMX): emulated, about 18x slower than fp32 (measured on an AVX2 CPU); fp32 is the "
              "fast choice", file=sys.stderr,
              flush=True)


def autocast(device: torch.device, dtype: str):
    """Mixed precision for the forward pass; weights and optimizer state stay float32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


# ------------------------------------------------------------- CPU inference: packed weights


class PackedLinear(nn.Module):
    """x W^T + b, then ReLU if asked, through oneDNN with W reordered once into its blocked
    layout: 10-20% faster than the dense weight's matmul on a big batch and up to 2.5x on a few
    rows (the end of a search batch), and each row's result is the same whatever the batch
    size (measured: benchmarks/README.md). Inference only: the weight is a copy, not a
    parameter."""

    ROWS_HINT = 128  # the batch size oneDNN picks the layout for; any batch size works

    def __init__(self, weight: Tensor, bias: Tensor | None = None, activation: str = "none"):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.ROWS_HINT)
        self.bias = None if bias is None else bias.detach().clone()
        self.activation = activation  # oneDNN's post-op: "none", "relu" or "swish"

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, self.activation,
                                                  [], "")


class PackedFeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 with packed weights, the ReLU (or swish) fused into
    the first."""

    def __init__(self, ffn: nn.Module):
        super().__init__()
        self.inner = PackedLinear(ffn.inner.weight, ffn.inner.bias, ffn.activation)
        self.outer = PackedLinear(ffn.outer.weight, ffn.outer.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(self.inner(x))


def packed_linear_works() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 builds do; others may not)."""
    try:
        weight, x = torch.ones(4, 8), torch.ones(2, 8)
        return bool(torch.equal(PackedLinear(weight)(x), x @ weight.T))
    except (AttributeError, RuntimeError):
        return False


def pack_for_cpu_inference(model: nn.Module) -> nn.Module:
    """Swap the model's linear layers (and feed-forward blocks, and the output projection) for
    packed ones, in place, when this torch build can: for decoding on a CPU, never training."""
    from .model import FeedForward

    if not packed_linear_works():
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FeedForward):
                setattr(parent, name, PackedFeedForward(child))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
    model.output_projection = PackedLinear(model.tgt_embed.weight, model.output_bias)
    return model


def quantize_for_cpu_inference(model: nn.Module) -> nn.Module:
    """`--int8`: every linear layer and the output projection (a copy of the tied embedding;
    the embedding lookups stay float32) as torch's dynamic int8 linear layers (its quantized
    engine: fbgemm on x86, qnnpack on ARM): weights int8 per output channel, each call's
    input quantized to uint8 by its own range, int32 accumulation, float32 output. 2-3x faster
    than the float32 matmuls on the shapes of a search; an option, never the default: the
    input's range, and so a row's result, depends on the rows batched with it, and the BLEU
    moves (benchmarks/README.md)."""
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    projection = nn.Linear(model.config.d_model, model.config.tgt_vocab_size,
                           bias=model.output_bias is not None)
    with torch.no_grad():
        projection.weight.copy_(model.tgt_embed.weight)
        if model.output_bias is not None:
            projection.bias.copy_(model.output_bias)
    model.output_projection = projection
    with warnings.catch_warnings():  # torch marks eager quantization as moving to torchao
        warnings.simplefilter("ignore")
        quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8,
                         inplace=True)
    return model
