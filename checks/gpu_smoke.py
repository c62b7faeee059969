"""The first run on a GPU: does attn work there, and what does it cost? Three calls of at most
9 minutes each on a fresh one-GPU machine (checks/README.md):

    PYTHONPATH=/path/to/attn python -m checks.gpu_smoke OUT/A --call A
    PYTHONPATH=/path/to/attn python -m checks.gpu_smoke OUT/B --call B
    PYTHONPATH=/path/to/attn python -m checks.gpu_smoke OUT/C --call C

from any directory, with attn installed or not: the children import this checkout's attn_cli
(checks/gpu_smoke_common.py puts it first on their PYTHONPATH). Each call is self-contained (it
makes its own data and, where it needs one, trains its own model), stops starting work at
--deadline (540 s), and rewrites OUT/results.json after each stage and each part of one, so that
a call cut off keeps what it found. `--device cpu --preset tiny` tries every call on a CPU.

Stages (each one PASS/FAIL/SKIP line on stderr with its numbers; a headline table closes):

0   environment: torch, CUDA, cuDNN, NCCL, the GPU, bf16 without emulation, SDPA flags, and
    the GPU's own bf16/TF32/fp32 matmul rate (what a training speed is a share of)
1   kernels, each SDPA backend forced in a child process: results against float64, ~50 random
    shapes timed at their first call and their repeat (cuDNN builds a graph per shape), the
    default dispatch's kernels, whether `train --cudnn-attention off` should be used; the
    fused loss in bf16 and fp16
2   data: `attn vocab` and `attn binarize` on the bundled Multi30k
3   one GPU: `train --preset base` in bf16 on Multi30k (the model stages 7-8 decode); unless
    --no-variants: base on WMT-shaped synthetic data (37,000 pieces, lengths like WMT14's:
    tokens/s, its share of the matmul rate, the issue's targets restated, a profile),
    `--batch-tokens 3125` (one rank of eight: kernels per step), the syncs of a step, and
    short runs with --max-tokens 4096, fp16, fp32 and cuDNN attention off
4   stop, resume, average: SIGTERM mid-run, --resume, against the run uninterrupted and twice
5   several GPUs: torchrun on all, 2 processes = 1 in weights (1e-3), resume across counts
6   failure paths of several GPUs: a rank killed; more processes than GPUs
7   decoding: beam 4 in bf16 and fp32 against the CPU, batch sizes, best-ends, greedy, syncs
    per search step, the review's F3 probe
8   `score -m` against the CPU; a toy parser trained and parsed with --constrain
9   error lines: --device cuda with no GPU visible; 2 processes on 1 GPU
10  DDP on a one-rank NCCL group (ATTN_DDP_ONE_RANK=1) against no DDP: accumulation, the bf16
    hook (--grad-sync bf16), a resume
11  `pytest -m gpu` from the checkout
12  the compiled step (issue 54): `--compile off` against `on` on WMT-shaped batches (busy
    fraction, kernels per step, share of the matmul rate), the 3,125-token proxy in a one-rank
    DDP, eager and compiled, and half and twice the batch (checks/gpu_smoke_compiled.py)
13  decoding against CTranslate2 on the same GPU (benchmarks/decode_speed.py --device cuda;
    a carried wheel where ctranslate2 is not installed: checks/gpu_smoke_compiled.py)

Stages 5-6 SKIP with fewer than 2 GPUs; with --device cpu and ATTN_SMOKE_GPUS=2 they run
torchrun on gloo CPU processes instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .gpu_smoke_common import (
    FOUND,
    REPO,
    Skip,
    elapsed,
    log,
    run,
    run_attn,
    set_log_file,
    set_progress,
    time_left,
)
from .gpu_smoke_compiled import compile_facts, stage_compiled_step, stage_decode_against_ct2
from .gpu_smoke_decode import stage_decoding, stage_score_parse
from .gpu_smoke_dist import (
    gpu_count,
    stage_failure_paths,
    stage_one_rank_ddp,
    stage_several_gpus,
)
from .gpu_smoke_kernels import stage_environment, stage_kernels
from .gpu_smoke_train import need_data, stage_data, stage_one_gpu, stage_resume

# ---------------------------------------------------------------------------------- stage 9


def stage_errors(args, work: Path, found: dict) -> None:
    """The error lines of a GPU asked for and missing, and of two processes on one GPU."""
    import torch

    completed = run([sys.executable, "-m", "attn_cli", "decode", "-m", work / "nothing.st",
                     "--device", "cuda"], input=b"x\n", env={"CUDA_VISIBLE_DEVICES": ""},
                    timeout=120, check=False)
    stderr = completed.stderr.decode("utf-8", "replace")
    found["no_visible_gpu"] = {"exit": completed.returncode, "stderr": stderr[-300:],
                               "one_line": "Traceback" not in stderr}
    if args.device == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() == 1:
        data = need_data(work)
        directory = work / "two-on-one"
        shutil.rmtree(directory, ignore_errors=True)
        try:
            completed, _ = run_attn(work, "two-on-one", "train", data / "train.st", "-o",
                                    directory, "--preset", "tiny", "--device", "cuda",
                                    "--max-steps", 4, "--dist-timeout", 1, processes=2,
                                    check=False, timeout=180)
            stderr = completed.stderr.decode("utf-8", "replace")
            found["two_processes_one_gpu"] = {
                "exit": completed.returncode, "traceback": "]: Traceback" in stderr,
                "error_lines": [line for line in stderr.splitlines() if "error:" in line][:4],
                "stderr_tail": stderr[-800:]}
        except subprocess.TimeoutExpired:
            found["two_processes_one_gpu"] = {"exit": "timeout after 180 s"}
    ok = found["no_visible_gpu"]["exit"] == 2 and found["no_visible_gpu"]["one_line"]
    two = found.get("two_processes_one_gpu", {})
    found["summary"] = (f"--device cuda without a GPU: exit {found['no_visible_gpu']['exit']}"
                        f"{'' if found['no_visible_gpu']['one_line'] else ' with a traceback'}"
                        + (f"; 2 processes on 1 GPU: exit {two.get('exit')}, "
                           f"{two.get('error_lines')}" if two else ""))
    if not ok or (two and (two.get("exit") in (0, "timeout after 180 s")
                           or two.get("traceback"))):
        found["status"] = "FAIL"


# --------------------------------------------------------------------------------- stage 11


def stage_gpu_tests(args, work: Path, found: dict) -> None:
    """`python -m pytest -m gpu -q` in the checkout's root, the checkout on PYTHONPATH (review
    N16): the tests that need CUDA, the sync-free training step among them."""
    if importlib.util.find_spec("pytest") is None:
        raise Skip("pytest is not importable by this Python")
    try:
        completed = run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p",
                         "no:cacheprovider"], cwd=REPO, timeout=time_left(args) - 10,
                        check=False)
    except subprocess.TimeoutExpired:
        found["summary"] = "pytest -m gpu still running at --deadline"
        found["status"] = "FAIL"
        return
    output = completed.stdout.decode("utf-8", "replace")
    counts = {word: int(number) for number, word in
              re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", output)}
    found.update(exit=completed.returncode, counts=counts, seconds_run=round(completed.seconds),
                 tail=output[-2500:])
    found["summary"] = f"pytest -m gpu: exit {completed.returncode}, {counts}"
    if completed.returncode == 0 and not counts.get("passed"):
        found["status"] = "SKIP"  # collected, every one skipped: no CUDA here
    elif completed.returncode not in (0, 5):
        found["status"] = "FAIL"


# ------------------------------------------------------------------------------ the calls

STAGES = {0: ("environment", stage_environment), 1: ("kernels", stage_kernels),
          2: ("data", stage_data), 3: ("one GPU", stage_one_gpu),
          4: ("stop, resume, average", stage_resume), 5: ("2+ GPUs", stage_several_gpus),
          6: ("failure paths on 2+ GPUs", stage_failure_paths),
          7: ("decoding", stage_decoding), 8: ("score and parse", stage_score_parse),
          9: ("error lines", stage_errors), 10: ("DDP on a 1-rank group", stage_one_rank_ddp),
          11: ("pytest -m gpu", stage_gpu_tests), 12: ("compiled step", stage_compiled_step),
          13: ("decoding against CTranslate2", stage_decode_against_ct2)}
CUDA_ONLY = {0, 1}  # SKIP with --device cpu

# The three calls of a fresh one-GPU machine, each well inside its 10 minutes (review §4):
# A measures, B decodes a model it trains, C checks the distributed code and the GPU tests.
CALLS = {
    "A": {"stages": [0, 1, 2, 3], "steps": 800},
    "B": {"stages": [2, 3, 7, 8, 9], "steps": 300, "no_variants": True},
    "C": {"stages": [2, 10, 5, 6, 4, 11], "steps": 300},
    # One call for a lease of 15 minutes in all (the machine's start included): the headline's
    # rows but the kernels' (stage 1, a minute, and `pytest -m gpu`, stage 11: a second call if
    # time is left: --stages 11,1 --deadline 195). 444 s on an H100 (benchmarks/README.md).
    "S": {"stages": [0, 2, 3, 10, 7], "steps": 400, "short_steps": 30, "wmt_steps": 60,
          "ddp_steps": 20},
    # Issue 54's call, one command of at most 7 minutes: eager against compiled, the one-rank
    # proxy, the batch sweep, decoding against CTranslate2 on the GPU, then pytest -m gpu.
    "T": {"stages": [0, 2, 12, 13, 11], "steps": 200, "wmt_steps": 40, "deadline": 420},
}
# Seconds each stage takes on one H100 (the review's §4, and estimates for the new ones): what a
# stage leaves for the stages after it in its call when it sizes its own training.
ESTIMATES = {0: 20, 1: 60, 2: 30, 3: 330, 4: 100, 5: 150, 6: 90, 7: 150, 8: 90, 9: 20,
             10: 90, 11: 90, 12: 200, 13: 100}


def estimate(number: int, args) -> float:
    if number == 3 and args.no_variants:
        return 120
    if number in (5, 6) and gpu_count(args)[0] < 2:
        return 0
    return ESTIMATES[number]


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m checks.gpu_smoke",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Stages:\n" + __doc__.split("Stages")[1])
    parser.add_argument("out", type=Path, nargs="?", help="where results.json, smoke.log and "
                        "the profile's trace go")
    parser.add_argument("--call", choices=sorted(CALLS), help="one of the three calls "
                        "(checks/README.md): A 0,1,2,3; B 2,3,7,8,9 (--steps 300 "
                        "--no-variants); C 2,10,5,6,4,11; or S, the one call of a "
                        "15-minute lease: 0,2,3,10,7 with shorter runs")
    parser.add_argument("--stages", help="comma-separated stage numbers, in the order to run "
                        "them (default: the call's, or every stage)")
    parser.add_argument("--work", type=Path, default=None, help="work files (default: "
                        "$TMPDIR/attn-gpu-smoke); a second call with the same --work reuses its "
                        "data and trained model")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds: no stage or run starts that could not end by then "
                        "(default 540; call T's 420)")
    parser.add_argument("--steps", type=int, help="steps of stage 3's base training (default "
                        "800 for call A, 300 for B and C; 60 with --device cpu)")
    parser.add_argument("--short-steps", type=int, help="steps of each stage-3 variant "
                        "(default 60; 10 with --device cpu)")
    parser.add_argument("--wmt-steps", type=int, help="steps of the WMT-shaped and "
                        "--batch-tokens 3125 runs (default 100; 12 with --device cpu)")
    parser.add_argument("--ddp-steps", type=int, help="steps of the data-parallel runs of "
                        "stages 5, 6 and 10 (default 30; 6 with --device cpu)")
    parser.add_argument("--no-variants", action="store_true", help="stage 3 trains the base "
                        "model only (call B's default)")
    parser.add_argument("--warmup", type=int, help="warmup of the smoke's runs (default 400; "
                        "50 with --device cpu: the preset's 4000 leaves a short run untrained)")
    parser.add_argument("--lr-scale", type=float, default=0.5)
    parser.add_argument("--preset", default="base", help="of every training (tiny: to try "
                        "the script itself on a CPU)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the stages that allow it, to try the script itself")
    parser.add_argument("--lines", type=int, help="stage 2: the first N lines of each "
                        "Multi30k file only (to try the script quickly)")
    parser.add_argument("--vocab-size", type=int, default=8000, help="stage 2's BPE pieces")
    parser.add_argument("--self-test", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.self_test:
        return args
    if args.out is None:
        parser.error("OUT is required")
    call = CALLS.get(args.call, {})
    cpu = args.device == "cpu"
    stages = args.stages.split(",") if args.stages else call.get("stages", list(STAGES))
    args.stage_list = [int(number) for number in stages]
    unknown = [number for number in args.stage_list if number not in STAGES]
    if unknown:
        parser.error(f"no stage {unknown}: stages are 0-{max(STAGES)}")
    args.no_variants = args.no_variants or call.get("no_variants", False)
    if args.deadline is None:
        args.deadline = call.get("deadline", 540)
    defaults = {"steps": 60 if cpu else call.get("steps", 800),
                "short_steps": 10 if cpu else call.get("short_steps", 60),
                "wmt_steps": 12 if cpu else call.get("wmt_steps", 100),
                "ddp_steps": 6 if cpu else call.get("ddp_steps", 30),
                "warmup": 50 if cpu else 400}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# ---------------------------------------------------------------------------- the results


class Results:
    """OUT/results.json: the call, the checkout, every stage's status and findings, the stage
    running and its findings so far, and the headline; rewritten atomically at each change."""

    def __init__(self, args, checkout: dict):
        self.path = args.out / "results.json"
        self.head = {"call": args.call, "argv": sys.argv[1:], "device": args.device,
                     "preset": args.preset, "deadline_s": args.deadline, "checkout": checkout}
        self.stages: dict[int, dict] = {}
        self.running: dict | None = None

    def start(self, number: int, name: str, found: dict) -> None:
        self.running = {"stage": number, "name": name, "started_at_s": round(elapsed(), 1),
                        "found_so_far": found}
        self.write()

    def progress(self, note: str = "") -> None:
        if self.running is not None:
            self.running.update(next=note, at_s=round(elapsed(), 1))
        self.write()

    def finish(self, number: int, status: str, name: str, found: dict) -> None:
        self.running = None
        self.stages[number] = {"status": status, "stage": name, **found}
        self.write()

    def write(self, headline: dict | None = None) -> None:
        content = {**self.head, "elapsed_s": round(elapsed(), 1), "stages": self.stages}
        if self.running is not None:
            content["running"] = self.running
        if headline is not None:
            content["headline"] = headline
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(content, indent=1, default=str))
        os.replace(temporary, self.path)


def checkout_facts() -> dict:
    """Where this process and its children import attn_cli from (N2: it must be REPO's)."""
    completed = run([sys.executable, "-c", "import os, attn_cli; "
                     "print(os.path.dirname(os.path.abspath(attn_cli.__file__)))"],
                    timeout=120, check=False, cwd=Path.home() if Path.home().is_dir() else None)
    children = completed.stdout.decode().strip() or completed.stderr.decode()[-300:]
    expected = str(REPO / "attn_cli")
    return {"repo": str(REPO), "children_import_attn_cli_from": children,
            "ok": children == expected, "python": sys.executable}


def headline(args) -> dict:
    """The numbers the issue asks for, from this call's stages (others: which call has them)."""
    def stage(number: int) -> dict:
        return FOUND.get(number, {})

    def value(found: dict, *keys):
        for key in keys:
            found = found.get(key) if isinstance(found, dict) else None
        return found

    rows: dict = {}
    environment = stage(0)
    rows["gpu, torch, CUDA, cuDNN"] = environment.get("summary", "(stage 0: call A)")
    wmt = value(stage(3), "wmt_shaped") or {}
    targets = wmt.get("targets") or {}
    if isinstance(wmt, dict) and wmt.get("tgt_tokens_per_s"):
        rows["WMT-shaped base tokens/s (target)"] = round(wmt["tgt_tokens_per_s"])
        rows["model TFLOP/s (6 x params touched x tokens/s)"] = wmt.get("model_tflops")
        rows["share of the measured bf16 matmul rate"] = wmt.get("share_of_matmul")
        rows["GPU busy (WMT-shaped profile)"] = value(wmt, "profile", "busy_fraction")
        if targets:
            rows["target 300k tok/s = share of measured matmul"] = \
                targets["300k_tok_s_share_of_matmul"]
            rows["target 35% of measured matmul = tok/s"] = round(targets["35pct_of_matmul_tok_s"])
    else:
        rows["WMT-shaped base tokens/s"] = "(stage 3 with variants: call A)"
    proxy = value(stage(3), "proxy_bt3125") or {}
    if isinstance(proxy, dict) and proxy.get("tgt_tokens_per_s"):
        rows["--batch-tokens 3125: ms/step, kernels/step, ops/step"] = [
            proxy.get("ms_per_step"), value(proxy, "profile", "kernels_per_step"),
            proxy.get("dispatch_ops_per_step")]
        rows["--batch-tokens 3125: 8 x tokens/s (8-rank bound)"] = \
            proxy.get("eight_ranks_tok_s_upper_bound")
    on_gpu = args.device == "cuda"
    rows["syncs per training step"] = value(stage(3), "syncs", "per_step") or (
        "(call A)" if on_gpu else "n/a on a CPU")
    rows["--cudnn-attention"] = value(stage(1), "cudnn_attention", "advice") or (
        "(call A)" if on_gpu else "n/a on a CPU")
    ddp = stage(10)
    rows[f"DDP on a 1-rank {'NCCL' if on_gpu else 'gloo'} group"] = (
        f"{'FAIL' if ddp.get('status') == 'FAIL' else 'PASS'}: "
        f"{ddp.get('weights_max_abs_diff')}" if ddp.get("weights_max_abs_diff") is not None
        else "(call C)")
    decoding = stage(7)
    rows["bf16 minus fp32 decode BLEU"] = value(decoding, "agreement",
                                                "auto_minus_fp32_bleu") if decoding \
        else "(call B)"
    rows["search syncs per step"] = value(decoding, "search_syncs", "per_step") or (
        "(call B)" if on_gpu else "n/a on a CPU")
    compiled = stage(12)
    if compiled:
        for name in ("eager", "compiled", "proxy_eager", "proxy_compiled"):
            figures = compiled.get(name)
            if isinstance(figures, dict):
                rows[f"{name} ({figures['batch_tokens']:,} tokens): tok/s, ms/step, share of "
                     "matmul, busy, kernels/step"] = [
                    figures.get("tgt_tokens_per_s"), figures.get("ms_per_step"),
                    figures.get("share_of_matmul"), figures.get("busy_fraction"),
                    figures.get("kernels_per_step")]
        rows["compiled / eager (batch, proxy)"] = [
            compiled.get("speedups", {}).get("compiled_over_eager"),
            compiled.get("speedups", {}).get("proxy_compiled_over_eager")]
    else:
        rows["compiled step"] = "(call T)"
    against = stage(13)
    rows["decode attn / CTranslate2 tokens/s (beam 4, greedy)"] = [
        value(against, "runs", name, "attn_over_ct2") for name in ("beam4", "beam1")] \
        if against.get("runs") else (against.get("summary") or "(call T)")
    return rows


def run_stages(args, work: Path, results: Results) -> None:
    for index, number in enumerate(args.stage_list):
        name, function = STAGES[number]
        args.reserve = sum(estimate(later, args) for later in args.stage_list[index + 1:])
        found: dict = {}
        FOUND[number] = found
        started = time.monotonic()
        if number in CUDA_ONLY and args.device != "cuda":
            status, found["summary"] = "SKIP", "needs --device cuda"
        elif time_left(args) < 30:
            status, found["summary"] = "SKIP", "out of time (--deadline)"
        else:
            log(f"stage {number} ({name}) ...")
            results.start(number, name, found)
            try:
                function(args, work, found)
                status = found.pop("status", "PASS")
            except Skip as why:
                status = "SKIP"
                found["summary"] = str(why)
            except Exception as error:  # noqa: BLE001 - a failed stage must not stop the others
                status = "FAIL"
                found["summary"] = f"{type(error).__name__}: {str(error)[:600]}"
                found["traceback"] = traceback.format_exc()[-4000:]
        found["seconds"] = round(time.monotonic() - started, 1)
        results.finish(number, status, name, found)
        log(f"{status} stage {number} ({name}) in {found['seconds']}s: {found['summary']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.self_test:
        return self_test()
    if args.device == "cpu":
        # One thread per process unless told otherwise: trying the script on a CPU that other
        # jobs share, two threads' OpenMP waiting made training steps 5-20x slower.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    set_log_file(args.out / "smoke.log")
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / "attn-gpu-smoke"
    work.mkdir(parents=True, exist_ok=True)
    checkout = checkout_facts()
    log(f"gpu_smoke call {args.call or '-'}: stages {args.stage_list} on {args.device}, "
        f"--deadline {args.deadline:g}s; children import attn_cli from "
        f"{checkout['children_import_attn_cli_from']}")
    if not checkout["ok"]:
        log(f"WARNING: the children do not import {REPO / 'attn_cli'}: what runs is not this "
            "checkout")
    results = Results(args, checkout)
    set_progress(results.progress)
    run_stages(args, work, results)
    rows = headline(args)
    results.write(rows)
    log("\nstage  status  seconds  what")
    for number, result in results.stages.items():
        log(f"{number:>5}  {result['status']:<6}  {result['seconds']:>7}  {result['stage']}")
    log(f"\nheadline (call {args.call or '-'}, {elapsed():.0f}s):")
    for name, shown in rows.items():
        log(f"  {name}: {shown:.3g}" if isinstance(shown, float) else f"  {name}: {shown}")
    print(json.dumps({number: {"status": result["status"], "summary": result["summary"]}
                      for number, result in results.stages.items()}))
    failed = [number for number, result in results.stages.items() if result["status"] == "FAIL"]
    return 1 if failed or not checkout["ok"] else 0


# ------------------------------------------------------------------------------ self-test


def self_test() -> int:
    """The smoke's pure parts on synthetic input, for tests/test_gpu_smoke.py (tests may not
    import checks/): the profile's busy time and kernel count (N3), the WMT-shaped data file
    (N13), the error-line reader, the calls' stage lists."""
    import tempfile

    from attn_cli.data import ParallelData

    from .gpu_smoke_common import error_lines, params_touched
    from .gpu_smoke_runner import summarize_profile
    from .gpu_smoke_train import write_wmt_shaped

    def event(name, device, start, end):
        return {"name": name, "device": device, "start_us": start, "end_us": end}

    # One op and the one 1 ms kernel it launched: busy 1 ms, not 2; the top list the kernel's.
    one = summarize_profile([event("aten::mm", False, 0, 1200),
                             event("sm90_gemm", True, 100, 1100)], wall_s=0.002, steps=1)
    assert one["gpu_busy_ms"] == 1.0 and one["busy_fraction"] == 0.5, one
    assert list(one["top_kernels_ms"]) == ["sm90_gemm"] and one["kernels_per_step"] == 1, one
    # Overlapping kernels on two streams count once; copies are no kernel launches.
    two = summarize_profile([event("gemm", True, 0, 1000), event("nccl", True, 500, 1500),
                             event("Memcpy HtoD", True, 2000, 2100),
                             event("aten::copy_", False, 1900, 2200)], wall_s=0.003, steps=2)
    assert two["gpu_busy_ms"] == 1.6 and two["kernels_per_step"] == 1.0, two
    assert two["copies_per_step"] == 0.5 and "aten::copy_" not in two["top_kernels_ms"], two
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "wmt.st"
        facts = write_wmt_shaped(path, 3000)
        data = ParallelData(path)
        assert len(data) == 3000 and len(data.src_vocab) == 37_000, (len(data), facts)
        assert 24 < data.src_lengths.mean() < 32 and data.tgt_lengths.mean() > 25, facts
        assert data.src_lengths.max() <= 250 and data.ids["src"].max() < 37_000
    touched = params_touched("base", 37_000)
    assert touched["output"] == 37_000 * 512 and 18e6 < touched["encoder"] < 20e6, touched
    assert 25e6 < touched["decoder"] < 26e6, touched
    assert error_lines("[rank1]: error: rank 1: waiting\nerror: x\nnoise") == \
        ["error: rank 1: waiting", "error: x"]
    for name, call in CALLS.items():
        args = parse_arguments(["out", "--call", name])
        assert args.stage_list == call["stages"], name
        assert args.deadline == call.get("deadline", 540), name
    assert compile_facts("train: each encoder and decoder layer compiled (torch.compile, "
                         "dynamic shapes) in 31.5 s\ntrain: 14 graphs compiled in this run "
                         "(--compile)") == {"compiled": True, "compile_s": 31.5, "graphs": 14}
    print(json.dumps({"self_test": "ok", "profile": one, "wmt_shaped": facts,
                      "params_touched": touched}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
