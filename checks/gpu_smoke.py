"""The first run on a GPU: does attn work there, and what does it cost?

    python -m checks.gpu_smoke OUT                      # every stage this machine can run
    python -m checks.gpu_smoke OUT --stages 0,2,3,7,8   # some of them
    python -m checks.gpu_smoke OUT --deadline 540       # skip what would not end in time

Stages (after §5 of the project's GPU review of 14bcb5c), each one `PASS`/`FAIL`/`SKIP` line on
stderr with its numbers, and OUT/stage-N.json with everything it measured; a table closes:

0  environment: torch, CUDA, cuDNN, NCCL, the GPU, bf16 without emulation, TF32 and SDPA flags,
   and the machine's own bf16/TF32 matmul rate (the reference a training speed is a share of)
1  kernels: the model's three attention calls under each SDPA backend, forward and backward
   against float64; which backend the default dispatch picks; the fused loss against the
   formula in bf16 and fp16 (and which output-layer gradient rows fp16 zeroes: review F6)
2  data: `attn vocab` and `attn binarize` on the bundled Multi30k, as the demo does
3  one GPU: `train --preset base --dtype bf16` (tokens/s, ms/step, validation seconds, peak
   memory), then short runs with --max-tokens 4096, fp16 and fp32; a sync audit (the
   host-device syncs of a step and the attn lines that cause them); a profile of three steps
   (the share of the time the GPU is busy; a Chrome trace in OUT)
4  stop, resume, average: SIGTERM mid-run, --resume to the end, compared with the same run
   uninterrupted and with itself run twice (what "resumed = uninterrupted" means on a GPU)
5-6 several GPUs (torchrun, NCCL, failure paths): SKIP with one GPU
7  decoding: the test set at beam 4 in bf16 and fp32 on the GPU and fp32 on the CPU (lines
   identical, BLEU), batch sizes, --stop best-ends, greedy; syncs per search step; the review's
   F3 probe (bf16 decoding past the position table)
8  score -m on the GPU against the CPU; a toy parser trained on the GPU, parsed with --constrain
9  error lines: --device cuda with no GPU visible; more processes than GPUs

Results go to OUT/results.json (rewritten after each stage), the profile's trace to OUT. Work
files go to --work (default $TMPDIR/attn-gpu-smoke); a second call with the same --work reuses
the data and the trained model when they are there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

from benchmarks._harness import BUNDLED_DATA as BUNDLED
from benchmarks._harness import attn_command as _attn
from benchmarks._harness import log

STARTED = time.monotonic()


class Skip(Exception):
    """A stage that cannot run here (why in the message)."""


def attn_command(*args) -> list[str]:
    return [*_attn(), *map(str, args)]


def run(args: list, timeout: float = 600, env: dict | None = None, stdin=None,
        check: bool = True) -> subprocess.CompletedProcess:
    """A command; its stderr's tail in the log when it fails."""
    started = time.monotonic()
    completed = subprocess.run(list(map(str, args)), capture_output=True, timeout=timeout,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                               stdin=stdin)
    completed.seconds = time.monotonic() - started
    if check and completed.returncode != 0:
        tail = completed.stderr.decode("utf-8", "replace")[-3000:]
        raise RuntimeError(f"exit {completed.returncode}: {' '.join(map(str, args[2:]))}\n{tail}")
    return completed


# A runner for `attn` in a process of its own that also records what only that process knows:
# the peak GPU memory, and (ATTN_SMOKE_SYNCS) every host-device sync after the first steps,
# with the attn line that caused it, and (ATTN_SMOKE_PROFILE) a profile of three steps.
RUNNER = textwrap.dedent(r'''
    import json, os, sys, time, traceback, warnings
    import torch
    report = {"syncs": [], "steps": 0}
    out = os.environ["ATTN_SMOKE_REPORT"]

    def attn_frame():
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "attn_cli" in frame.filename and "warnings" not in frame.filename:
                return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
        return "outside attn_cli"

    if os.environ.get("ATTN_SMOKE_SYNCS"):
        warnings.simplefilter("always")
        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message).lower():
                report["syncs"].append({"step": report["steps"], "where": attn_frame(),
                                        "what": str(message)[:120]})
        warnings.showwarning = show

    def hook_steps():
        import attn_cli.train.loop as training
        step_function = training._step
        profile_from = int(os.environ.get("ATTN_SMOKE_PROFILE", "0"))
        state = {}
        def counted(run, step, *args, **kwargs):
            if os.environ.get("ATTN_SMOKE_SYNCS") and report["steps"] == 2:
                torch.cuda.set_sync_debug_mode("warn")
            if profile_from and step == profile_from:
                torch.cuda.synchronize()
                state["profile"] = torch.profiler.profile(activities=[
                    torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                state["profile"].__enter__()
                state["wall"] = time.perf_counter()
            result = step_function(run, step, *args, **kwargs)
            report["steps"] += 1
            if profile_from and step == profile_from + 2:
                torch.cuda.synchronize()
                wall = time.perf_counter() - state["wall"]
                state["profile"].__exit__(None, None, None)
                report["profile"] = profile_summary(state["profile"], wall)
            return result
        training._step = counted

    def profile_summary(profile, wall):
        # GPU time: the kernels' own device time (one stream: they do not overlap).
        totals = {}
        for event in profile.key_averages():
            device_time = getattr(event, "self_device_time_total",
                                  getattr(event, "self_cuda_time_total", 0))
            if device_time:
                totals[event.key] = device_time
        busy_us = sum(totals.values())
        trace = os.environ.get("ATTN_SMOKE_TRACE")
        if trace:
            profile.export_chrome_trace(trace)
        top = sorted(totals.items(), key=lambda item: -item[1])[:12]
        return {"wall_ms": wall * 1e3, "gpu_busy_ms": busy_us / 1e3,
                "busy_fraction": busy_us / 1e6 / wall,
                "top_kernels_ms": {name[:80]: t / 1e3 for name, t in top}}

    if os.environ.get("ATTN_SMOKE_SYNCS") or os.environ.get("ATTN_SMOKE_PROFILE"):
        hook_steps()
    if os.environ.get("ATTN_SMOKE_SEARCH_SYNCS"):
        import attn_cli.model as model_module
        decode_step = model_module.Transformer.decode_step
        def counted_step(self, *args, **kwargs):
            report["steps"] += 1
            if report["steps"] == 3:
                torch.cuda.set_sync_debug_mode("warn")
            return decode_step(self, *args, **kwargs)
        model_module.Transformer.decode_step = counted_step
        warnings.simplefilter("always")
        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message).lower():
                report["syncs"].append({"step": report["steps"], "where": attn_frame()})
        warnings.showwarning = show
    from attn_cli.cli import main
    try:
        main(sys.argv[1:])
    finally:
        if torch.cuda.is_available():
            report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            report["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        with open(out, "w") as handle:
            json.dump(report, handle)
''')


def run_attn(work: Path, name: str, *args, env: dict | None = None, timeout: float = 600,
             stdin=None, check: bool = True) -> tuple[subprocess.CompletedProcess, dict]:
    """`attn ARGS` through RUNNER: (the process, its report)."""
    runner = work / "runner.py"
    runner.write_text(RUNNER)
    report_path = work / f"{name}.report.json"
    report_path.unlink(missing_ok=True)
    completed = run([sys.executable, runner, *args], timeout=timeout, stdin=stdin, check=check,
                    env={"ATTN_SMOKE_REPORT": str(report_path), **(env or {})})
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    return completed, report


def metrics_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_figures(run_dir: Path) -> dict:
    """tokens/s (median of the rows after the first), ms per step between rows with no save
    between them, validation seconds, the last loss and scores."""
    rows = metrics_rows(run_dir)
    train_rows = [row for row in rows if "tokens_per_s" in row]
    steady = train_rows[1:] or train_rows
    rates = sorted(row["tokens_per_s"] for row in steady)
    step_ms = []
    for before, after in zip(train_rows, train_rows[1:]):
        if "valid_s" not in before and "valid_s" not in after and after["step"] > before["step"]:
            step_ms.append(1e3 * (after["elapsed_s"] - before["elapsed_s"])
                           / (after["step"] - before["step"]))
    step_ms.sort()
    figures = {
        "steps": rows[-1]["step"] if rows else 0,
        "tgt_tokens_per_s": rates[len(rates) // 2] if rates else None,
        "src_tokens_per_s": sorted(r["src_tokens_per_s"] for r in steady)[len(steady) // 2]
        if steady else None,
        "ms_per_step": step_ms[len(step_ms) // 2] if step_ms else None,
        "last_loss": train_rows[-1]["loss"] if train_rows else None,
        "valid_s": [round(row["valid_s"], 2) for row in rows if "valid_s" in row],
    }
    for key in ("valid_bleu", "valid_loss", "valid_ppl"):
        scored = [row[key] for row in rows if key in row]
        if scored:
            figures[key] = scored
    return figures


# ---------------------------------------------------------------------------------- stage 0


def stage_environment(args, work: Path) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    props = torch.cuda.get_device_properties(0)
    found = {
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
        "cpu_cores": os.cpu_count(),
    }
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
                        f"{found['torch']}, CUDA {found['cuda']}, cuDNN {found['cudnn']}; bf16 "
                        f"{found['matmul_tflops']['bf16']:.0f} TFLOP/s, TF32 "
                        f"{found['matmul_tflops']['tf32']:.0f}")
    return found


def matmul_rates(size: int = 8192, repeats: int = 10) -> dict:
    """The machine's own GEMM: TFLOP/s of size³ products in bf16, TF32 and fp32 (random data,
    the mean of `repeats` after warm-up)."""
    import torch

    rates = {}
    for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                              ("fp32", torch.float32, False)):
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
    return rates


# ---------------------------------------------------------------------------------- stage 1


def stage_kernels(args, work: Path) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    found = {"sdpa": sdpa_backends(), "sdpa_default": sdpa_default_kernels(),
             "fused_loss": fused_loss_precision()}
    failures = [f"{call} {dtype} {backend}" for call, by_dtype in found["sdpa"].items()
                for dtype, by_backend in by_dtype.items()
                for backend, result in by_backend.items()
                if isinstance(result, dict) and not result["ok"]]
    found["sdpa_failures"] = failures
    loss = found["fused_loss"]
    found["summary"] = (
        f"SDPA default: {found['sdpa_default']}; wrong results: {failures or 'none'}; fused "
        f"loss rel. error bf16 {loss['bf16']['loss_rel_error']:.1e}, fp16 "
        f"{loss['fp16']['loss_rel_error']:.1e}; grad_weight rows lost in fp16 "
        f"{loss['fp16']['grad_weight_rows_zeroed']}, bf16 "
        f"{loss['bf16']['grad_weight_rows_zeroed']}")
    if failures:
        found["status"] = "FAIL"
    return found


def attention_inputs(dtype, batch=64, heads=8, length=40, width=64, seed=0):
    """The model's three attention calls: encoder self-attention with a key padding mask
    (B, 1, 1, S), causal decoder self-attention, cross attention with the source mask."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)

    def tensor(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float64, generator=generator)

    lengths = torch.randint(1, length + 1, (batch,), device="cuda", generator=generator)
    mask = (torch.arange(length, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    target_length = length - 3
    return {
        "encoder": dict(q=tensor(batch, heads, length, width), k=tensor(batch, heads, length,
                        width), v=tensor(batch, heads, length, width), mask=mask, causal=False),
        "decoder": dict(q=tensor(batch, heads, target_length, width),
                        k=tensor(batch, heads, target_length, width),
                        v=tensor(batch, heads, target_length, width), mask=None, causal=True),
        "cross": dict(q=tensor(batch, heads, target_length, width),
                      k=tensor(batch, heads, length, width), v=tensor(batch, heads, length,
                      width), mask=mask, causal=False),
    }


def _attention(inputs: dict, dtype, backend=None):
    """Output and input gradients of one SDPA call in `dtype` (float64 reference: math)."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    q, k, v = (inputs[name].to(dtype).detach().requires_grad_() for name in "qkv")
    context = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
    with context:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=inputs["mask"],
                                             is_causal=inputs["causal"])
        grad = torch.ones_like(out) / out.numel() ** 0.5
        out.backward(grad)
    return out.double(), q.grad.double(), k.grad.double(), v.grad.double()


def sdpa_backends() -> dict:
    import torch
    from torch.nn.attention import SDPBackend

    backends = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "flash": SDPBackend.FLASH_ATTENTION}
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        backends["cudnn"] = SDPBackend.CUDNN_ATTENTION
    tolerance = {"bf16": 3e-2, "fp16": 4e-3, "fp32": 2e-3}
    found: dict = {}
    calls = attention_inputs(torch.float64)
    for call, inputs in calls.items():
        reference = _attention(inputs, torch.float64, SDPBackend.MATH)
        found[call] = {}
        for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                                  ("fp32", torch.float32)):
            found[call][dtype_name] = {}
            for name, backend in backends.items():
                try:
                    results = _attention(inputs, dtype, backend)
                except RuntimeError as error:
                    reason = str(error).splitlines()[0][:90]
                    found[call][dtype_name][name] = f"unsupported: {reason}"
                    continue
                errors = [float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))
                          for got, want in zip(results, reference)]
                finite = all(bool(torch.isfinite(got).all()) for got in results)
                found[call][dtype_name][name] = {
                    "out_rel_error": errors[0], "grad_rel_error": max(errors[1:]),
                    "ok": finite and max(errors) < tolerance[dtype_name]}
    return found


def sdpa_default_kernels() -> dict:
    """The kernels the default dispatch runs for each call in bf16, forward and backward."""
    import torch

    found = {}
    for call, inputs in attention_inputs(torch.float64).items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            _attention(inputs, torch.bfloat16)
            torch.cuda.synchronize()
        names = sorted({event.key for event in profile.key_averages()
                        if re.search(r"flash|fmha|efficient|attention|cudnn|sdpa|softmax|gemm",
                                     event.key, re.I)})
        found[call] = [name[:90] for name in names][:6]
    return found


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


# ---------------------------------------------------------------------------------- stage 2


def stage_data(args, work: Path) -> dict:
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            target = data / f"{split}.{lang}"
            if not target.exists():
                with gzip.open(BUNDLED / f"{split}.{lang}.gz", "rb") as source:
                    target.write_bytes(source.read())
    seconds = {}
    if not (data / "train.st").exists():
        seconds["vocab"] = run(attn_command("vocab", data / "train.en", data / "train.de", "-o",
                                            data / "spm.model", "--size", 8000)).seconds
        for name, split in (("train.st", "train"), ("valid.st", "val")):
            seconds[name] = run(attn_command("binarize", "--vocab", data / "spm.model",
                                             data / f"{split}.en", data / f"{split}.de", "-o",
                                             data / name)).seconds
    return {"seconds": seconds, "summary": "Multi30k vocab (8000 BPE) and binarize"
            + (f" in {sum(seconds.values()):.1f}s" if seconds else " (reused)")}


# ---------------------------------------------------------------------------------- stage 3


def stage_one_gpu(args, work: Path) -> dict:
    need_device(args)
    data = work / "data"
    common = [data / "train.st", "--preset", args.preset, "--device", args.device, "--seed", 1]
    found = {}
    run_dir = work / "base"
    if not (run_dir / "done").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        save_every = max(1, args.steps // 4)
        completed, report = run_attn(
            work, "base", "train", *common, "-o", run_dir, "--dtype", "bf16", "--valid",
            data / "valid.st", "--valid-metric", "bleu", "--valid-ref", data / "val.de",
            "--max-steps", args.steps, "--save-every", save_every, "--log-every", 20,
            "--warmup", args.warmup, "--lr-scale", args.lr_scale, "--keep-best", 3,
            timeout=max(60, min(1800, time_left(args) - 60)))
        (run_dir / "done").write_text(json.dumps(report))
        found["wall_s"] = completed.seconds
    report = json.loads((run_dir / "done").read_text())
    found["base_bf16"] = {**training_figures(run_dir), "peak_gib": report.get("peak_gib")}
    log(f"       base bf16: {found['base_bf16']}")

    variants = {"max_tokens_4096": ["--dtype", "bf16", "--max-tokens", 4096],
                "fp16": ["--dtype", "fp16"], "fp32_tf32": ["--dtype", "fp32"]}
    for name, options in variants.items():
        if time_left(args) < 120:
            found[name] = "skipped: out of time"
            continue
        if name == "fp16" and args.device != "cuda":
            found[name] = "skipped: fp16 needs CUDA"
            continue
        variant_dir = work / f"variant-{name}"
        shutil.rmtree(variant_dir, ignore_errors=True)
        completed, report = run_attn(work, name, "train", *common, "-o", variant_dir, *options,
                                     "--max-steps", args.short_steps, "--log-every", 10,
                                     "--save-every", 10_000, "--warmup", args.warmup,
                                     "--lr-scale", args.lr_scale, check=False)
        figures = training_figures(variant_dir)
        figures.update(exit=completed.returncode, peak_gib=report.get("peak_gib"))
        if completed.returncode:
            figures["stderr"] = completed.stderr.decode("utf-8", "replace")[-1500:]
        state = sorted(variant_dir.glob("checkpoint-*.state.st"))
        if name == "fp16" and state:
            from safetensors import safe_open

            with safe_open(str(state[-1]), "pt") as handle:
                figures["scaler"] = json.loads(handle.metadata().get("scaler", "{}"))
        found[name] = figures
        log(f"       {name}: {figures}")
    bf16_rows = {row["step"]: row["loss"] for row in metrics_rows(run_dir) if "loss" in row}
    fp16_rows = {row["step"]: row["loss"] for row in metrics_rows(work / "variant-fp16")
                 if "loss" in row}
    common_steps = sorted(set(bf16_rows) & set(fp16_rows))
    if common_steps:
        found["fp16_minus_bf16_loss"] = {step: fp16_rows[step] - bf16_rows[step]
                                         for step in common_steps}

    if args.device == "cuda" and time_left(args) > 90:
        audit_dir = work / "sync-audit"
        shutil.rmtree(audit_dir, ignore_errors=True)
        _, report = run_attn(work, "syncs", "train", *common, "-o", audit_dir, "--dtype",
                             "bf16", "--max-steps", 8, "--log-every", 4, "--save-every", 1000,
                             env={"ATTN_SMOKE_SYNCS": "1"}, check=False)
        in_steps = [sync for sync in report.get("syncs", []) if 2 <= sync["step"] < 7]
        where: dict = {}
        for sync in in_steps:
            where[sync["where"]] = where.get(sync["where"], 0) + 1
        found["syncs"] = {"per_step": len(in_steps) / 5, "where": where,
                          "examples": in_steps[:3]}
        log(f"       syncs: {found['syncs']['per_step']:.1f} per step: {where}")
    if args.device == "cuda" and time_left(args) > 90:
        profile_dir = work / "profile"
        shutil.rmtree(profile_dir, ignore_errors=True)
        trace = work / "trace-base-bf16.json"
        _, report = run_attn(work, "profile", "train", *common, "-o", profile_dir, "--dtype",
                             "bf16", "--max-steps", 10, "--log-every", 5, "--save-every", 1000,
                             env={"ATTN_SMOKE_PROFILE": "5", "ATTN_SMOKE_TRACE": str(trace)},
                             check=False)
        found["profile"] = report.get("profile")
        if trace.exists():
            with open(trace, "rb") as source, gzip.open(Path(args.out) / "trace-base-bf16.json.gz",
                                                        "wb", compresslevel=6) as target:
                shutil.copyfileobj(source, target)
        log(f"       profile: {found['profile']}")
    base = found["base_bf16"]
    found["summary"] = (
        f"base bf16: {base['tgt_tokens_per_s'] or 0:,.0f} tgt tok/s, "
        f"{base['ms_per_step'] or 0:.0f} ms/step, peak {base['peak_gib'] or 0:.1f} GiB, valid_s "
        f"{base['valid_s']}, BLEU {base.get('valid_bleu')}; "
        + "; ".join(f"{name} {found[name].get('tgt_tokens_per_s') or 0:,.0f} tok/s"
                    f" (exit {found[name].get('exit')})"
                    for name in variants if isinstance(found.get(name), dict))
        + (f"; syncs/step {found['syncs']['per_step']:.1f}" if "syncs" in found else "")
        + (f"; GPU busy {found['profile']['busy_fraction']:.0%}" if found.get("profile") else ""))
    if any(isinstance(found.get(name), dict) and found[name]["exit"] for name in variants):
        found["status"] = "FAIL"
    return found


# ---------------------------------------------------------------------------------- stage 4


def stage_resume(args, work: Path) -> dict:
    need_device(args)
    data = work / "data"
    steps = 60
    common = ["train", data / "train.st", "--preset", args.preset, "--device", args.device,
              "--dtype", "bf16", "--max-steps", steps, "--log-every", 10, "--save-every", 1000,
              "--warmup", args.warmup, "--lr-scale", args.lr_scale]
    runs = {}
    for name in ("straight", "again"):
        directory = work / f"resume-{name}"
        shutil.rmtree(directory, ignore_errors=True)
        run(attn_command(*common, "-o", directory))
        runs[name] = directory
    interrupted = work / "resume-interrupted"
    shutil.rmtree(interrupted, ignore_errors=True)
    process = subprocess.Popen(attn_command(*common, "-o", interrupted),
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if any(row.get("step", 0) >= 30 for row in metrics_rows(interrupted)):
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    stopped = {"exit": process.returncode,
               "checkpoints": sorted(p.name for p in interrupted.glob("checkpoint-*.st")
                                     if "state" not in p.name),
               "stderr_tail": stderr.decode("utf-8", "replace")[-400:]}
    resumed = run(attn_command(*common, "-o", interrupted, "--resume"))
    runs["interrupted"] = interrupted

    def final_weights(directory: Path):
        from attn_cli.modelfile import load_model

        return load_model(directory / f"checkpoint-{steps}.st").model.state_dict()

    def difference(a, b) -> float:
        return max(float((a[name].float() - b[name].float()).abs().max()) for name in a)

    def last_loss(directory: Path) -> float:
        return [row["loss"] for row in metrics_rows(directory) if "loss" in row][-1]

    weights = {name: final_weights(directory) for name, directory in runs.items()}
    found = {
        "sigterm": stopped, "resume_exit": resumed.returncode,
        "loss": {name: last_loss(directory) for name, directory in runs.items()},
        "weights_max_abs_diff": {
            "straight_vs_again": difference(weights["straight"], weights["again"]),
            "straight_vs_resumed": difference(weights["straight"], weights["interrupted"])},
    }
    averaged = work / "averaged-resume.st"
    found["average_exit"] = run(attn_command("average", runs["straight"], "--last", 1, "-o",
                                             averaged), check=False).returncode
    gap = abs(found["loss"]["straight"] - found["loss"]["interrupted"])
    found["summary"] = (
        f"SIGTERM exit {stopped['exit']} with {stopped['checkpoints']}; resumed loss "
        f"{found['loss']['interrupted']:.4f} vs {found['loss']['straight']:.4f} uninterrupted "
        f"(gap {gap:.4f}); weights max |diff| run twice "
        f"{found['weights_max_abs_diff']['straight_vs_again']:.2e}, resumed "
        f"{found['weights_max_abs_diff']['straight_vs_resumed']:.2e}")
    if stopped["exit"] != 0 or not stopped["checkpoints"] or gap > 0.02:
        found["status"] = "FAIL"
    return found


# ---------------------------------------------------------------------------------- stage 7


def decode_summary(stderr: bytes) -> dict:
    text = stderr.decode("utf-8", "replace")
    match = re.search(r"(\d+) sentences, (\d+) output tokens .* in ([\d.]+)s: ([\d.]+) sentences/s",
                      text)
    loaded = re.search(r"model loaded in ([\d.]+)s", text)
    if not match:
        return {"stderr": text[-600:]}
    return {"sentences": int(match.group(1)), "tokens": int(match.group(2)),
            "seconds": float(match.group(3)), "sentences_per_s": float(match.group(4)),
            "load_s": float(loaded.group(1)) if loaded else None}


def bleu(hypotheses: list[str], references: list[str]) -> float:
    import sacrebleu

    return round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2)


def stage_decoding(args, work: Path) -> dict:
    need_device(args)
    data = work / "data"
    model = work / "model.st"
    if not model.exists():
        if not (work / "base" / "done").exists():
            raise Skip("no trained model (stage 3)")
        run(attn_command("average", work / "base", "--last", 3, "-o", model))
    source = (data / "test_2016_flickr.en").read_bytes()
    references = (data / "test_2016_flickr.de").read_text().splitlines()
    found: dict = {}
    outputs: dict = {}
    configs = {
        "beam4_auto": [],  # 64000 batch tokens on a GPU
        "beam4_fp32": ["--dtype", "fp32"],
        "beam4_bt8000": ["--batch-tokens", 8000],  # the CPU's default
        "beam4_bt32000": ["--batch-tokens", 32000],
        "beam4_bt64000": ["--batch-tokens", 64000],
        "beam4_best_ends": ["--stop", "best-ends"],
        "greedy_auto": ["--beam", 1],
        "greedy_bt64000": ["--beam", 1, "--batch-tokens", 64000],
    }
    for name, options in configs.items():
        if time_left(args) < 60:
            found[name] = "skipped: out of time"
            continue
        completed = subprocess.run(attn_command("decode", "-m", model, "--device", args.device,
                                                *options), input=source, capture_output=True,
                                   timeout=300)
        lines = completed.stdout.decode("utf-8", "replace").splitlines()
        outputs[name] = lines
        found[name] = {**decode_summary(completed.stderr), "exit": completed.returncode,
                       "lines": len(lines),
                       "bleu": bleu(lines, references) if len(lines) == len(references)
                       else None}
        log(f"       {name}: {found[name]}")
    cpu_lines = 200
    cpu_source = b"".join(source.splitlines(keepends=True)[:cpu_lines])
    completed = subprocess.run(attn_command("decode", "-m", model, "--device", "cpu", "--dtype",
                                            "fp32"), input=cpu_source, capture_output=True,
                               timeout=600)
    cpu_out = completed.stdout.decode("utf-8", "replace").splitlines()
    found["cpu_fp32_200"] = {**decode_summary(completed.stderr), "exit": completed.returncode}
    if "beam4_fp32" in outputs and "beam4_auto" in outputs:
        fp32, auto = outputs["beam4_fp32"], outputs["beam4_auto"]
        found["agreement"] = {
            "gpu_fp32_vs_cpu_fp32_identical": sum(a == b for a, b in zip(fp32, cpu_out)),
            "of": len(cpu_out),
            "gpu_bf16_vs_gpu_fp32_identical": sum(a == b for a, b in zip(auto, fp32)),
            "bf16_minus_fp32_bleu": (found["beam4_auto"]["bleu"] or 0)
            - (found["beam4_fp32"]["bleu"] or 0)}
        for size in ("beam4_bt32000", "beam4_bt64000"):
            if size in outputs:
                found["agreement"][f"{size}_vs_8000_identical"] = sum(
                    a == b for a, b in zip(outputs[size], auto))
    # Syncs per search step: 200 lines at beam 4, bf16.
    if args.device == "cuda" and time_left(args) > 60:
        runner = work / "runner.py"
        runner.write_text(RUNNER)
        report_path = work / "search-syncs.report.json"
        subprocess.run([sys.executable, runner, "decode", "-m", model, "--device", args.device],
                       input=cpu_source, capture_output=True, timeout=300,
                       env={**os.environ, "ATTN_SMOKE_REPORT": str(report_path),
                            "ATTN_SMOKE_SEARCH_SYNCS": "1"})
        if report_path.exists():
            report = json.loads(report_path.read_text())
            counted = [sync for sync in report["syncs"] if sync["step"] >= 3]
            where: dict = {}
            for sync in counted:
                where[sync["where"]] = where.get(sync["where"], 0) + 1
            steps = max(1, report["steps"] - 2)
            found["search_syncs"] = {"per_step": len(counted) / steps, "steps": steps,
                                     "where": where, "peak_gib": report.get("peak_gib")}
    found["f3_probe"] = f3_probe(args.device)
    if found["f3_probe"].startswith("crash"):
        found["status"] = "FAIL"
    auto = found.get("beam4_auto", {})
    found["summary"] = (
        f"beam 4 bf16: BLEU {auto.get('bleu')}, {auto.get('sentences_per_s')} sent/s; fp32 "
        f"{found.get('beam4_fp32', {}).get('sentences_per_s')} sent/s; 64k tokens "
        f"{found.get('beam4_bt64000', {}).get('sentences_per_s')} sent/s; greedy "
        f"{found.get('greedy_auto', {}).get('sentences_per_s')} sent/s; CPU fp32 "
        f"{found['cpu_fp32_200'].get('sentences_per_s')} sent/s; agreement "
        f"{found.get('agreement')}; syncs/step "
        f"{found.get('search_syncs', {}).get('per_step')}; F3 {found['f3_probe']}")
    if any(isinstance(result, dict) and result.get("exit") for result in found.values()):
        found["status"] = "FAIL"
    return found


def f3_probe(device: str) -> str:
    """bf16 decoding past the position table (review F3): a model whose table holds 8
    positions, converted to bf16, searched to 20 positions."""
    import torch

    from attn_cli.config import PRESETS
    from attn_cli.search import beam_search

    config = PRESETS["tiny"].model_config(64, max_positions=8)
    from attn_cli.model import Transformer

    torch.manual_seed(0)
    model = Transformer(config).to(device, torch.bfloat16).eval()
    src = torch.tensor([[5, 6, 7, config.eos_id]], device=device)
    try:
        hypotheses = beam_search(model, src, beam=2, max_len_a=0.0, max_len_b=20)
        return f"ok ({len(hypotheses[0][0].tokens)} tokens)"
    except RuntimeError as error:
        return f"crash: {str(error).splitlines()[0][:100]}"


# ---------------------------------------------------------------------------------- stage 8


def stage_score_parse(args, work: Path) -> dict:
    need_device(args)
    data = work / "data"
    model = work / "model.st"
    found: dict = {}
    if model.exists():
        per_device = {}
        for device in (args.device, "cpu"):
            completed, report = run_attn(work, f"score-{device}", "score", "-m", model,
                                         data / "val.en", data / "val.de", "--device", device,
                                         timeout=600)
            per_device[device] = ([float(line.split("\t")[0]) for line in
                                   completed.stdout.decode().splitlines()],
                                  report.get("peak_gib"), completed.seconds)
        gpu, cpu = per_device[args.device][0], per_device["cpu"][0]
        found["score"] = {"max_abs_logprob_diff": max(abs(a - b) for a, b in zip(gpu, cpu)),
                          "mean_abs_logprob_diff": sum(abs(a - b) for a, b in zip(gpu, cpu))
                          / len(gpu), "gpu_peak_gib": per_device[args.device][1],
                          "gpu_s": per_device[args.device][2], "cpu_s": per_device["cpu"][2]}
    if time_left(args) > 120:
        found["parse"] = toy_parse(work, args.device)
    score = found.get("score", {})
    parse = found.get("parse", {})
    found["summary"] = (f"score -m GPU bf16 vs CPU fp32: max |Δ log p| "
                        f"{score.get('max_abs_logprob_diff')}; parse: {parse.get('summary')}")
    if parse and not parse.get("ok", True):
        found["status"] = "FAIL"
    return found


def toy_parse(work: Path, device: str) -> dict:
    """tests/conftest.py's word parser, trained on the GPU, parsed with --constrain at beam 21
    on the GPU at two batch sizes and on the CPU."""
    from tests.toys import toy_parser_commands

    directory = work / "parser"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    for command in toy_parser_commands(directory, "words", 400, device):
        completed = run(attn_command(*command))
        if command[0] == "train":
            trained = completed
    sentences = (directory / "dev.src").read_bytes()
    trees = {}
    for name, options in (("device_8000", ["--device", device]),
                          ("device_64000", ["--device", device, "--batch-tokens", 64000]),
                          ("cpu", ["--device", "cpu"])):
        completed = subprocess.run(attn_command("parse", "-m", directory / "parser.st",
                                                "--constrain", *options), input=sentences,
                                   capture_output=True, timeout=300)
        trees[name] = completed.stdout.decode().splitlines()
    scored = subprocess.run(attn_command("score", "--trees", "--ref", directory / "dev.mrg",
                                         "--format", "json"),
                            input="\n".join(trees["device_8000"]).encode() + b"\n",
                            capture_output=True, timeout=120)
    f1 = json.loads(scored.stdout.decode())["all"]["f1"] if scored.returncode == 0 else None
    same = {name: sum(a == b for a, b in zip(lines, trees["cpu"]))
            for name, lines in trees.items() if name != "cpu"}
    lines = len(sentences.splitlines())
    ok = all(len(lines_) == lines for lines_ in trees.values())
    return {"train_s": trained.seconds, "f1": f1, "identical_to_cpu": same, "lines": lines,
            "ok": ok, "summary": f"toy word parser trained on the GPU ({trained.seconds:.0f}s), "
            f"dev F1 {f1}, trees equal to the CPU's: {same} of {lines}"}


# ---------------------------------------------------------------------------------- stage 9


def stage_errors(args, work: Path) -> dict:
    import torch

    found = {}
    completed = subprocess.run(attn_command("decode", "-m", work / "nothing.st", "--device",
                                            "cuda"), input=b"x\n", capture_output=True,
                               env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    stderr = completed.stderr.decode("utf-8", "replace")
    found["no_visible_gpu"] = {"exit": completed.returncode, "stderr": stderr[-300:],
                               "one_line": "Traceback" not in stderr}
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    if torch.cuda.is_available() and torch.cuda.device_count() == 1 and Path(torchrun).exists():
        directory = work / "two-on-one"
        shutil.rmtree(directory, ignore_errors=True)
        try:
            completed = subprocess.run(
                [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "attn_cli", "train",
                 work / "data" / "train.st", "-o", directory, "--preset", "tiny", "--device",
                 "cuda", "--max-steps", 4, "--dist-timeout", 1],
                capture_output=True, timeout=180)
            stderr = completed.stderr.decode("utf-8", "replace")
            found["two_processes_one_gpu"] = {
                "exit": completed.returncode, "traceback": "Traceback" in stderr,
                "error_lines": [line for line in stderr.splitlines()
                                if line.startswith("error:")][:4],
                "stderr_tail": stderr[-800:]}
        except subprocess.TimeoutExpired:
            found["two_processes_one_gpu"] = {"exit": "timeout after 180 s"}
    ok = found["no_visible_gpu"]["exit"] == 2 and found["no_visible_gpu"]["one_line"]
    found["summary"] = (f"--device cuda without a GPU: exit {found['no_visible_gpu']['exit']}"
                        f"{'' if found['no_visible_gpu']['one_line'] else ' with a traceback'}; "
                        "2 processes on 1 GPU: "
                        + str({k: v for k, v in found.get("two_processes_one_gpu", {}).items()
                               if k in ("exit", "traceback", "error_lines")}))
    if not ok:
        found["status"] = "FAIL"
    return found


def stage_several_gpus(args, work: Path) -> dict:
    import torch

    if torch.cuda.device_count() < 2:
        raise Skip(f"{torch.cuda.device_count()} GPU(s): torchrun across GPUs needs 2 or more")
    raise Skip("several-GPU stages are not written yet: this project has had one GPU at most")


STAGES = {0: ("environment", stage_environment), 1: ("kernels", stage_kernels),
          2: ("data", stage_data), 3: ("one GPU", stage_one_gpu),
          4: ("stop, resume, average", stage_resume), 5: ("2+ GPUs", stage_several_gpus),
          6: ("failure paths on 2+ GPUs", stage_several_gpus),
          7: ("decoding", stage_decoding), 8: ("score and parse", stage_score_parse),
          9: ("error lines", stage_errors)}


def need_device(args) -> None:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device (--device cpu runs the stages that allow it)")


def time_left(args) -> float:
    return args.deadline - (time.monotonic() - STARTED)


def write_results(path: Path, results: dict) -> None:
    """Every stage's findings so far, in one file (written after each stage: a run cut short
    keeps what it found)."""
    path.write_text(json.dumps({number: {"status": status, "stage": name, **found}
                                for number, (status, name, found) in results.items()},
                               indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--stages", default=",".join(map(str, STAGES)))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--deadline", type=float, default=1e9,
                        help="seconds: stages that would start later are skipped")
    parser.add_argument("--steps", type=int, default=800, help="base-model training steps")
    parser.add_argument("--short-steps", type=int, default=60, help="steps of each variant")
    parser.add_argument("--warmup", type=int, default=400,
                        help="warmup of the smoke's runs (the preset's 4000 would leave the "
                        "model untrained in a few hundred steps)")
    parser.add_argument("--lr-scale", type=float, default=0.5)
    parser.add_argument("--preset", default="base", help="of every training (tiny: to try "
                        "the script itself on a CPU)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the stages that allow it, to try the script itself")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / "attn-gpu-smoke"
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for number in [int(n) for n in args.stages.split(",")]:
        name, function = STAGES[number]
        if number in (0, 1) and args.device != "cuda":
            status, found = "SKIP", {"summary": "needs --device cuda"}
        elif time_left(args) < 30:
            status, found = "SKIP", {"summary": "out of time (--deadline)"}
        else:
            started = time.monotonic()
            log(f"stage {number} ({name}) ...")
            try:
                found = function(args, work)
                status = found.pop("status", "PASS")
            except Skip as why:
                status, found = "SKIP", {"summary": str(why)}
            except Exception as error:  # noqa: BLE001 - a failed stage must not stop the others
                status = "FAIL"
                found = {"summary": f"{type(error).__name__}: {str(error)[:600]}",
                         "traceback": traceback.format_exc()[-4000:]}
            found["seconds"] = round(time.monotonic() - started, 1)
        results[number] = (status, name, found)
        write_results(args.out / "results.json", results)
        log(f"{status} stage {number} ({name}): {found['summary']}")
    log("\nstage  status  seconds  what")
    for number, (status, name, found) in results.items():
        log(f"{number:>5}  {status:<6}  {found.get('seconds', 0):>7}  {name}")
    print(json.dumps({number: {"status": status, "summary": found["summary"]}
                      for number, (status, _, found) in results.items()}))


if __name__ == "__main__":
    main()
