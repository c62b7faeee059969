"""What the GPU smoke's stages share (checks/gpu_smoke.py): where the checkout is and how every
child process finds it, the log, the clock of --deadline, the commands (attn, the runner, torchrun)
and what a training run's metrics and checkpoints say.

How children find the checkout (review N2): REPO is this file's parent's parent, and every child
runs with REPO first on PYTHONPATH (`child_env`), by module name (`python -m attn_cli`, `python -m
checks.gpu_smoke_runner`, `python -m torch.distributed.run ... -m checks.gpu_smoke_runner`): from
any working directory, with or without attn installed, they import this checkout's attn_cli.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLED = REPO / "examples" / "multi30k" / "data"  # Multi30k en-de, gzipped
STARTED = time.monotonic()
_LOG_FILE: list[Path] = []  # OUT/smoke.log once main() has set it
_PROGRESS: list = []  # main()'s writer of OUT/results.json
FOUND: dict[int, dict] = {}  # what each stage of this call found so far, by stage number


class Skip(Exception):
    """A stage, or a part of one, that cannot run here (why in the message)."""


def log(message: str = "") -> None:
    """A report line: on stderr (stdout carries the final JSON), and in OUT/smoke.log."""
    print(message, file=sys.stderr, flush=True)
    if _LOG_FILE:
        with open(_LOG_FILE[0], "a", encoding="utf-8") as handle:
            handle.write(message + "\n")


def set_log_file(path: Path) -> None:
    _LOG_FILE[:] = [path]


def set_progress(callback) -> None:
    _PROGRESS[:] = [callback]


def save_progress(note: str = "") -> None:
    """OUT/results.json rewritten with the running stage's findings so far and `note` (what
    it does next): a call cut off by its time limit keeps what it found."""
    if note:
        log(f"       ... {note}")
    if _PROGRESS:
        _PROGRESS[0](note)


def elapsed() -> float:
    return time.monotonic() - STARTED


def time_left(args) -> float:
    """Seconds left before --deadline (counted from the smoke's start)."""
    return args.deadline - elapsed()


def budget(args) -> float:
    """Seconds this stage may spend: what is left before --deadline less what the call's later
    stages are estimated to need (args.reserve, set by main before each stage)."""
    return time_left(args) - getattr(args, "reserve", 0.0)


def child_env(extra: dict | None = None) -> dict:
    """The environment of every child: this one, with REPO first on PYTHONPATH (N2)."""
    path = [str(REPO)] + [part for part in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                          if part and Path(part).resolve() != REPO]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1",
            **{key: str(value) for key, value in (extra or {}).items()}}


def attn_command(*args) -> list[str]:
    return [sys.executable, "-m", "attn_cli", *map(str, args)]


def runner_command(*args) -> list[str]:
    """`attn ARGS` through checks/gpu_smoke_runner.py (what only the process knows: its peak
    memory, syncs, a profile, whether DDP wrapped the model)."""
    return [sys.executable, "-m", "checks.gpu_smoke_runner", *map(str, args)]


def torchrun_command(processes: int, *args) -> list[str]:
    """`attn ARGS` in `processes` processes under torchrun, through the runner. torchrun as
    `python -m torch.distributed.run`: a fresh machine's Python may have no `torchrun` script
    beside it."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(processes), "-m", "checks.gpu_smoke_runner", *map(str, args)]


def run(args: list, timeout: float = 600, env: dict | None = None, input: bytes | None = None,
        check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """A child process to its end (its stderr's tail in the error when it fails and `check`);
    `.seconds` is its wall time."""
    started = time.monotonic()
    completed = subprocess.run(list(map(str, args)), capture_output=True, timeout=max(1, timeout),
                               env=child_env(env), input=input, cwd=cwd)
    completed.seconds = time.monotonic() - started
    if check and completed.returncode != 0:
        tail = completed.stderr.decode("utf-8", "replace")[-3000:]
        shown = " ".join(map(str, args[2:]))[:300]
        raise RuntimeError(f"exit {completed.returncode}: {shown}\n{tail}")
    return completed


def popen(args: list, env: dict | None = None, **options) -> subprocess.Popen:
    return subprocess.Popen(list(map(str, args)), env=child_env(env), **options)


def run_attn(work: Path, name: str, *args, env: dict | None = None, timeout: float = 600,
             input: bytes | None = None, check: bool = True,
             processes: int = 0) -> tuple[subprocess.CompletedProcess, dict]:
    """`attn ARGS` through the runner (under torchrun when `processes` > 0): (the process, rank
    0's report)."""
    report_path = work / f"{name}.report.json"
    report_path.unlink(missing_ok=True)
    command = torchrun_command(processes, *args) if processes else runner_command(*args)
    completed = run(command, timeout=timeout, input=input, check=check,
                    env={"ATTN_SMOKE_REPORT": report_path, **(env or {})})
    return completed, read_report(report_path)


def read_report(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def stderr_tail(completed, characters: int = 1500) -> str:
    return completed.stderr.decode("utf-8", "replace")[-characters:]


def error_lines(stderr: str) -> list[str]:
    """The `error: ...` lines of attn's processes (under torchrun prefixed `[rank]:`)."""
    found = []
    for line in stderr.splitlines():
        text = line.split("]:", 1)[1].strip() if line.startswith("[") and "]:" in line else line
        if text.startswith("error:"):
            found.append(text[:300])
    return found


# ------------------------------------------------------------------- training runs' results


def metrics_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    return values[len(values) // 2] if values else None


def training_figures(run_dir: Path) -> dict:
    """tokens/s (median of the rows after the first), ms per step between rows with no save
    between them, validation seconds, the last loss and scores."""
    rows = metrics_rows(run_dir)
    train_rows = [row for row in rows if "tokens_per_s" in row]
    steady = train_rows[1:] or train_rows
    step_ms = [1e3 * (after["elapsed_s"] - before["elapsed_s"]) / (after["step"] - before["step"])
               for before, after in zip(train_rows, train_rows[1:])
               if "valid_s" not in before and "valid_s" not in after
               and after["step"] > before["step"]]
    figures = {
        "steps": rows[-1]["step"] if rows else 0,
        "tgt_tokens_per_s": _median([row["tokens_per_s"] for row in steady]),
        "src_tokens_per_s": _median([row["src_tokens_per_s"] for row in steady]),
        "ms_per_step": _median(step_ms),
        "last_loss": train_rows[-1]["loss"] if train_rows else None,
        "valid_s": [round(row["valid_s"], 2) for row in rows if "valid_s" in row],
    }
    for key in ("valid_bleu", "valid_loss", "valid_ppl"):
        scored = [row[key] for row in rows if key in row]
        if scored:
            figures[key] = scored
    return figures


def params_touched(preset: str, src_vocab: int, tgt_vocab: int | None = None) -> dict:
    """The parameters one token passes through, by side (review §3): a source token the
    encoder's layers, a target token the decoder's layers and the output projection (vocabulary
    x d_model). Embedding lookups are no FLOPs. Built on the meta device: no memory, no time."""
    import torch

    from attn_cli.config import PRESETS
    from attn_cli.model import Transformer

    config = PRESETS[preset].model_config(src_vocab, tgt_vocab)
    with torch.device("meta"):
        model = Transformer(config)
    encoder = sum(p.numel() for p in model.encoder_layers.parameters())
    decoder = sum(p.numel() for p in model.decoder_layers.parameters())
    for name in ("encoder_norm", "decoder_norm"):
        norm = getattr(model, name, None)
        if norm is not None:
            count = sum(p.numel() for p in norm.parameters())
            encoder, decoder = (encoder + count, decoder) if name == "encoder_norm" else \
                (encoder, decoder + count)
    return {"encoder": encoder, "decoder": decoder,
            "output": config.tgt_vocab_size * config.d_model}


def model_tflops(figures: dict, touched: dict) -> float | None:
    """Model FLOP/s of a training run, in TFLOP/s: 6 x parameters touched per token x tokens/s
    (forward 2, backward 4), source and target tokens each through their side."""
    src, tgt = figures.get("src_tokens_per_s"), figures.get("tgt_tokens_per_s")
    if not src or not tgt:
        return None
    return 6 * (src * touched["encoder"] + tgt * (touched["decoder"] + touched["output"])) / 1e12


def final_checkpoint(run_dir: Path) -> Path:
    from attn_cli.checkpoints import list_checkpoints

    found = list_checkpoints(run_dir)
    if not found:
        raise RuntimeError(f"{run_dir} holds no checkpoint")
    return found[-1][1]


def weights_difference(a: Path, b: Path) -> float:
    """Max |a - b| over every weight of two model files (their newest checkpoints when run
    directories)."""
    from attn_cli.modelfile import load_model

    a = final_checkpoint(a) if a.is_dir() else a
    b = final_checkpoint(b) if b.is_dir() else b
    first, second = load_model(a).model.state_dict(), load_model(b).model.state_dict()
    return max(float((first[name].float() - second[name].float()).abs().max())
               for name in first)


def train_dtype(args) -> str:
    """What the smoke trains in: bf16 on a GPU (the real configuration), fp32 on a CPU."""
    return "bf16" if args.device == "cuda" else "fp32"
