"""The GPU smoke's stages 0 and 1 (checks/gpu_smoke.py): the environment with the GPU's own matmul
rate, and the kernels the model's attention and loss run on.

Stage 1 forces each SDPA backend in a child process of its own (`python -m
checks.gpu_smoke_kernels --child JOBS OUT.json`): a fault in one (cuDNN's, pytorch#169849) poisons
that process's CUDA context, not the smoke's nor the other backends'.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from .gpu_smoke_common import Skip, log, run, save_progress, time_left

# ---------------------------------------------------------------------------------- stage 0


def stage_environment(args, work: Path, found: dict) -> None:
    import torch

    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    props = torch.cuda.get_device_properties(0)
    found.update({
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl")
        else None,
        "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
        "capability": list(torch.cuda.get_device_capability(0)),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "bf16_native": torch.cuda.is_bf16_supported(including_emulation=False),
        "bf16_supported_default": torch.cuda.is_bf16_supported(),
        "tf32_matmul_default": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn_default": torch.backends.cudnn.allow_tf32,
        "sdpa_flash": torch.backends.cuda.flash_sdp_enabled(),
        "sdpa_mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "sdpa_math": torch.backends.cuda.math_sdp_enabled(),
        "sdpa_cudnn": getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)(),
        "cpu_cores": os.cpu_count(), "python": sys.version.split()[0],
    })
    for name, command in (("nvidia_smi", ["nvidia-smi", "--query-gpu=name,driver_version,"
                                          "clocks.max.sm,power.limit", "--format=csv"]),
                          ("topology", ["nvidia-smi", "topo", "-m"])):
        try:
            found[name] = subprocess.run(command, capture_output=True, text=True,
                                         timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            found[name] = f"unavailable: {error}"
    found["matmul_tflops"] = matmul_rates()
    found["summary"] = (f"{found['gpu']} (sm_{''.join(map(str, found['capability']))}), torch "
                        f"{found['torch']}, CUDA {found['cuda']}, cuDNN {found['cudnn']}, NCCL "
                        f"{found['nccl']}; bf16 {found['matmul_tflops']['bf16']:.0f} TFLOP/s, "
                        f"TF32 {found['matmul_tflops']['tf32']:.0f}")


def matmul_rates(size: int = 8192, repeats: int = 10,
                 kinds: tuple[str, ...] = ("bf16", "tf32", "fp32")) -> dict:
    """The machine's own GEMM: TFLOP/s of size³ products in bf16, TF32 and fp32 (random data,
    the mean of `repeats` after warm-up): the rate a training's model FLOP/s is a share of."""
    import torch

    rates = {}
    for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                              ("fp32", torch.float32, False)):
        if name not in kinds:
            continue
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(size, size, device="cuda", dtype=dtype)
        b = torch.randn(size, size, device="cuda", dtype=dtype)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        torch.cuda.synchronize()
        rates[name] = 2 * size ** 3 * repeats / (time.perf_counter() - started) / 1e12
        torch.backends.cuda.matmul.allow_tf32 = previous
        del a, b
    torch.cuda.empty_cache()
    return rates


# ---------------------------------------------------------------------------------- stage 1

# The children's jobs: cuDNN forced, and the default dispatch (which may pick cuDNN), each alone.
CHILDREN = (("math", "efficient", "flash", "cudnn_off", "loss"), ("cudnn",), ("default",))
FORCED = ("math", "efficient", "flash", "cudnn")


def stage_kernels(args, work: Path, found: dict) -> None:
    """Each backend's results against float64 (in bf16, fp16, fp32), its time over ~50 random
    shapes (first call and repeat: review N4), which kernels the default dispatch runs, the
    fused loss in bf16 and fp16; and which --cudnn-attention setting wins."""
    import torch

    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    for jobs in CHILDREN:
        if time_left(args) < 60:
            found[",".join(jobs)] = "skipped: out of time"
            continue
        out = work / f"kernels-{'-'.join(jobs)}.json"
        out.unlink(missing_ok=True)
        try:
            completed = run([sys.executable, "-m", "checks.gpu_smoke_kernels", "--child",
                             ",".join(jobs), out], timeout=min(240, time_left(args) - 20),
                            check=False)
            how = (f"exit {completed.returncode}: "
                   + completed.stderr.decode("utf-8", "replace")[-600:])
        except subprocess.TimeoutExpired:
            how = "still running after its time"
        results = json.loads(out.read_text()) if out.exists() else {}
        for job in jobs:
            found[job] = results.get(job, f"crashed ({how})")
        log(f"       {','.join(jobs)}: {how[:200] if not results else 'done'}")
        save_progress()
    failures = [f"{backend} {call} {dtype}" for backend in FORCED
                if isinstance(found.get(backend), dict)
                for call, by_dtype in found[backend]["correctness"].items()
                for dtype, result in by_dtype.items()
                if isinstance(result, dict) and not result["ok"]]
    crashed = [job for jobs in CHILDREN for job in jobs
               if isinstance(found.get(job), str) and found[job].startswith("crashed")]
    found["wrong_results"] = failures
    found["crashed"] = crashed
    found["timing"] = {mode: found[mode]["timing"] for mode in ("default", "cudnn_off",
                                                                 "cudnn", "efficient", "flash")
                       if isinstance(found.get(mode), dict) and "timing" in found[mode]}
    found["cudnn_attention"] = cudnn_verdict(found["timing"])
    loss = found.get("loss") if isinstance(found.get("loss"), dict) else None
    default = found.get("default") if isinstance(found.get("default"), dict) else {}
    verdict = found["cudnn_attention"]
    found["summary"] = (
        f"SDPA default: {default.get('kernels', 'n/a')}; wrong results: {failures or 'none'}; "
        f"crashed: {crashed or 'none'}; --cudnn-attention: {verdict['advice']} "
        f"({verdict['why']})"
        + (f"; fused loss rel. error bf16 {loss['bf16']['loss_rel_error']:.1e}, fp16 "
           f"{loss['fp16']['loss_rel_error']:.1e}; grad_weight rows lost in fp16 "
           f"{loss['fp16']['grad_weight_rows_zeroed']}" if loss else ""))
    if failures or crashed:
        found["status"] = "FAIL"


def cudnn_verdict(timing: dict) -> dict:
    """Whether training should keep cuDNN attention off (`attn train --cudnn-attention off`):
    the default dispatch against the dispatch with cuDNN disabled, over the same shapes, first
    calls (graph builds) and repeats."""
    default, off = timing.get("default"), timing.get("cudnn_off")
    if not default or not off:
        return {"advice": "unknown", "why": "default or cudnn_off not timed"}
    extra_first = default["first_total_ms"] - off["first_total_ms"]
    repeat_ratio = default["repeat_median_ms"] / max(off["repeat_median_ms"], 1e-9)
    if not default.get("uses_cudnn"):
        return {"advice": "auto", "why": "the default dispatch does not pick cuDNN here",
                "extra_first_ms": extra_first, "repeat_ratio": repeat_ratio}
    loses = extra_first > 1000 or repeat_ratio > 1.05
    return {"advice": "off" if loses else "auto",
            "why": f"cuDNN's first calls {extra_first:+.0f} ms over {default['shapes']} shapes, "
                   f"repeats {repeat_ratio:.2f}x the other backends'",
            "extra_first_ms": extra_first, "repeat_ratio": repeat_ratio}


# ------------------------------------------------------------------------- the child's jobs


def attention_inputs(batch=64, heads=8, length=40, width=64, target_length=None, seed=0,
                     dtype=None):
    """The model's three attention calls: encoder self-attention with a key padding mask
    (B, 1, 1, S), causal decoder self-attention, cross attention with the source mask."""
    import torch

    dtype = dtype or torch.float64
    generator = torch.Generator(device="cuda").manual_seed(seed)
    target_length = target_length or length - 3

    def tensor(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float32,
                           generator=generator).to(dtype)

    lengths = torch.randint(1, length + 1, (batch,), device="cuda", generator=generator)
    lengths[0] = length
    mask = (torch.arange(length, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    source = (batch, heads, length, width)
    target = (batch, heads, target_length, width)
    return {
        "encoder": dict(q=tensor(*source), k=tensor(*source), v=tensor(*source), mask=mask,
                        causal=False),
        "decoder": dict(q=tensor(*target), k=tensor(*target), v=tensor(*target), mask=None,
                        causal=True),
        "cross": dict(q=tensor(*target), k=tensor(*source), v=tensor(*source), mask=mask,
                      causal=False),
    }


def _attention(inputs: dict, dtype, backend=None):
    """Output and input gradients of one SDPA call in `dtype`, forward and backward."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    q, k, v = (inputs[name].to(dtype).detach().requires_grad_() for name in "qkv")
    context = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
    with context:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=model_mask(inputs["mask"], dtype),
                                             is_causal=inputs["causal"])
        grad = torch.ones_like(out) / out.numel() ** 0.5
        out.backward(grad)
    return out, q.grad, k.grad, v.grad


def model_mask(keep, dtype):
    """The mask as the model passes it (`Transformer.padding_mask`): additive, 0 at the keys
    kept and -inf at padding, in the attention's dtype, its rows 8-aligned slices of a wider
    buffer; None stays None."""
    import torch

    if keep is None:
        return None
    length = keep.shape[-1]
    aligned = -(-length // 8) * 8
    mask = torch.zeros(*keep.shape[:-1], aligned, dtype=dtype, device=keep.device)[..., :length]
    return mask.masked_fill_(~keep, -float("inf"))


def backends() -> dict:
    from torch.nn.attention import SDPBackend

    found = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "flash": SDPBackend.FLASH_ATTENTION}
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        found["cudnn"] = SDPBackend.CUDNN_ATTENTION
    return found


def correctness(backend_name: str) -> dict:
    """One forced backend's output and gradients against float64 math, per call and dtype."""
    import torch
    from torch.nn.attention import SDPBackend

    backend = backends()[backend_name]
    tolerance = {"bf16": 3e-2, "fp16": 4e-3, "fp32": 2e-3}
    found: dict = {}
    for call, inputs in attention_inputs().items():
        reference = [t.double() for t in _attention(inputs, torch.float64, SDPBackend.MATH)]
        found[call] = {}
        for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                                  ("fp32", torch.float32)):
            try:
                results = [t.double() for t in _attention(inputs, dtype, backend)]
            except RuntimeError as error:
                found[call][dtype_name] = f"unsupported: {str(error).splitlines()[0][:90]}"
                continue
            errors = [float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))
                      for got, want in zip(results, reference)]
            finite = all(bool(torch.isfinite(got).all()) for got in results)
            found[call][dtype_name] = {"out_rel_error": errors[0],
                                       "grad_rel_error": max(errors[1:]),
                                       "ok": finite and max(errors) < tolerance[dtype_name]}
    return found


def random_shapes(count: int = 50, seed: int = 0) -> list[tuple[int, int, int]]:
    """(batch, source length, target length) as attn's length-bucketed batches bring them: a
    token budget of 3,125 to 25,000 cut into sentences of 4 to 120 pieces."""
    import random

    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        source = rng.randint(4, 120)
        target = max(2, source + rng.randint(-4, 12))
        budget = rng.choice((3125, 6250, 12500, 25000))
        shapes.append((max(1, budget // max(source, target)), source, target))
    return shapes


def shape_timings(mode: str, count: int = 50) -> dict:
    """Forward and backward of the three calls in bf16 over `count` random shapes under one
    dispatch `mode` (a forced backend, `default`, or `cudnn_off`: the default with cuDNN
    disabled, what `--cudnn-attention off` does): each shape's first call (a cuDNN graph is
    built per new shape) and its repeat, in ms of wall time with the GPU drained."""
    import torch

    backend = backends().get(mode)
    if mode == "cudnn_off" and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    first, repeat, unsupported = [], [], 0
    for index, (batch, source, target) in enumerate(random_shapes(count)):
        inputs = attention_inputs(batch=batch, length=source, target_length=target, seed=index,
                                  dtype=torch.bfloat16)
        for call in inputs.values():  # a call the forced backend refuses is left out
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                started = time.perf_counter()
                try:
                    _attention(call, torch.bfloat16, backend)
                except RuntimeError:
                    unsupported += 1
                    break
                torch.cuda.synchronize()
                times.append((time.perf_counter() - started) * 1e3)
            if len(times) == 2:
                first.append(times[0])
                repeat.append(times[1])
    if mode == "cudnn_off" and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(True)
    found = {"shapes": count, "calls_timed": len(first), "calls_unsupported": unsupported,
             "first_total_ms": round(sum(first), 1), "repeat_total_ms": round(sum(repeat), 1),
             "first_max_ms": round(max(first), 2) if first else None,
             "repeat_median_ms": round(sorted(repeat)[len(repeat) // 2], 3) if repeat else None}
    if mode == "default":
        found["uses_cudnn"] = any("cudnn" in name.lower() for name in default_kernels())
    return found


def default_kernels() -> list[str]:
    """The kernels the default dispatch runs for the three calls in bf16."""
    import torch

    names = set()
    for inputs in attention_inputs(dtype=torch.bfloat16).values():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            _attention(inputs, torch.bfloat16)
            torch.cuda.synchronize()
        names |= {event.key for event in profile.key_averages()
                  if re.search(r"flash|fmha|efficient|attention|cudnn|sdpa|softmax", event.key,
                               re.I)}
    return sorted(name[:90] for name in names)[:8]


def fused_loss_precision(rows: int = 4096, width: int = 512, vocab: int = 37000) -> dict:
    """The fused projected loss under bf16 and fp16 autocast against the float64 formula on a
    peaked distribution: errors of the loss and of both gradients, and the rows of the output
    matrix whose gradient comes out all zero though float64's is not (fp16's unscaled
    p - onehot flushing to zero: review F6); also the time of one forward and backward."""
    import torch

    from attn_cli.loss import label_smoothed_loss, projected_label_smoothed_loss

    generator = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(rows, width, device="cuda", generator=generator) * 3
    weight = torch.randn(vocab, width, device="cuda", generator=generator) * 0.1
    target = torch.randint(4, vocab, (rows,), device="cuda", generator=generator)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss64, _ = label_smoothed_loss(h64 @ w64.T, target, 0.1, pad_id=-100)
    loss64.backward()
    reference = (float(loss64), h64.grad, w64.grad)
    found = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cuda", dtype=dtype):
            loss, _ = projected_label_smoothed_loss(h, w, target, 0.1)
        loss.backward()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            h.grad = w.grad = None
            with torch.autocast("cuda", dtype=dtype):
                again, _ = projected_label_smoothed_loss(h, w, target, 0.1)
            again.backward()
        torch.cuda.synchronize()
        fused_ms = (time.perf_counter() - started) / 5 * 1e3
        zero_rows = (w.grad.abs().amax(dim=1) == 0) & (reference[2].abs().amax(dim=1) > 0)
        found[name] = {
            "loss_rel_error": abs(float(loss) - reference[0]) / abs(reference[0]),
            "grad_hidden_rel_error": float((h.grad.double() - reference[1]).norm()
                                           / reference[1].norm()),
            "grad_weight_rel_error": float((w.grad.double() - reference[2]).norm()
                                           / reference[2].norm()),
            "grad_weight_rows_zeroed": int(zero_rows.sum()),
            "fused_fwd_bwd_ms": fused_ms,
        }
    return found


def child(jobs: list[str], out: Path) -> None:
    """Run the jobs in this process, the results rewritten after each (a crash keeps the
    earlier ones)."""
    results: dict = {}
    for job in jobs:
        started = time.perf_counter()
        if job == "loss":
            result = fused_loss_precision()
        elif job == "default":
            result = {"kernels": default_kernels(), "timing": shape_timings("default")}
        elif job == "cudnn_off":
            result = {"timing": shape_timings("cudnn_off")}
        elif job not in backends():
            result = "unavailable in this torch"
        else:
            result = {"correctness": correctness(job)}
            if job != "math":
                result["timing"] = shape_timings(job)
        if isinstance(result, dict):
            result["seconds"] = round(time.perf_counter() - started, 1)
        results[job] = result
        temporary = out.with_suffix(".tmp")
        temporary.write_text(json.dumps(results, default=str))
        os.replace(temporary, out)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2].split(","), Path(sys.argv[3]))
    else:
        sys.exit("usage: python -m checks.gpu_smoke_kernels --child JOB[,JOB...] OUT.json "
                 "(run by checks/gpu_smoke.py's stage 1)")
