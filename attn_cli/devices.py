"""Device and precision choices shared by train, decode and score, and the model that decoding
and scoring run: a copy of the loaded one made for the device (`inference_model`), its weights
converted once, on a CPU in oneDNN's packed layout (or int8, `--int8`)."""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from .errors import AttnError, say
from .formats import BATCH_TOKENS, CUDNN_ATTENTION, GPU_BATCH_TOKENS
from .model import FeedForward, Transformer


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


def choose_cudnn_attention(option: str, device: torch.device) -> bool:
    """off (the default of every command): scaled_dot_product_attention never picks cuDNN's
    kernels on CUDA; auto leaves torch's choice. From torch 2.9 with cuDNN 9.x on an H100 torch
    prefers them, and cuDNN builds a graph for every new (batch, source, target) shape, which
    length-bucketed batches and a growing decoder bring by the thousand. Measured on an H100
    (torch 2.11, cuDNN 9.19; benchmarks/README.md, gpu_smoke.py): base on WMT-shaped batches
    trained at 61-68k target tokens/s with cuDNN's kernels and 270-300k without; first calls of
    50 shapes cost 13 s more and their repeats 2.4x the other kernels'; a beam-4 decode of the
    test set ran 8% faster without. On a CPU there is nothing to choose. Returns whether it
    turned them off."""
    if option not in CUDNN_ATTENTION:
        raise AttnError(f"--cudnn-attention must be one of {', '.join(CUDNN_ATTENTION)}, not "
                        f"{option!r}")
    if option == "auto" or device.type != "cuda":
        return False
    if not hasattr(torch.backends.cuda, "enable_cudnn_sdp"):  # a torch without cuDNN attention
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


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
    AVX512-BF16) converts the weights once and runs beam search faster, BLEU almost unmoved
    (benchmarks/README.md), but a few lines may differ with the batching."""
    if dtype == "bf16" and device.type == "cpu" and \
            not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise AttnError("--dtype bf16: this CPU has no native bf16 matmuls; use fp32")
    return resolve_dtype(dtype, device)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) and oneDNN may use it
    (ONEDNN_MAX_CPU_ISA can hold it to AVX2 or AVX-512 core). Without it oneDNN emulates bf16,
    many times slower than float32 (benchmarks/README.md)."""
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
        say(f"{command}: warning: --dtype bf16 on {name}, which has no bf16 tensor cores "
            "(compute capability below 8.0): emulated, slower than fp32; fp16 or fp32 is the "
            "fast choice")
    if dtype == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        say(f"{command}: warning: --dtype bf16 on a CPU without native bf16 (AVX512-BF16 or "
            "AMX): oneDNN emulates it, many times slower than fp32; use fp32 (the default) "
            "here")


def autocast(device: torch.device, dtype: str):
    """Mixed precision for the forward pass; weights and optimizer state stay float32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


# ----------------------------------------------------------------- the model made for inference

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LINEARS = ("dense", "packed", "int8")


# The largest output projection packed for a CPU (bytes): packing copies the matrix, which the
# embedding lookups still need as it is. NLLB-200's 256,206 × 1024 (1 GB in float32) stays dense:
# a second gigabyte for a faster projection would put its memory at 1.4x its weights.
PACKED_PROJECTION_BYTES = 256 << 20
# The largest model whose layers are packed for a CPU (bytes of weights). A model file is
# read through one memory map whose pages stay resident once read, so a packed copy of each
# layer adds to them: NLLB-200-distilled-600M (2.46 GB) peaked at 2.07x its weights packed
# (benchmarks/README.md, `nllb_shape`), where its layers, large enough for torch's dense matmul
# to run at the memory's speed, gain little from the packed layout (made for small models' many
# small calls: the demo's, `base`).
PACKED_MODEL_BYTES = 1 << 30
# The largest model (bytes of weights) searched by default, on a CPU, one batch per thread with
# one torch thread each (`translator.search_workers`); a larger one is searched by one worker of
# every thread. Each decoder step reads the decoder's weights and the output projection, and a
# large model's step is bound by the memory's speed: batches searched side by side each read
# them, where one batch of all the threads reads them once. NLLB-200-distilled-600M's shape on
# 2 cores: greedy 1.20x faster with one worker, beam 4 as fast at less memory (benchmarks/
# README.md, `nllb_shape`); the demo's and `base` are faster a batch per thread.
LARGE_MODEL_BYTES = 1 << 30


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's weights (a tied matrix once)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in model.parameters())


def inference_model(model: Transformer, device: torch.device, dtype: str = "fp32",
                    linears: str = "dense", release: bool = False) -> Transformer:
    """A new model computing what `model` computes, for decoding and scoring: on `device`, in
    eval mode, without gradients, its weights in `dtype` (fp32, bf16, fp16: converted once,
    rather than cast at every call as autocast does), its linear layers and its output
    projection `linears`: "dense" (torch's), "packed" (oneDNN's blocked layout, a CPU:
    `PackedLinear`; dense where this torch build has none) or "int8" (`--int8`, a CPU:
    `int8_linears`).

    `model` is left as it was, trainable and savable. The new model shares every tensor it
    takes unchanged (all of them when nothing is converted or packed; else the embeddings), so
    that a caller dropping `model` keeps a single copy of each weight; training `model` further
    would change the shared ones. `release`: the caller gives `model` up, its tensors moved to
    the meta device as soon as the new model holds them, so that each dense weight can be freed
    as its packed or int8 copy is made (a weight read from a memory-mapped file keeps its pages
    while the file stays mapped: hence `PACKED_MODEL_BYTES`)."""
    if linears not in LINEARS:
        raise ValueError(f"linears must be one of {', '.join(LINEARS)}, not {linears!r}")
    if linears == "packed" and not packed_linear_works():
        linears = "dense"
    if linears == "packed" and weight_bytes(model) > PACKED_MODEL_BYTES:
        linears = "dense"
    config, precision = model.config, TORCH_DTYPES[dtype]
    state, converted = {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in converted:  # a tied matrix once
            converted[id(tensor)] = tensor.detach().to(
                device, precision if tensor.is_floating_point() else None)
        state[name] = converted[id(tensor)]
    # The output projection: the target embedding matrix (and bias) as its linear layers
    projection = None
    embedding, bias = state["tgt_embed.weight"], state.get("output_bias")
    if linears == "packed" and \
            embedding.numel() * embedding.element_size() <= PACKED_PROJECTION_BYTES:
        projection = PackedLinear(embedding, bias)
    elif linears == "int8":  # made int8 below, with the other linear layers
        projection = nn.Linear(config.d_model, config.tgt_vocab_size, bias=bias is not None,
                               device="meta")
        state["output_projection.weight"] = embedding
        if bias is not None:
            state["output_projection.bias"] = bias
    with torch.device("meta"):  # no memory: the tensors above replace every parameter
        prepared = Transformer(config, output_projection=projection)
    prepared.load_state_dict(state, assign=True)
    if release:  # the new model holds the only references: packing frees each dense weight
        model.to("meta")
    del state, converted, embedding, bias
    # The position table, made on the CPU in float32, joins the weights' device and dtype
    prepared = prepared.to(device, precision).eval().requires_grad_(False)
    if linears == "packed":
        pack_linears(prepared)
    elif linears == "int8":
        int8_linears(prepared)
        # a shortlist's rows quantized as the whole projection's are (each row on its own):
        # the same int8 rows (`model.Transformer.output_subset`)
        prepared.output_projection.for_rows = int8_linear
    return prepared


# ------------------------------------------------------------- CPU inference: packed weights


class PackedLinear(nn.Module):
    """x W^T + b, then ReLU if asked, through oneDNN with W reordered once into its blocked
    layout: faster than the dense weight's matmul, most of all on the few rows at the end of a
    search batch, and each row's result is the same whatever the batch size
    (benchmarks/README.md). Inference only: the weight is a copy, not a parameter."""

    ROWS_HINT = 128  # the batch size oneDNN picks the layout for; any batch size works

    def __init__(self, weight: Tensor, bias: Tensor | None = None, activation: str = "none"):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.ROWS_HINT)
        self.bias = None if bias is None else bias.detach().clone()
        self.activation = activation  # oneDNN's post-op: "none", "relu" or "swish"

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, self.activation,
                                                  [], "")

    def for_rows(self, weight: Tensor, bias: Tensor | None) -> "PackedLinear":
        """A packed layer of the same kind for another weight (the rows of a vocabulary
        shortlist: `model.OutputSubset`)."""
        return PackedLinear(weight, bias, self.activation)


class PackedFeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 with packed weights, the ReLU (or swish) fused into
    the first."""

    def __init__(self, ffn: FeedForward):
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


def pack_linears(module: nn.Module) -> None:
    """Every linear layer (and feed-forward block) of `module` swapped for its packed
    counterpart, in place: for the model `inference_model` is making, never a caller's."""
    for name, child in module.named_children():
        if isinstance(child, FeedForward):
            setattr(module, name, PackedFeedForward(child))
        elif isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            pack_linears(child)


# ---------------------------------------------------------------------- CPU inference: int8


def int8_linear(weight: Tensor, bias: Tensor | None) -> nn.Module:
    """x W^T + b as `int8_linears` makes it of an nn.Linear with this weight and bias."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    holder = nn.Sequential(layer)
    int8_linears(holder)
    return holder[0]


def int8_linears(module: nn.Module) -> None:
    """`--int8`: every linear layer of `module` as torch's dynamic int8 linear layer, in place
    (for the model `inference_model` is making, never a caller's). Its quantized engine
    (fbgemm on x86, qnnpack on ARM) keeps weights int8 per output channel, quantizes each
    call's input to uint8 by its own range, accumulates in int32 and returns float32. Faster
    than the float32 matmuls on the shapes of a search; an option, never the default: the
    input's range, and so a row's result, depends on the rows batched with it, and the BLEU
    moves (benchmarks/README.md). The output projection is an int8 copy of the tied embedding
    matrix, whose lookups stay float32."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():  # torch marks eager quantization as moving to torchao
        warnings.simplefilter("ignore")
        quantize_dynamic(module, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8,
                         inplace=True)
