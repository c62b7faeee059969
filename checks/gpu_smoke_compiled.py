"""Stages 12 and 13 of the GPU smoke (checks/gpu_smoke.py): issue 54's questions in one call.

12  the compiled step: `attn train` on WMT-shaped batches (attention off cuDNN, the default),
    `--compile off` against `--compile on` at the preset's batch (25,000 tokens for base):
    tokens/s, ms/step, share of the GPU's bf16 matmul rate, busy fraction and kernels per step
    (a profile of steps 5-7), the compile's seconds and graphs; the 3,125-token proxy (one rank
    of eight) in a one-rank DDP (ATTN_DDP_ONE_RANK=1), eager and compiled; and the batch
    sweep: half and twice the batch (12,500 and 50,000 for base), at `--compile auto`.
13  decoding against CTranslate2 on the same GPU: `benchmarks/decode_speed.py --device cuda`
    on stage 3's model (or one trained here), beam 4 and greedy. The PyPI wheel of
    CTranslate2 runs on CUDA 12 (it loads libcublas.so.12, which CUDA torch's
    nvidia-cublas-cu12 package holds); where ctranslate2 is not importable, a wheel named by
    ATTN_SMOKE_CT2_WHEEL (or found in the checkout's .cache/wheels/) is unpacked into the work
    folder and put on the path (the GPU machine has no network: carry the wheel).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .gpu_smoke_common import (
    REPO,
    Skip,
    log,
    model_tflops,
    params_touched,
    run,
    run_attn,
    save_progress,
    stderr_tail,
    time_left,
    train_dtype,
    training_figures,
)
from .gpu_smoke_train import (
    WMT_VOCABULARY,
    common_options,
    log_every,
    matmul_bf16_tflops,
    need_data,
    seconds_for,
    short,
    wmt_data,
)

# ---------------------------------------------------------------------------------- stage 12


def stage_compiled_step(args, work: Path, found: dict) -> None:
    """Eager against compiled on WMT-shaped batches, the one-rank proxy, the batch sweep."""
    from attn_cli.config import PRESETS

    data = need_data(work)
    batch = PRESETS[args.preset].batch_tokens
    proxy = max(1, batch // 8)
    plan = [("eager", batch, ["--compile", "off"], {}),
            ("compiled", batch, ["--compile", "on"], {}),
            ("proxy_eager", proxy, ["--compile", "off"], {"ATTN_DDP_ONE_RANK": "1"}),
            ("proxy_compiled", proxy, ["--compile", "on"], {"ATTN_DDP_ONE_RANK": "1"}),
            ("half_batch", batch // 2, ["--compile", "auto"], {}),
            ("double_batch", batch * 2, ["--compile", "auto"], {})]
    path, facts = wmt_data(args, work, 2 * args.wmt_steps)
    found["data"] = facts
    matmul = matmul_bf16_tflops(args)
    touched = params_touched(args.preset, WMT_VOCABULARY)
    for name, tokens, options, environment in plan:
        if time_left(args) < 45:
            found[name] = "skipped: out of time"
            continue
        save_progress(f"stage 12: {name}")
        found[name] = figures = compiled_run(args, work, data, path, name, tokens, options,
                                             environment)
        figures["model_tflops"] = model_tflops(figures, touched)
        if figures["model_tflops"] and matmul:
            figures["share_of_matmul"] = figures["model_tflops"] / matmul
        if figures.get("exit"):
            found["status"] = "FAIL"
        log(f"       {name}: {short(figures)}")
    found["speedups"] = {label: ratio for label, ratio in (
        ("compiled_over_eager", speedup(found, "compiled", "eager")),
        ("proxy_compiled_over_eager", speedup(found, "proxy_compiled", "proxy_eager")))
        if ratio is not None}
    found["summary"] = compiled_summary(found, batch)


def compiled_run(args, work: Path, data: Path, path: Path, name: str, tokens: int,
                 options: list, environment: dict) -> dict:
    run_dir = work / f"compiled-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    steps = args.wmt_steps
    seconds = seconds_for(args, 240, least=30)
    completed, report = run_attn(
        work, f"compiled-{name}", "train", path, "-o", run_dir, *common_options(args, data),
        "--dtype", train_dtype(args), "--batch-tokens", tokens, "--max-steps", steps,
        "--log-every", log_every(steps), "--save-every", 10 * steps, "--max-time",
        f"{seconds:.0f}s", *options, timeout=seconds + 240, check=False,
        env={"ATTN_SMOKE_PROFILE": 5, **environment})
    figures = {**training_figures(run_dir), "batch_tokens": tokens, "options": options,
               "exit": completed.returncode, "peak_gib": report.get("peak_gib"),
               **compile_facts(completed.stderr.decode("utf-8", "replace"))}
    profile = report.get("profile") or {}
    figures.update({key: profile[key] for key in ("busy_fraction", "kernels_per_step")
                    if key in profile})
    figures["dispatch_ops_per_step"] = report.get("dispatch_ops_per_step")
    if completed.returncode:
        figures["stderr"] = stderr_tail(completed)
    return figures


def compile_facts(stderr: str) -> dict:
    """What `attn train` said of its compiling: seconds, graphs, or the failure's line."""
    facts: dict = {"compiled": False}
    seconds = re.search(r"compiled \(torch\.compile, dynamic shapes\) in ([\d.]+) s", stderr)
    if seconds:
        facts.update(compiled=True, compile_s=float(seconds.group(1)))
    graphs = re.search(r"(\d+) graphs compiled in this run", stderr)
    if graphs:
        facts["graphs"] = int(graphs.group(1))
    failed = re.search(r"--compile: torch's compiler failed \((.*)\); training", stderr)
    if failed:
        facts["compile_failed"] = failed.group(1)
    return facts


def speedup(found: dict, compiled: str, eager: str) -> float | None:
    a, b = found.get(compiled), found.get(eager)
    if isinstance(a, dict) and isinstance(b, dict) and a.get("ms_per_step") and \
            b.get("ms_per_step"):
        return b["ms_per_step"] / a["ms_per_step"]
    return None


def compiled_summary(found: dict, batch: int) -> str:
    parts = []
    for name in ("eager", "compiled", "proxy_eager", "proxy_compiled", "half_batch",
                 "double_batch"):
        figures = found.get(name)
        if not isinstance(figures, dict):
            continue
        share = figures.get("share_of_matmul")
        busy = figures.get("busy_fraction")
        tokens_per_s = figures.get("tgt_tokens_per_s") or 0
        parts.append(f"{name} {figures['batch_tokens']:,}: {tokens_per_s:,.0f} tok/s, "
                     f"{figures.get('ms_per_step') or 0:.1f} ms/step"
                     + (f", {share:.0%} of matmul" if share else "")
                     + (f", busy {busy:.0%}" if busy else "")
                     + (f", {figures['kernels_per_step']:.0f} kernels/step"
                        if figures.get("kernels_per_step") else "")
                     + (f", compiled in {figures['compile_s']:.0f} s ({figures.get('graphs')} "
                        "graphs)" if figures.get("compiled") else ""))
    ratios = ", ".join(f"{key} {value:.2f}x" for key, value in found["speedups"].items())
    return "; ".join(parts) + (f"; {ratios}" if ratios else "")


# ---------------------------------------------------------------------------------- stage 13


def stage_decode_against_ct2(args, work: Path, found: dict) -> None:
    """benchmarks/decode_speed.py on the device, beam 4 and greedy, against CTranslate2 on the
    same device: attn's tokens/s as a ratio of CTranslate2's."""
    data = need_data(work)
    model = model_to_decode(args, work, data)
    environment, where = ct2_environment(work)
    found["ctranslate2"] = where
    if environment is None:
        raise Skip(f"CTranslate2 cannot run here: {where}")
    seconds = seconds_for(args, 240, least=60)
    completed = run([sys.executable, "-m", "benchmarks.decode_speed", "-m", model, "--device",
                     args.device, "--beams", "4,1", "--repeats", 1, "--no-single",
                     "--startup-repeats", 0, "--no-same-rule"], timeout=seconds, check=False,
                    env=environment)
    found["exit"] = completed.returncode
    if completed.returncode:
        found["stderr"] = stderr_tail(completed)
        found["status"] = "FAIL"
        found["summary"] = "decode_speed failed"
        return
    report = json.loads(completed.stdout)
    rows = {}
    for name, figures in report["runs"].items():
        ct2 = figures.get("ctranslate2", {})
        rows[name] = {"attn_tokens_per_s": figures["tokens_per_s"], "bleu": figures["bleu"],
                      "ct2_tokens_per_s": ct2.get("tokens_per_s"), "ct2_bleu": ct2.get("bleu"),
                      "attn_over_ct2": ct2.get("attn_tokens_per_s_ratio")}
    found["runs"] = rows
    found["summary"] = "; ".join(
        f"{name}: attn {row['attn_tokens_per_s']:,.0f} tok/s, CTranslate2 "
        f"{row['ct2_tokens_per_s'] or 0:,.0f} ({row['attn_over_ct2'] or 0:.2f}x), BLEU "
        f"{row['bleu']:.1f} / {row['ct2_bleu'] or 0:.1f}" for name, row in rows.items())


def model_to_decode(args, work: Path, data: Path) -> Path:
    """Stage 3's model where that stage ran in this call, else a short run of the preset."""
    from .gpu_smoke_decode import trained_model

    try:
        return trained_model(work)
    except Skip:
        pass
    model = work / "ct2-model.st"
    if model.exists():
        return model
    run_dir = work / "ct2-model"
    shutil.rmtree(run_dir, ignore_errors=True)
    seconds = seconds_for(args, 120, least=30)
    run_attn(work, "ct2-model", "train", data / "train.st", "-o", run_dir,
             *common_options(args, data), "--dtype", train_dtype(args), "--max-steps",
             args.steps, "--log-every", log_every(args.steps), "--max-time", f"{seconds:.0f}s",
             timeout=seconds + 180)
    from attn_cli.checkpoints import list_checkpoints

    shutil.copy(list_checkpoints(run_dir)[-1][1], model)
    return model


def ct2_environment(work: Path) -> tuple[dict | None, str]:
    """The environment in which `import ctranslate2` works and finds CUDA's cuBLAS: (env,
    where it came from), or (None, why not)."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    where = "installed"
    if importlib.util.find_spec("ctranslate2") is None:
        wheels = ([os.environ["ATTN_SMOKE_CT2_WHEEL"]] if os.environ.get("ATTN_SMOKE_CT2_WHEEL")
                  else sorted(glob.glob(str(REPO / ".cache" / "wheels" / "ctranslate2-*.whl"))))
        if not wheels:
            return None, ("not installed, and no wheel (ATTN_SMOKE_CT2_WHEEL, or "
                          ".cache/wheels/ctranslate2-*.whl in the checkout)")
        target = work / "ct2-site"
        if not (target / "ctranslate2").exists():
            installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                                        "--no-deps", "--no-index", "--target", str(target),
                                        wheels[-1]], capture_output=True, text=True)
            if installed.returncode:
                return None, f"pip could not unpack {wheels[-1]}: {installed.stderr[-300:]}"
        environment["PYTHONPATH"] += os.pathsep + str(target)
        where = f"unpacked from {Path(wheels[-1]).name}"
    try:
        cublas = importlib.util.find_spec("nvidia.cublas")  # CUDA torch's cuBLAS package
    except ModuleNotFoundError:  # no `nvidia` package at all: a CPU torch
        cublas = None
    if cublas is not None and cublas.submodule_search_locations:
        library = Path(list(cublas.submodule_search_locations)[0]) / "lib"
        environment["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(library), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])
        where += f"; cuBLAS from {library}"
    return environment, where
