"""The GPU smoke's stages 2-4 (checks/gpu_smoke.py): the data, one-GPU training and what it costs
(Multi30k, WMT-shaped synthetic data, the per-rank proxy of eight GPUs, the variants), stop,
resume and average.
"""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .gpu_smoke_common import (
    BUNDLED,
    FOUND,
    Skip,
    attn_command,
    budget,
    log,
    metrics_rows,
    model_tflops,
    params_touched,
    popen,
    run,
    run_attn,
    save_progress,
    stderr_tail,
    time_left,
    train_dtype,
    training_figures,
    weights_difference,
)

WMT_VOCABULARY = 37_000  # WMT14 en-de's shared BPE (the paper's §5.1)
WMT_MEAN_LENGTH = 28  # subword pieces per sentence, about, in WMT14 en-de at 37k
TARGET_TOKENS_PER_S = 300_000  # the targets for base on one H100
TARGET_SHARE = 0.35


def need_device(args) -> None:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device (--device cpu runs the stages that allow it)")


def seconds_for(args, wanted: float, least: float = 30, keep: float = 0) -> float:
    """The training time (--max-time) a run may take: `wanted`, or less where the call's later
    stages (args.reserve) and `keep` seconds for the rest of this stage would not fit, but not
    less than `least`; Skip when even `least` does not fit before --deadline."""
    hard = time_left(args) - 45  # the start-up, the save and reading the results
    if hard < least:
        raise Skip(f"out of time (--deadline): {max(hard, 0):.0f}s left for it")
    return max(least, min(wanted, budget(args) - keep - 45, hard))


# ---------------------------------------------------------------------------------- stage 2


def stage_data(args, work: Path, found: dict) -> None:
    """`attn vocab` and `attn binarize` on the bundled Multi30k, as the demo does (--lines: the
    first N training pairs only, to try the script quickly on a CPU)."""
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    settings = {"lines": args.lines, "vocab_size": args.vocab_size}
    settings_path = data / "settings.json"
    if (data / "train.st").exists() and settings_path.exists() and \
            json.loads(settings_path.read_text()) == settings:
        found["summary"] = "Multi30k vocab and binarize (reused from --work)"
        return
    settings_path.unlink(missing_ok=True)
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            with gzip.open(BUNDLED / f"{split}.{lang}.gz", "rb") as source:
                lines = source.read().splitlines(keepends=True)
            (data / f"{split}.{lang}").write_bytes(b"".join(lines[:args.lines]))
    seconds = {"vocab": run(attn_command("vocab", data / "train.en", data / "train.de", "-o",
                                         data / "spm.model", "--size", args.vocab_size),
                            timeout=time_left(args)).seconds}
    for name, split in (("train.st", "train"), ("valid.st", "val")):
        seconds[name] = run(attn_command("binarize", "--vocab", data / "spm.model",
                                         data / f"{split}.en", data / f"{split}.de", "-o",
                                         data / name), timeout=time_left(args)).seconds
    settings_path.write_text(json.dumps(settings))
    found["seconds"] = seconds
    found["pairs"] = len((data / "train.en").read_bytes().splitlines())
    found["summary"] = (f"Multi30k ({found['pairs']} pairs) vocab ({args.vocab_size} BPE) and "
                        f"binarize in {sum(seconds.values()):.1f}s")


def need_data(work: Path) -> Path:
    data = work / "data"
    if not (data / "train.st").exists():
        raise Skip("no data: stage 2 makes it (run it in the same call)")
    return data


# ---------------------------------------------------------------------------------- stage 3


def stage_one_gpu(args, work: Path, found: dict) -> None:
    """`train --preset base` in bf16 on Multi30k (the model later stages decode with); then,
    unless --no-variants: the same network on WMT-shaped synthetic data (tokens/s as a share of
    the GPU's own matmul rate: N13), one rank of eight's step alone (--batch-tokens 3125, with
    its kernels per step: N5), the syncs of a step, and short runs with --max-tokens 4096, fp16,
    fp32 and cuDNN attention off."""
    need_device(args)
    data = need_data(work)
    base_training(args, work, data, found)
    if args.no_variants:
        found["summary"] = base_summary(found)
        return
    parts = [("wmt_shaped", wmt_shaped), ("proxy_bt3125", rank_proxy), ("syncs", sync_audit),
             ("variants", variants)]
    for name, part in parts:
        save_progress(f"stage 3: {name}")
        try:
            part(args, work, data, found)
        except Skip as why:
            found[name] = f"skipped: {why}"
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            found[name] = {"error": str(error)[-1500:]}
            found["status"] = "FAIL"
        log(f"       {name}: {short(found.get(name))}")
    found["summary"] = base_summary(found) + "; " + extras_summary(found)


def short(value, characters: int = 600) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= characters else text[:characters] + " ..."


def log_every(steps: int) -> int:
    """Metrics rows often enough for a median of several (tokens/s, ms/step), at most every
    10 steps."""
    return max(1, min(10, steps // 5))


def common_options(args, data: Path) -> list:
    return ["--preset", args.preset, "--device", args.device, "--seed", 1, "--warmup",
            args.warmup, "--lr-scale", args.lr_scale]


def base_training(args, work: Path, data: Path, found: dict) -> None:
    run_dir = work / "base"
    if not (run_dir / "done").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        seconds = seconds_for(args, 1500, least=20, keep=0 if args.no_variants else 200)
        save_every = max(1, args.steps // 4)
        completed, report = run_attn(
            work, "base", "train", data / "train.st", "-o", run_dir, *common_options(args, data),
            "--dtype", train_dtype(args), "--valid", data / "valid.st", "--valid-metric", "bleu",
            "--valid-ref", data / "val.de", "--max-steps", args.steps, "--save-every",
            save_every, "--log-every", max(1, min(20, args.steps // 10)), "--keep-best", 3,
            "--max-time", f"{seconds:.0f}s", timeout=seconds + 180)
        (run_dir / "done").write_text(json.dumps(report))
        found["wall_s"] = round(completed.seconds, 1)
    report = json.loads((run_dir / "done").read_text())
    found["base"] = {**training_figures(run_dir), "dtype": train_dtype(args),
                     "peak_gib": report.get("peak_gib"), "attn_cli": report.get("attn_cli")}
    log(f"       base {train_dtype(args)} on Multi30k: {short(found['base'])}")
    save_progress()


def base_summary(found: dict) -> str:
    base = found["base"]
    return (f"base {base['dtype']} (Multi30k, {base['steps']} steps): "
            f"{base['tgt_tokens_per_s'] or 0:,.0f} tgt tok/s, {base['ms_per_step'] or 0:.0f} "
            f"ms/step, peak {base['peak_gib'] or 0:.1f} GiB, valid_s {base['valid_s']}, BLEU "
            f"{base.get('valid_bleu')}")


# --------------------------------------------------------------- WMT-shaped synthetic data


def write_wmt_shaped(path: Path, pairs: int, seed: int = 1, vocabulary: int = WMT_VOCABULARY,
                     mean_length: float = WMT_MEAN_LENGTH) -> dict:
    """A data file shaped like WMT14 en-de, made without text or internet: a 37,000-piece
    shared vocabulary and lognormal lengths of mean ~28 pieces (sigma 0.6, the target ~6%
    longer), ids drawn Zipf-like (p ∝ 1/(rank + 20)). Written by attn's own writer
    (stfile.write_streaming with binarize's metadata), so `attn train` reads it as any data
    file; the vocabulary is a piece list of 37,000 ids over the bundled test SentencePiece
    model (Vocabulary.with_pieces), whose size is all training needs. About a second for 150k
    pairs."""
    import numpy as np

    from attn_cli import stfile
    from attn_cli.data import BinarizeStats, _data_metadata
    from attn_cli.formats import SPECIAL_PIECES, ids_tensor, offsets_tensor, vocab_tensor
    from attn_cli.vocab import Vocabulary

    started = time.perf_counter()
    specials = [SPECIAL_PIECES[index] for index in sorted(SPECIAL_PIECES)]
    pieces = specials + [f"\u2581w{index}" for index in range(len(specials), vocabulary)]
    spm_bytes = (Path(__file__).resolve().parent.parent / "tests" / "fixtures" /
                 "spm.model").read_bytes()
    vocab = Vocabulary.with_pieces(spm_bytes, pieces)
    rng = np.random.default_rng(seed)
    sigma = 0.6
    source = np.clip(np.rint(rng.lognormal(np.log(mean_length) - sigma ** 2 / 2, sigma, pairs)),
                     1, 250).astype(np.int64)
    target = np.clip(np.rint(source * rng.lognormal(0.05, 0.15, pairs)), 1, 250).astype(np.int64)
    ranks = np.arange(len(specials), vocabulary)
    weights = 1.0 / (ranks - len(specials) + 20.0)
    weights /= weights.sum()
    tensors = []
    for side, lengths in (("src", source), ("tgt", target)):
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("<i8")
        ids = rng.choice(ranks, size=int(lengths.sum()), p=weights).astype("<i4")
        tensors += [stfile.TensorSource(offsets_tensor(side), np.dtype("<i8"), (len(offsets),),
                                        data=offsets.tobytes()),
                    stfile.TensorSource(ids_tensor(side), np.dtype("<i4"), (len(ids),),
                                        data=ids.tobytes())]
    tensors.append(stfile.TensorSource(vocab_tensor("src"), np.dtype(np.uint8),
                                       (len(vocab.model_bytes),), data=vocab.model_bytes))
    stats = BinarizeStats(lines=pairs, pairs=pairs, src_tokens=int(source.sum()),
                          tgt_tokens=int(target.sum()))
    stfile.write_streaming(path, tensors, _data_metadata(stats, vocab, None, 1024,
                                                         "synthetic-wmt.en", "synthetic-wmt.de"))
    return {"pairs": pairs, "vocabulary": vocabulary, "src_mean": float(source.mean()),
            "tgt_mean": float(target.mean()), "seconds": round(time.perf_counter() - started, 2)}


def wmt_data(args, work: Path, steps: int) -> tuple[Path, dict]:
    """The WMT-shaped data file, enough pairs for `steps` of the preset's batch."""
    from attn_cli.config import PRESETS

    tokens = PRESETS[args.preset].batch_tokens * (steps + 10)
    pairs = max(2000, min(400_000, int(tokens / WMT_MEAN_LENGTH * 1.2)))
    path = work / "wmt-shaped.st"
    facts_path = work / "wmt-shaped.json"
    if path.exists() and facts_path.exists() and \
            json.loads(facts_path.read_text())["pairs"] >= pairs:
        return path, json.loads(facts_path.read_text())
    facts = write_wmt_shaped(path, pairs)
    facts_path.write_text(json.dumps(facts))
    return path, facts


def matmul_bf16_tflops(args) -> float | None:
    """The GPU's bf16 matmul rate: stage 0's when it ran in this call, else measured now."""
    measured = FOUND.get(0, {}).get("matmul_tflops", {}).get("bf16")
    if measured or args.device != "cuda":
        return measured
    from .gpu_smoke_kernels import matmul_rates

    return matmul_rates(kinds=("bf16",))["bf16"]


def wmt_shaped(args, work: Path, data: Path, found: dict) -> None:
    """The preset on WMT-shaped data (N13), profiled at steps 5-7: tokens/s, model TFLOP/s,
    their share of the GPU's own bf16 matmul rate, and the issue's targets restated on it."""
    steps = args.wmt_steps
    path, facts = wmt_data(args, work, steps)
    run_dir = work / "wmt-shaped"
    shutil.rmtree(run_dir, ignore_errors=True)
    seconds = seconds_for(args, 600)
    trace = work / "trace-wmt-shaped.json"
    completed, report = run_attn(
        work, "wmt-shaped", "train", path, "-o", run_dir, *common_options(args, data),
        "--dtype", train_dtype(args), "--max-steps", steps, "--log-every", log_every(steps),
        "--save-every", 10 * steps, "--max-time", f"{seconds:.0f}s", timeout=seconds + 180,
        env={"ATTN_SMOKE_PROFILE": 5, "ATTN_SMOKE_TRACE": trace}, check=False)
    figures = {**training_figures(run_dir), "data": facts, "exit": completed.returncode,
               "peak_gib": report.get("peak_gib"), "profile": report.get("profile"),
               "dispatch_ops_per_step": report.get("dispatch_ops_per_step")}
    if completed.returncode:
        figures["stderr"] = stderr_tail(completed)
    touched = params_touched(args.preset, WMT_VOCABULARY)
    figures["params_touched"] = touched
    figures["model_tflops"] = model_tflops(figures, touched)
    matmul = matmul_bf16_tflops(args)
    figures["matmul_bf16_tflops"] = matmul
    if figures["model_tflops"] and matmul:
        figures["share_of_matmul"] = figures["model_tflops"] / matmul
        figures["targets"] = restate_targets(figures, touched, matmul)
    if trace.exists():
        with open(trace, "rb") as source, gzip.open(Path(args.out) / "trace-wmt-shaped.json.gz",
                                                    "wb", compresslevel=6) as target:
            shutil.copyfileobj(source, target)
        trace.unlink()
    found["wmt_shaped"] = figures
    if completed.returncode:
        found["status"] = "FAIL"


def restate_targets(figures: dict, touched: dict, matmul: float) -> dict:
    """The issue's two targets for base on one GPU, each in the other's terms on this GPU:
    300k target tokens/s as a share of the measured bf16 matmul rate, and 35% of that rate as
    target tokens/s (source tokens in this run's proportion to target tokens)."""
    ratio = figures["src_tokens_per_s"] / figures["tgt_tokens_per_s"]
    flops_per_tgt_token = 6 * (ratio * touched["encoder"] + touched["decoder"] + touched["output"])
    return {
        "300k_tok_s_share_of_matmul": TARGET_TOKENS_PER_S * flops_per_tgt_token / 1e12 / matmul,
        "35pct_of_matmul_tok_s": TARGET_SHARE * matmul * 1e12 / flops_per_tgt_token,
        "measured_tok_s": figures["tgt_tokens_per_s"],
        "measured_share_of_matmul": figures["model_tflops"] / matmul,
    }


def rank_proxy(args, work: Path, data: Path, found: dict) -> None:
    """One rank of eight's step alone (N5): on eight GPUs the paper's 25,000 tokens are 3,125
    per rank, one forward and backward each per step; here `--batch-tokens 3125` on one GPU,
    WMT-shaped, profiled: ms/step, kernels launched per step (the launch budget), and 8x its
    tokens/s, what eight such ranks would do with a free all-reduce."""
    steps = args.wmt_steps
    path, _ = wmt_data(args, work, steps)
    run_dir = work / "proxy-bt3125"
    shutil.rmtree(run_dir, ignore_errors=True)
    seconds = seconds_for(args, 300)
    completed, report = run_attn(
        work, "proxy-bt3125", "train", path, "-o", run_dir, *common_options(args, data),
        "--dtype", train_dtype(args), "--batch-tokens", 3125, "--max-steps", steps,
        "--log-every", log_every(steps), "--save-every", 10 * steps, "--max-time",
        f"{seconds:.0f}s",
        timeout=seconds + 180, env={"ATTN_SMOKE_PROFILE": 5}, check=False)
    figures = {**training_figures(run_dir), "exit": completed.returncode,
               "profile": report.get("profile"),
               "dispatch_ops_per_step": report.get("dispatch_ops_per_step")}
    if figures["tgt_tokens_per_s"]:
        figures["eight_ranks_tok_s_upper_bound"] = 8 * figures["tgt_tokens_per_s"]
    if completed.returncode:
        figures["stderr"] = stderr_tail(completed)
        found["status"] = "FAIL"
    found["proxy_bt3125"] = figures


def sync_audit(args, work: Path, data: Path, found: dict) -> None:
    """The host-device syncs of training steps 3-7 and the attn lines that cause them (a
    sync-free step has exactly one: the step's sums read back)."""
    if args.device != "cuda":
        raise Skip("syncs are CUDA's")
    seconds_for(args, 20)
    audit_dir = work / "sync-audit"
    shutil.rmtree(audit_dir, ignore_errors=True)
    _, report = run_attn(work, "syncs", "train", data / "train.st", "-o", audit_dir,
                         *common_options(args, data), "--dtype", "bf16", "--max-steps", 8,
                         "--log-every", 4, "--save-every", 1000,
                         env={"ATTN_SMOKE_SYNCS": "1"}, check=False, timeout=time_left(args))
    in_steps = [sync for sync in report.get("syncs", []) if 2 <= sync["step"] < 7]
    where: dict = {}
    for sync in in_steps:
        where[sync["where"]] = where.get(sync["where"], 0) + 1
    found["syncs"] = {"per_step": len(in_steps) / 5, "where": where, "examples": in_steps[:3]}


def supports_option(command: str, option: str) -> bool:
    completed = run(attn_command(command, "--help"), check=False, timeout=60)
    return option in completed.stdout.decode("utf-8", "replace")


def variants(args, work: Path, data: Path, found: dict) -> None:
    """Short runs of the base recipe changed one way each (tokens/s and peak memory)."""
    options = {"max_tokens_4096": ["--dtype", train_dtype(args), "--max-tokens", 4096],
               "fp16": ["--dtype", "fp16"], "fp32_tf32": ["--dtype", "fp32"],
               # torch's own choice of attention kernels (cuDNN's on an H100), against the
               # default's (off since the first H100 run measured them)
               "cudnn_attention_auto": ["--dtype", train_dtype(args), "--cudnn-attention",
                                        "auto"]}
    found["variants"] = {}
    for name, extra in options.items():
        if args.device != "cuda" and name in ("fp16", "cudnn_attention_auto"):
            found["variants"][name] = "skipped: CUDA only"
            continue
        if name == "cudnn_attention_auto" and not supports_option("train", "--cudnn-attention"):
            found["variants"][name] = "skipped: this attn has no train --cudnn-attention"
            continue
        try:
            seconds = seconds_for(args, 120, least=15)
        except Skip as why:
            found["variants"][name] = f"skipped: {why}"
            continue
        variant_dir = work / f"variant-{name}"
        shutil.rmtree(variant_dir, ignore_errors=True)
        completed, report = run_attn(
            work, name, "train", data / "train.st", "-o", variant_dir,
            *common_options(args, data), *extra, "--max-steps", args.short_steps,
            "--log-every", log_every(args.short_steps), "--save-every", 10_000, "--max-time",
            f"{seconds:.0f}s",
            timeout=seconds + 180, check=False)
        figures = training_figures(variant_dir)
        figures.update(exit=completed.returncode, peak_gib=report.get("peak_gib"))
        if completed.returncode:
            figures["stderr"] = stderr_tail(completed)
            found["status"] = "FAIL"
        state = sorted(variant_dir.glob("checkpoint-*.state.st"))
        if name == "fp16" and state:
            from safetensors import safe_open

            with safe_open(str(state[-1]), "pt") as handle:
                figures["scaler"] = json.loads(handle.metadata().get("scaler", "{}"))
        found["variants"][name] = figures
        save_progress()


def extras_summary(found: dict) -> str:
    parts = []
    wmt = found.get("wmt_shaped")
    if isinstance(wmt, dict) and wmt.get("tgt_tokens_per_s"):
        share = wmt.get("share_of_matmul")
        busy = (wmt.get("profile") or {}).get("busy_fraction")
        parts.append(f"WMT-shaped {wmt['tgt_tokens_per_s']:,.0f} tgt tok/s"
                     + (f" = {share:.1%} of the measured bf16 matmul rate" if share else "")
                     + (f", GPU busy {busy:.0%}" if busy else ""))
    proxy = found.get("proxy_bt3125")
    if isinstance(proxy, dict) and proxy.get("tgt_tokens_per_s"):
        kernels = (proxy.get("profile") or {}).get("kernels_per_step")
        parts.append(f"--batch-tokens 3125: {proxy['ms_per_step'] or 0:.1f} ms/step, "
                     f"{kernels if kernels is not None else 'n/a'} kernels/step, "
                     f"{proxy.get('dispatch_ops_per_step')} ops/step")
    if isinstance(found.get("syncs"), dict):
        parts.append(f"syncs/step {found['syncs']['per_step']:.1f}")
    for name, figures in (found.get("variants") or {}).items():
        if isinstance(figures, dict):
            parts.append(f"{name} {figures.get('tgt_tokens_per_s') or 0:,.0f} tok/s "
                         f"(exit {figures.get('exit')})")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------- stage 4


def stage_resume(args, work: Path, found: dict) -> None:
    """SIGTERM mid-run, --resume to the end, compared with the same run uninterrupted and with
    itself run twice (what "resumed = uninterrupted" means on a GPU); then `attn average`."""
    need_device(args)
    data = need_data(work)
    steps = 60
    seconds_for(args, 60)
    common = ["train", data / "train.st", *common_options(args, data), "--dtype",
              train_dtype(args), "--max-steps", steps, "--log-every", 10, "--save-every", 1000]
    runs = {}
    for name in ("straight", "again"):
        directory = work / f"resume-{name}"
        shutil.rmtree(directory, ignore_errors=True)
        run(attn_command(*common, "-o", directory), timeout=time_left(args))
        runs[name] = directory
    interrupted = work / "resume-interrupted"
    shutil.rmtree(interrupted, ignore_errors=True)
    process = popen(attn_command(*common, "-o", interrupted), stderr=subprocess.PIPE,
                    stdout=subprocess.DEVNULL)
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
    resumed = run(attn_command(*common, "-o", interrupted, "--resume"), timeout=time_left(args))
    runs["interrupted"] = interrupted

    def last_loss(directory: Path) -> float:
        return [row["loss"] for row in metrics_rows(directory) if "loss" in row][-1]

    found.update({
        "sigterm": stopped, "resume_exit": resumed.returncode,
        "loss": {name: last_loss(directory) for name, directory in runs.items()},
        "weights_max_abs_diff": {
            "straight_vs_again": weights_difference(runs["straight"], runs["again"]),
            "straight_vs_resumed": weights_difference(runs["straight"], runs["interrupted"])},
    })
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
    if stopped["exit"] != 0 or not stopped["checkpoints"] or gap > 0.02 or found["average_exit"]:
        found["status"] = "FAIL"
