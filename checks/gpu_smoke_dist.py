"""The GPU smoke's data-parallel stages (checks/gpu_smoke.py): DDP on a one-rank process group
(stage 10: NCCL on one GPU, review N1), and the stages for a machine of several GPUs (5: torchrun
on all of them, 2 processes = 1 in weights, resume across process counts; 6: failure paths).

Stages 5 and 6 run on a CPU too: with --device cpu and ATTN_SMOKE_GPUS=N (a mocked GPU count),
torchrun starts N CPU processes on gloo, and the refusal of more processes than GPUs is tried
with torch made to see N GPUs (the runner's ATTN_SMOKE_MOCK_GPUS): attn refuses before it
touches a device.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .gpu_smoke_common import (
    Skip,
    error_lines,
    popen,
    read_report,
    run_attn,
    save_progress,
    stderr_tail,
    time_left,
    torchrun_command,
    train_dtype,
    training_figures,
    weights_difference,
)
from .gpu_smoke_train import common_options, need_data, need_device, seconds_for

MOCK_GPUS = "ATTN_SMOKE_GPUS"  # with --device cpu: the GPU count stages 5 and 6 plan for


def gpu_count(args) -> tuple[int, str]:
    """The GPUs stages 5 and 6 use, and where the count comes from."""
    if args.device == "cpu":
        mocked = os.environ.get(MOCK_GPUS)
        if mocked:
            return int(mocked), f"{MOCK_GPUS}={mocked}: gloo on CPU processes"
        return 0, f"--device cpu ({MOCK_GPUS}=N mocks N GPUs: gloo on CPU processes)"
    import torch

    return torch.cuda.device_count(), "torch.cuda.device_count()"


def step_batch(args) -> int:
    """Tokens per step of the data-parallel runs: the preset's on a GPU, small on a CPU."""
    from attn_cli.config import PRESETS

    return PRESETS[args.preset].batch_tokens if args.device == "cuda" else 1200


def train_arguments(args, data: Path, run_dir: Path, *extra) -> list:
    return ["train", data / "train.st", "-o", run_dir, *common_options(args, data), "--dtype",
            train_dtype(args), *extra]


# -------------------------------------------------------------------------------- stage 10


def stage_one_rank_ddp(args, work: Path, found: dict) -> None:
    """DDP on a process group of one rank (ATTN_DDP_ONE_RANK=1: NCCL on a GPU, gloo on a CPU),
    with gradient accumulation (4 passes a step), against the same run without DDP: with the
    fp32 all-reduce (gloo: bitwise; NCCL: near), with the bf16 hook (--grad-sync bf16, CUDA:
    near), and stopped halfway and resumed (= the uninterrupted DDP run)."""
    need_device(args)
    data = need_data(work)
    steps = args.ddp_steps
    batch = step_batch(args) // 2
    seconds_for(args, 60, least=20)
    common = ["--batch-tokens", batch, "--max-tokens", batch // 4, "--log-every",
              max(1, steps // 5), "--save-every", steps // 2]
    one_rank = {"ATTN_DDP_ONE_RANK": "1"}
    runs = {"plain": ({}, [], steps), "ddp_fp32": (one_rank, ["--grad-sync", "fp32"], steps),
            "ddp_bf16": (one_rank, ["--grad-sync", "bf16"], steps),
            "ddp_resumed": (one_rank, ["--grad-sync", "fp32"], steps // 2)}
    reports = {}
    for name, (env, extra, max_steps) in runs.items():
        if name == "ddp_bf16" and args.device != "cuda":
            found[name] = "skipped: the bf16 hook needs CUDA (NCCL)"
            continue
        if time_left(args) < 40:
            found[name] = "skipped: out of time"
            continue
        run_dir = work / f"ddp1-{name}"
        shutil.rmtree(run_dir, ignore_errors=True)
        completed, report = run_attn(work, f"ddp1-{name}", *train_arguments(
            args, data, run_dir, *common, *extra, "--max-steps", max_steps), env=env,
            check=False, timeout=time_left(args))
        if name == "ddp_resumed" and completed.returncode == 0:
            completed, report = run_attn(work, f"ddp1-{name}", *train_arguments(
                args, data, run_dir, *common, *extra, "--max-steps", steps, "--resume"),
                env=env, check=False, timeout=time_left(args))
        stderr = completed.stderr.decode("utf-8", "replace")
        reports[name] = report
        found[name] = {"exit": completed.returncode, "ddp": report.get("ddp"),
                       "comm_hook": report.get("comm_hook"),
                       "bf16_line": "all-reduced in bf16" in stderr,
                       "tgt_tokens_per_s": training_figures(run_dir)["tgt_tokens_per_s"]}
        if completed.returncode:
            found[name]["stderr"] = stderr[-1500:]
        save_progress()
    backend = "nccl" if args.device == "cuda" else "gloo"
    problems = []
    for name in ("ddp_fp32", "ddp_bf16", "ddp_resumed"):
        result = found.get(name)
        if not isinstance(result, dict):
            continue
        ddp = result.get("ddp") or {}
        if result["exit"]:
            problems.append(f"{name} exit {result['exit']}")
        elif ddp.get("wrapped") != "DistributedDataParallel" or ddp.get("group_size") != 1 \
                or ddp.get("backend") != backend:
            problems.append(f"{name}: ATTN_DDP_ONE_RANK=1 gave {ddp} (not DDP on a 1-rank "
                            f"{backend} group)")
    if isinstance(found.get("ddp_bf16"), dict) and not found["ddp_bf16"]["exit"] and \
            "bf16" not in str(found["ddp_bf16"]["comm_hook"]):
        problems.append("ddp_bf16: no bf16 comm hook registered")
    limits = ({"ddp_fp32": 0.0, "ddp_resumed": 0.0} if args.device == "cpu"
              else {"ddp_fp32": 1e-3, "ddp_bf16": 1e-2, "ddp_resumed": 1e-3})
    against = {"ddp_fp32": "plain", "ddp_bf16": "plain", "ddp_resumed": "ddp_fp32"}
    diffs = {}
    for name, limit in limits.items():
        other = against[name]
        if not all(isinstance(found.get(key), dict) and not found[key]["exit"]
                   for key in (name, other)):
            continue
        diffs[f"{name}_vs_{other}"] = difference = weights_difference(
            work / f"ddp1-{name}", work / f"ddp1-{other}")
        if difference > limit:
            problems.append(f"{name} vs {other}: max |diff| {difference:.2e} > {limit:g}")
    found["weights_max_abs_diff"] = diffs
    found["limits"] = limits
    found["problems"] = problems
    shown = ", ".join(f"{key} {value:.2e}" for key, value in diffs.items())
    found["summary"] = (f"DDP on a 1-rank {backend} group, {steps} steps of 4 passes: "
                        f"max |diff| {shown or 'n/a'}" + (f"; {'; '.join(problems)}"
                                                           if problems else ""))
    if problems or not diffs:
        found["status"] = "FAIL"


# --------------------------------------------------------------------------------- stage 5


def stage_several_gpus(args, work: Path, found: dict) -> None:
    """torchrun on all the GPUs (tokens/s against one process), 2 processes = 1 process
    accumulating the same global batch (weights to 1e-3), and a 2-process run stopped halfway
    and resumed on 1 process (= the 1-process run, to 1e-3)."""
    count, source = gpu_count(args)
    found["gpus"] = {"count": count, "from": source}
    if count < 2:
        raise Skip(f"{count} GPU(s) ({source}): torchrun across GPUs needs 2 or more")
    data = need_data(work)
    steps = args.ddp_steps
    batch = step_batch(args)
    seconds_for(args, 60, least=20)
    common = ["--batch-tokens", batch, "--log-every", max(1, steps // 5), "--save-every",
              steps // 2, "--dist-timeout", 2]
    halves = ["--max-tokens", batch // 2]
    plan = [("one", 0, [*halves, "--max-steps", steps]),
            ("two", 2, [*halves, "--max-steps", steps]),
            ("two_then_one", 2, [*halves, "--max-steps", steps // 2]),
            ("two_then_one", 0, [*halves, "--max-steps", steps, "--resume"])]
    if count > 2:
        plan.append((f"all_{count}", count, ["--max-steps", steps]))
    for name, processes, extra in plan:
        if time_left(args) < 40:
            found[name] = "skipped: out of time"
            continue
        run_dir = work / f"five-{name}"
        if "--resume" not in extra:
            shutil.rmtree(run_dir, ignore_errors=True)
        completed, _ = run_attn(work, f"five-{name}", *train_arguments(args, data, run_dir,
                                                                        *common, *extra),
                                processes=processes, check=False, timeout=time_left(args))
        found[name] = {"processes": processes or 1, "exit": completed.returncode,
                       **{key: value for key, value in training_figures(run_dir).items()
                          if key in ("steps", "tgt_tokens_per_s", "ms_per_step", "last_loss")}}
        if completed.returncode:
            found[name]["stderr"] = stderr_tail(completed)
        save_progress()
    problems = [f"{name} exit {result['exit']}" for name, result in found.items()
                if isinstance(result, dict) and result.get("exit")]
    diffs = {}
    for name in ("two", "two_then_one"):
        if isinstance(found.get(name), dict) and not problems:
            diffs[f"{name}_vs_one"] = difference = weights_difference(work / f"five-{name}",
                                                                      work / "five-one")
            if difference > 1e-3:
                problems.append(f"{name} vs one: max |diff| {difference:.2e} > 1e-3")
    found["weights_max_abs_diff"] = diffs
    everything = found.get(f"all_{count}", found.get("two"))
    if isinstance(everything, dict) and isinstance(found.get("one"), dict) and \
            everything.get("tgt_tokens_per_s") and found["one"].get("tgt_tokens_per_s"):
        found["scaling"] = everything["tgt_tokens_per_s"] / found["one"]["tgt_tokens_per_s"]
    found["problems"] = problems
    shown = ", ".join(f"{key} {value:.2e}" for key, value in diffs.items())
    found["summary"] = (f"{count} GPUs ({source}): max |diff| {shown or 'n/a'}; "
                        f"{count} processes / 1: {found.get('scaling', 0):.2f}x tokens/s"
                        + (f"; {'; '.join(problems)}" if problems else ""))
    if problems or len(diffs) < 2:
        found["status"] = "FAIL"


# --------------------------------------------------------------------------------- stage 6


def stage_failure_paths(args, work: Path, found: dict) -> None:
    """A rank killed mid-run: the job must end (the others with one error line on gloo; NCCL's
    watchdog or torchrun's teardown may end them otherwise: review N8) within --dist-timeout;
    and more processes than GPUs refused, by every process, with one line."""
    count, source = gpu_count(args)
    found["gpus"] = {"count": count, "from": source}
    if count < 2:
        raise Skip(f"{count} GPU(s) ({source}): the failure paths of several GPUs need 2 or more")
    data = need_data(work)
    seconds_for(args, 60, least=20)
    found["killed_rank"] = killed_rank(args, work, data, count)
    save_progress("stage 6: more processes than GPUs")
    found["too_many_processes"] = too_many_processes(args, work, data, count)
    killed, refused = found["killed_rank"], found["too_many_processes"]
    problems = []
    if not killed.get("ended_in_time"):
        problems.append(f"killed rank: the job did not end in time ({killed.get('seconds')}s)")
    elif not killed.get("exit"):
        problems.append("killed rank: torchrun exited 0")
    if args.device == "cpu" and not killed.get("error_lines"):
        problems.append("killed rank: no error line from the other ranks (gloo)")
    if not refused.get("refused") or refused.get("traceback"):
        problems.append(f"more processes than GPUs: {refused}")
    found["problems"] = problems
    found["summary"] = (
        f"rank {killed.get('killed')} killed: job ended in {killed.get('seconds')}s, exit "
        f"{killed.get('exit')}, lines {killed.get('error_lines')}; {count + 1} processes on "
        f"{count} GPUs: exit {refused.get('exit')}, {refused.get('error_lines')}"
        + (f"; {'; '.join(problems)}" if problems else ""))
    if problems:
        found["status"] = "FAIL"


def killed_rank(args, work: Path, data: Path, count: int) -> dict:
    """torchrun on `count` GPUs; once the run has taken 3 steps the last rank is SIGKILLed:
    how long the job takes to end, how it ends, what the other ranks say."""
    run_dir = work / "six-killed"
    pids = work / "six-pids"
    for directory in (run_dir, pids):
        shutil.rmtree(directory, ignore_errors=True)
    pids.mkdir(parents=True)
    timeout_minutes = 0.5 if args.device == "cpu" else 1.0
    report = work / "six-killed.report.json"
    process = popen(torchrun_command(count, *train_arguments(
        args, data, run_dir, "--batch-tokens", step_batch(args), "--max-steps", 100_000,
        "--log-every", 1, "--save-every", 100_000, "--dist-timeout", timeout_minutes)),
        env={"ATTN_SMOKE_PIDS": pids, "ATTN_SMOKE_REPORT": report},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    victim = count - 1
    started = time.monotonic()
    found: dict = {"killed": victim, "dist_timeout_s": timeout_minutes * 60}
    try:
        while time.monotonic() - started < min(300, time_left(args) - 60):
            if process.poll() is not None:
                break
            if (run_dir / "metrics.jsonl").exists() and \
                    (run_dir / "metrics.jsonl").read_text().count("\n") >= 3 and \
                    (pids / f"rank{victim}.pid").exists():
                os.kill(int((pids / f"rank{victim}.pid").read_text()), signal.SIGKILL)
                found["killed_after_s"] = round(time.monotonic() - started, 1)
                break
            time.sleep(0.2)
        if "killed_after_s" not in found:
            process.kill()
            _, stderr = process.communicate(timeout=60)
            return {**found, "error": "the run never reached step 3",
                    "stderr": stderr.decode("utf-8", "replace")[-1500:]}
        killed_at = time.monotonic()
        limit = timeout_minutes * 60 + 60  # --dist-timeout, and torchrun's own teardown
        try:
            _, stderr = process.communicate(timeout=limit)
            found["ended_in_time"] = True
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate(timeout=60)
            found["ended_in_time"] = False
        found["seconds"] = round(time.monotonic() - killed_at, 1)
    finally:
        if process.poll() is None:
            process.kill()
    text = stderr.decode("utf-8", "replace")
    found.update(exit=process.returncode, error_lines=error_lines(text)[:4],
                 rank_traceback="]: Traceback" in text,
                 survivor_report=read_report(report), stderr_tail=text[-1200:])
    return found


def too_many_processes(args, work: Path, data: Path, count: int) -> dict:
    """`count + 1` processes on `count` GPUs, --device cuda: every process refuses with one
    line before it touches a GPU (on a CPU: torch made to see `count` GPUs)."""
    run_dir = work / "six-too-many"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {"ATTN_SMOKE_MOCK_GPUS": count} if args.device == "cpu" else {}
    arguments = ["train", data / "train.st", "-o", run_dir, "--preset", args.preset, "--device",
                 "cuda", "--max-steps", 2, "--dist-timeout", 0.5]
    started = time.monotonic()
    try:
        completed, _ = run_attn(work, "six-too-many", *arguments, processes=count + 1, env=env,
                                check=False, timeout=min(180, time_left(args)))
    except subprocess.TimeoutExpired:
        return {"refused": False, "error": "still running after 180 s"}
    text = completed.stderr.decode("utf-8", "replace")
    lines = error_lines(text)
    return {"exit": completed.returncode, "seconds": round(time.monotonic() - started, 1),
            "error_lines": sorted(set(lines))[:3], "error_line_count": len(lines),
            "refused": completed.returncode != 0 and len(lines) == count + 1
            and all("processes on this node" in line for line in lines),
            "traceback": "]: Traceback" in text, "stderr_tail": text[-800:]}
