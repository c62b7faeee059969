"""Training throughput of `attn train` on a CPU, against OpenNMT-py and the machine's matmul speed.

Speed claims are same-run ratios: this VM's speed varies by 2x from run to run, so no figure from
another run (or another machine) counts. In one run, on the bundled Multi30k en-de training data
(an 8000-piece shared BPE from `attn vocab`), the script measures:

1. `attn train` itself (a subprocess, the real command) with the `small` preset: 3+3 layers,
   d_model 256, d_ff 1024, 4 heads, shared embeddings, label smoothing 0.1, Adam with the noam
   schedule, `--batch-tokens 4096` (the reference setting). It runs `--steps` optimizer steps and
   reads source and target tokens/s (padding excluded, EOS included; the target counts the tokens
   predicted, y + EOS, and the source x + EOS) from `metrics.jsonl`, one row per `--log-every`
   steps. Rows up to step `--skip-steps` (warm-up) are left out; the others are averaged (the mean
   of the windows' rates). Checkpoint writing is outside the timed windows.
2. With `--onmt-venv DIR` (or $ATTN_ONMT_VENV): OpenNMT-py 3.5.1's `onmt_train` on the same data
   and model, in rounds alternating with attn's (attn, ONMT, attn, ONMT, ...; `--rounds`), each
   for the same number of steps with the same warm-up skipped. The peer setup follows
   ../shared/peers/README.md: the ONMT text is attn's binarized data written back as
   space-separated pieces (so the pairs and tokens are exactly attn's); its vocabulary file is
   spm.model's pieces minus the special ones, with their counts in that data; its config is
   ../shared/peers/onmt-small.yaml with the paths filled in and the model sizes, dropout, label
   smoothing, batch size and report interval set from the preset and the options here (so
   attention dropout is the preset's 0.0, not the yaml's 0.1). What
   cannot be matched: ONMT's Transformer is pre-norm only (attn's `small` is post-norm), and the
   learning-rate schedule's constants stay the yaml's (they do not change the speed). The
   `Step N/M; ...; SRC/TGT tok/s` lines that onmt_train logs (on stderr) every `--log-every` steps
   are averaged as attn's rows are.

   How ONMT counts: its target tokens are the non-padding tokens of the shifted target (y + EOS,
   BOS excluded), the same as attn's. Its source has no EOS (attn appends one), so its source
   figure is normalised to attn's count with the window's mean batch shape (`bsz: src/tgt/sents`
   in the log line): x src/s becomes x (src + sents) / src. Its `batch_size: 4096` bounds
   sentences x longest side, as attn's --batch-tokens does, with BOS and EOS both counted on the
   target (attn counts one). But it fills a bucket of 262,144 examples before its first batch
   (Multi30k's 29,000 pairs about 9 times over, in the untimed first window), sorts it by length
   and drops a repeated source within a batch: its batches are more uniform in length and carry
   a few % more real tokens per step than attn's. Both figures (target tokens per timed step;
   attn's from its rows' rate x time) are reported; the comparison is per token.
   Threads: `attn train` sets torch's threads to os.cpu_count() (it has no --threads option);
   onmt_train leaves torch's default, which OMP_NUM_THREADS (and MKL_NUM_THREADS) set: the
   script checks torch's count in the ONMT venv under that environment. --threads defaults to
   all cores, so that both use the same number (another value gives a warning).
3. The float32 matmul throughput of this machine with the same threads, measured just before the
   first round and just after the last: the best of several (2048x256)@(256x1024)-shaped and
   1024^3 products. The higher of the two counts: other work on the machine only lowers it, and
   the lower one would flatter attn's fraction.
4. Model FLOPs per second: 6 x parameters touched per token (forward 2, backward 4; the encoder's
   for source tokens, the decoder's and the output projection's for target tokens, the
   encoder-decoder key/value projections per source token) plus attention scores and weighted sums
   (4·L·d per query and layer forward, x3 with backward; causal self-attention counted half), with
   the lengths of the data. attn's figure as a fraction of the matmul figure: `gemm_fraction`.

Targets (PASS/FAIL on stderr): `onmt_ratio` = attn's median target tokens/s over its rounds /
ONMT's median over its rounds >= 1.5; `gemm_fraction` (attn's median rate) >= 0.60.

    python -m benchmarks.train_throughput                                # attn + matmul, ~2 min
    python -m benchmarks.train_throughput --onmt-venv ONMT_VENV          # + ONMT, ~6 min, 2 cores
    python -m benchmarks.train_throughput --steps 300 --rounds 3 --batch-tokens 3000

Report on stderr, one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import BUNDLED_DATA, SHARED, log
from benchmarks.machine import cpu_info  # benchmarks/machine.py

DATA_DIR = BUNDLED_DATA
PEERS_DIR = SHARED / "peers"  # README.md and onmt-small.yaml
ONMT_VERSION = "3.5.1"
TARGET_RATIO = 1.5  # attn / OpenNMT-py target tokens/s, same run
TARGET_FRACTION = 0.60  # attn's model FLOP/s / this run's float32 matmul FLOP/s
# `Step 30/   70; acc: ...; bsz: 2731/2847/148; 1405/1466 tok/s;     57 sec;`
ONMT_STEP = re.compile(r"Step\s+(\d+)/\s*\d+;.*?bsz:\s*([\d.]+)/\s*([\d.]+)/\s*([\d.]+);"
                       r"\s*([\d.]+)/\s*([\d.]+) tok/s")


def matmul_gflops(threads: int, seconds: float = 3.0) -> float:
    """Best float32 matmul throughput over a few shapes, in GFLOP/s."""
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for m, k, n in ((2048, 256, 1024), (2048, 1024, 256), (1024, 1024, 1024)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        deadline = time.perf_counter() + seconds / 3
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            for _ in range(5):
                torch.mm(a, b)
            elapsed = (time.perf_counter() - start) / 5
            best = max(best, 2 * m * k * n / elapsed / 1e9)
    return best


def flops_per_token(preset_name: str, vocab_size: int, data_path: Path) -> tuple[float, float]:
    """Training FLOPs per source token and per target token (forward + backward)."""
    import numpy as np

    from attn_cli.config import get_preset
    from attn_cli.data import ParallelData

    config = get_preset(preset_name).model_config(vocab_size)
    d, ff = config.d_model, config.d_ff
    hk, hv = config.heads * config.d_k, config.heads * config.d_v
    data = ParallelData(data_path)
    src = data.src_lengths.astype(np.float64) + 1
    tgt = data.tgt_lengths.astype(np.float64) + 1
    attention_width = hk + hv  # scores use d_k per head, weighted sums d_v per head
    # Parameters touched per token (multiply-adds), and attention per token, forward only.
    encoder_layer = d * (2 * hk + hv) + hv * d + 2 * d * ff
    decoder_layer = d * (2 * hk + hv) + hv * d + d * hk + hv * d + 2 * d * ff
    cross_kv_per_source_token = d * (hk + hv)
    per_src = config.encoder_layers * encoder_layer + config.decoder_layers * \
        cross_kv_per_source_token
    per_tgt = config.decoder_layers * decoder_layer + d * config.tgt_vocab_size
    # Attention: encoder self over S keys; decoder self (causal: T/2 keys on average) and cross
    # over S keys; per query, 2·L·width FLOPs forward.
    encoder_attention = config.encoder_layers * 2 * attention_width * (src ** 2).sum() / src.sum()
    decoder_attention = config.decoder_layers * 2 * attention_width * (
        (tgt ** 2).sum() / 2 + (tgt * src).sum()) / tgt.sum()
    src_flops = 3 * (2 * per_src + encoder_attention)  # x3: backward costs twice the forward
    tgt_flops = 3 * (2 * per_tgt + decoder_attention)
    return float(src_flops), float(tgt_flops)


def run_logged(command: list, log_path: Path, env: dict[str, str], what: str) -> float:
    """Run a command with stdout and stderr into `log_path`; its wall time in seconds. On failure,
    the log's tail on stderr and exit."""
    started = time.perf_counter()
    with open(log_path, "wb") as output:
        code = subprocess.run(list(map(str, command)), stdout=output, stderr=subprocess.STDOUT,
                              env={**os.environ, **env}).returncode
    if code:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        log("\n".join(tail))
        sys.exit(f"{what} failed (exit status {code}); the lines above end its log")
    return time.perf_counter() - started


def mean_round(windows: list[dict], what: str, log_path: Path) -> dict:
    """A round's figures: the mean of its timed windows' rates."""
    if not windows:
        sys.exit(f"{what} logged no window after the warm-up (see {log_path}): use more --steps")
    return {key: sum(window[key] for window in windows) / len(windows) for key in windows[0]}


def attn_round(attn: list, work: Path, index: int, args: argparse.Namespace,
               env: dict[str, str]) -> dict:
    """One `attn train` run from scratch; its mean target and source tokens/s after warm-up."""
    run_dir = work / f"attn-{index}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a kept --work-dir's earlier run: start afresh
    command = [*attn, "train", work / "train.st", "-o", run_dir, "--preset", args.preset,
               "--max-steps", args.steps, "--log-every", args.log_every,
               "--save-every", args.steps, "--device", "cpu",
               "--batch-tokens", args.batch_tokens, *args.extra.split()]
    if index == 1:
        log("attn: " + " ".join(map(str, command[2:])).replace(str(work), "$WORK"))
    log_path = work / f"attn-{index}.log"
    wall = run_logged(command, log_path, env, "attn train")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    windows, previous = [], {"step": 0, "elapsed_s": 0.0}
    for row in (row for row in rows if "tokens_per_s" in row):
        if row["step"] > args.skip_steps:
            # Target tokens per step: the window's rate x its time (the clock's, from the row
            # before: the same to within the writing of a metrics row) / its steps.
            seconds = row["elapsed_s"] - previous["elapsed_s"]
            windows.append({"tgt_tokens_per_s": row["tokens_per_s"],
                            "src_tokens_per_s": row["src_tokens_per_s"],
                            "tgt_tokens_per_step": row["tokens_per_s"] * seconds
                            / (row["step"] - previous["step"])})
        previous = row
    return {**mean_round(windows, "attn train", run_dir / "metrics.jsonl"), "wall_s": wall,
            "parameters": parameter_count(run_dir / f"checkpoint-{args.steps}.st")}


def parameter_count(model_file: Path) -> int:
    """Distinct parameters of a model file (the shared embedding counted once)."""
    from attn_cli.modelfile import load_model

    return sum(parameter.numel() for parameter in load_model(model_file).model.parameters())


def onmt_check(venv: Path, env: dict[str, str]) -> dict:
    """OpenNMT-py's version, and torch's version and threads in its venv under `env`."""
    python, onmt_train = venv / "bin" / "python", venv / "bin" / "onmt_train"
    for path in (python, onmt_train):
        if not path.exists():
            sys.exit(f"--onmt-venv {venv}: no {path} (see {PEERS_DIR / 'README.md'})")
    probe = ("import importlib.metadata as m, torch; "
             "print(m.version('OpenNMT-py'), torch.__version__, torch.get_num_threads())")
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                           env={**os.environ, **env})
    if found.returncode:
        sys.exit(f"--onmt-venv {venv}: {found.stderr.strip().splitlines()[-1:]}")
    version, torch_version, threads = found.stdout.split()
    if version != ONMT_VERSION:
        log(f"warning: OpenNMT-py {version} in {venv}, the reference is {ONMT_VERSION}")
    return {"onmt_train": onmt_train, "version": version, "torch": torch_version,
            "threads": int(threads)}


def onmt_prepare(work: Path, spm_model: Path, args: argparse.Namespace) -> Path:
    """ONMT's data, vocabulary and config from attn's (see the module docstring); the config."""
    import numpy as np
    import sentencepiece

    from attn_cli.config import get_preset
    from attn_cli.data import ParallelData

    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    size = processor.get_piece_size()
    pieces = np.array([processor.id_to_piece(i) for i in range(size)], dtype=object)
    # attn's spm.model: <pad> 0, <unk> 1, <s> 2, </s> 3 (the peers README's has no pad); ONMT adds
    # its own <unk>, <blank>, <s>, </s>, so these leave the vocabulary file, whatever their ids.
    special = [i for i in range(size) if processor.is_control(i) or processor.is_unknown(i)]
    # ONMT splits text and vocabulary lines on any whitespace: a piece holding some would break.
    if any(piece.split() != [piece] for piece in pieces):
        sys.exit("spm.model has a piece with whitespace in it: ONMT would split it")
    folder = work / "peers"
    (folder / "data").mkdir(parents=True, exist_ok=True)
    counts = np.zeros(size, dtype=np.int64)
    for split in ("train", "val"):
        data = ParallelData(work / f"{split}.st")
        for side, lang in (("src", "en"), ("tgt", "de")):
            ids, offsets = data.ids[side], data.offsets[side]
            if split == "train":
                counts += np.bincount(ids, minlength=size)
            lines = (" ".join(pieces[ids[offsets[i]:offsets[i + 1]]]) + "\n"
                     for i in range(len(data)))
            (folder / "data" / f"{split}.sp.{lang}").write_text("".join(lines), encoding="utf-8")
    special_set = set(special)
    (folder / "data" / "onmt.vocab").write_text("".join(
        f"{pieces[i]}\t{counts[i]}\n" for i in range(size) if i not in special_set),
        encoding="utf-8")

    # The yaml's model and batch set from the preset and these options; paths into `folder`.
    preset = get_preset(args.preset)
    if preset.d_k * preset.heads != preset.d_model or preset.d_v != preset.d_k:
        sys.exit(f"preset {args.preset}: ONMT needs d_k = d_v = d_model / heads")
    if preset.positions != "sinusoidal":
        sys.exit(f"preset {args.preset}: ONMT's Transformer has sinusoidal positions only")
    settings = {
        "enc_layers": preset.encoder_layers, "dec_layers": preset.decoder_layers,
        "hidden_size": preset.d_model, "word_vec_size": preset.d_model,
        "transformer_ff": preset.d_ff, "heads": preset.heads,
        "dropout": f"[{preset.dropout}]", "attention_dropout": f"[{preset.attention_dropout}]",
        "label_smoothing": preset.label_smoothing, "batch_size": args.batch_tokens,
        "report_every": args.log_every, "src_vocab_size": size, "tgt_vocab_size": size,
        "share_embeddings": "true", "share_decoder_embeddings": "true",
    }
    text = args.onmt_config.read_text().replace("@PEERS@", str(folder))
    for key, value in settings.items():
        text, found = re.subn(rf"^{key}:.*$", f"{key}: {value}", text, flags=re.M)
        if not found:
            text += f"{key}: {value}\n"
    config = work / "onmt-small.yaml"
    config.write_text(text)
    return config


def onmt_round(onmt: dict, config: Path, work: Path, index: int, args: argparse.Namespace,
               env: dict[str, str]) -> dict:
    """One `onmt_train` run from scratch; its mean tokens/s after warm-up, the source normalised
    to attn's count (+ EOS), and its real target tokens per step."""
    command = [onmt["onmt_train"], "-config", config, "-train_steps", args.steps]
    if index == 1:
        log("onmt: " + " ".join(map(str, command)).replace(str(work), "$WORK"))
    log_path = work / f"onmt-{index}.log"
    wall = run_logged(command, log_path, env, "onmt_train")
    text = log_path.read_text(errors="replace")
    parameters = re.search(r"\* number of parameters: (\d+)", text)
    windows = []
    for match in ONMT_STEP.finditer(text):
        step = int(match.group(1))
        src_batch, tgt_batch, sents_batch, src_per_s, tgt_per_s = map(float, match.groups()[1:])
        if step > args.skip_steps:
            windows.append({"tgt_tokens_per_s": tgt_per_s,
                            "src_tokens_per_s": src_per_s * (src_batch + sents_batch) / src_batch,
                            "src_tokens_per_s_onmt": src_per_s,
                            "tgt_tokens_per_step": tgt_batch})
    return {**mean_round(windows, "onmt_train", log_path), "wall_s": wall,
            "parameters": int(parameters.group(1)) if parameters else None}


def log_round(name: str, row: dict) -> None:
    log(f"{name}: {row['tgt_tokens_per_s']:,.0f} tgt + {row['src_tokens_per_s']:,.0f} src "
        f"tokens/s, {row['tgt_tokens_per_step']:,.0f} tgt tokens/step ({row['wall_s']:.0f} s)")


def median_of(rounds: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rounds)


def measure(work: Path, args: argparse.Namespace, onmt: dict | None,
            env: dict[str, str]) -> dict:
    """Data, vocabulary and configs in `work`, then the matmul, the alternated rounds and the
    matmul again; the raw figures."""
    for split in ("train", "val"):
        for lang in ("en", "de"):
            with gzip.open(DATA_DIR / f"{split}.{lang}.gz", "rb") as source:
                (work / f"{split}.{lang}").write_bytes(source.read())
    attn = [sys.executable, "-m", "attn_cli"]
    subprocess.run([*attn, "vocab", work / "train.en", work / "train.de", "-o",
                    work / "spm.model", "--size", "8000"], check=True, stderr=subprocess.DEVNULL)
    for split in ("train", "val") if onmt else ("train",):
        subprocess.run([*attn, "binarize", "--vocab", work / "spm.model", work / f"{split}.en",
                        work / f"{split}.de", "-o", work / f"{split}.st"], check=True,
                       stderr=subprocess.DEVNULL)
    onmt_config = onmt_prepare(work, work / "spm.model", args) if onmt else None
    src_flops, tgt_flops = flops_per_token(args.preset, 8000, work / "train.st")

    log(f"matmul: measuring float32 GFLOP/s with {args.threads} threads")
    before = matmul_gflops(args.threads)
    attn_rounds, onmt_rounds = [], []
    for index in range(1, args.rounds + 1):  # attn, ONMT, attn, ONMT, ...
        attn_rounds.append(attn_round(attn, work, index, args, env))
        log_round(f"round {index} attn", attn_rounds[-1])
        if onmt:
            onmt_rounds.append(onmt_round(onmt, onmt_config, work, index, args, env))
            log_round(f"round {index} onmt", onmt_rounds[-1])
    after = matmul_gflops(args.threads)
    return {"attn_rounds": attn_rounds, "onmt_rounds": onmt_rounds, "matmul_before": before,
            "matmul_after": after, "flops_per_src_token": src_flops,
            "flops_per_tgt_token": tgt_flops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=70, help="Optimizer steps per round.")
    parser.add_argument("--log-every", type=int, default=10, help="Steps per timed window.")
    parser.add_argument("--skip-steps", type=int, default=20, help="Warm-up steps not timed.")
    parser.add_argument("--rounds", type=int, default=2, help="attn (and ONMT) runs, alternated.")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--extra", default="", help="More `attn train` options, quoted.")
    parser.add_argument("--onmt-venv", type=Path, default=os.environ.get("ATTN_ONMT_VENV"),
                        help="An OpenNMT-py 3.5.1 venv: measure it too (default: "
                        "$ATTN_ONMT_VENV, else attn only).")
    parser.add_argument("--onmt-config", type=Path, default=PEERS_DIR / "onmt-small.yaml")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="Keep the data, configs, logs and runs here (default: a temporary "
                        "folder, removed).")
    args = parser.parse_args()
    if args.skip_steps % args.log_every or args.steps < args.skip_steps + args.log_every:
        parser.error(f"--skip-steps must be a multiple of --log-every, and --steps at least "
                     f"--skip-steps + --log-every ({args.skip_steps + args.log_every}) so that "
                     f"a timed window follows the warm-up")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    cpu_name, isa = cpu_info()
    attn_threads = os.cpu_count() or 1  # what `attn train` sets, whatever OMP_NUM_THREADS says
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    if attn_threads != args.threads:
        log(f"warning: `attn train` uses all {attn_threads} cores, not --threads {args.threads}")
    onmt = onmt_check(args.onmt_venv, env) if args.onmt_venv else None
    if onmt and onmt["threads"] != args.threads:
        log(f"warning: torch in {args.onmt_venv} uses {onmt['threads']} threads, "
            f"not {args.threads}")

    if args.work_dir:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        raw = measure(args.work_dir.resolve(), args, onmt, env)
    else:
        with tempfile.TemporaryDirectory(prefix="attn-train-bench.") as scratch:
            raw = measure(Path(scratch), args, onmt, env)

    attn_rounds, onmt_rounds = raw["attn_rounds"], raw["onmt_rounds"]
    tgt_per_s, src_per_s, per_step = (median_of(attn_rounds, key) for key in (
        "tgt_tokens_per_s", "src_tokens_per_s", "tgt_tokens_per_step"))
    model_gflops = (src_per_s * raw["flops_per_src_token"]
                    + tgt_per_s * raw["flops_per_tgt_token"]) / 1e9
    before, after = raw["matmul_before"], raw["matmul_after"]
    matmul = max(before, after)  # a busy machine only lowers it (see the docstring)
    fraction = model_gflops / matmul
    result = {
        "cpu": cpu_name, "isa": isa, "threads": args.threads, "attn_threads": attn_threads,
        "preset": args.preset, "batch_tokens": args.batch_tokens, "steps": args.steps,
        "log_every": args.log_every, "skip_steps": args.skip_steps, "rounds": args.rounds,
        "tgt_tokens_per_s": tgt_per_s, "src_tokens_per_s": src_per_s,
        "tgt_tokens_per_step": per_step, "parameters": attn_rounds[0]["parameters"],
        "attn_rounds": attn_rounds, "model_gflops_per_s": model_gflops,
        "matmul_gflops_per_s": matmul, "matmul_before": before, "matmul_after": after,
        "flops_per_src_token": raw["flops_per_src_token"],
        "flops_per_tgt_token": raw["flops_per_tgt_token"],
        "gemm_fraction": fraction, "onmt_ratio": None, "onmt": None,
        "targets": {"onmt_ratio": TARGET_RATIO, "gemm_fraction": TARGET_FRACTION},
        "pass": {"onmt_ratio": None, "gemm_fraction": fraction >= TARGET_FRACTION},
    }
    log(f"\n{cpu_name} ({isa}), {args.threads} threads; {args.rounds} round(s) of {args.steps} "
        f"steps, the first {args.skip_steps} not timed; --preset {args.preset} "
        f"--batch-tokens {args.batch_tokens}; medians of rounds")
    log(f"  attn train: {tgt_per_s:,.0f} target + {src_per_s:,.0f} source tokens/s, "
        f"{per_step:,.0f} target tokens/step, {result['parameters'] or 0:,} parameters")
    if onmt:
        onmt_tgt, onmt_src, onmt_per_step = (median_of(onmt_rounds, key) for key in (
            "tgt_tokens_per_s", "src_tokens_per_s", "tgt_tokens_per_step"))
        result["onmt_ratio"] = ratio = tgt_per_s / onmt_tgt
        result["pass"]["onmt_ratio"] = ratio >= TARGET_RATIO
        result["onmt"] = {
            "version": onmt["version"], "torch": onmt["torch"], "threads": onmt["threads"],
            "tgt_tokens_per_s": onmt_tgt, "src_tokens_per_s": onmt_src,
            "tgt_tokens_per_step": onmt_per_step, "parameters": onmt_rounds[0]["parameters"],
            "rounds": onmt_rounds, "src_ratio": src_per_s / onmt_src,
            "round_ratios": [a["tgt_tokens_per_s"] / o["tgt_tokens_per_s"]
                             for a, o in zip(attn_rounds, onmt_rounds)],
        }
        log(f"  OpenNMT-py {onmt['version']}: {onmt_tgt:,.0f} target + {onmt_src:,.0f} source "
            f"tokens/s (source + EOS, as attn counts), {onmt_per_step:,.0f} target "
            f"tokens/step, {result['onmt']['parameters'] or 0:,} parameters")
        log(f"  attn/ONMT: target {ratio:.2f}x, source {src_per_s / onmt_src:.2f}x; target by "
            f"round " + ", ".join(f"{r:.2f}x" for r in result["onmt"]["round_ratios"]))
    log(f"  attn model {model_gflops:.1f} GFLOP/s = {100 * fraction:.0f}% of this run's float32 "
        f"matmul {matmul:.1f} GFLOP/s (the higher of before {before:.1f}, after {after:.1f})")
    if abs(before - after) > 0.2 * max(before, after):
        log("  warning: the matmul figures before and after differ by more than 20%: the machine "
            "was busy; the higher one is used, but the rounds may have been slowed too")
    if onmt:
        log(f"{'PASS' if result['pass']['onmt_ratio'] else 'FAIL'} onmt_ratio {ratio:.2f} "
            f"(attn/ONMT target tokens/s, medians; target >= {TARGET_RATIO})")
    else:
        log("onmt_ratio: not measured (no --onmt-venv or $ATTN_ONMT_VENV)")
    log(f"{'PASS' if result['pass']['gemm_fraction'] else 'FAIL'} gemm_fraction {fraction:.2f} "
        f"(target >= {TARGET_FRACTION})")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
