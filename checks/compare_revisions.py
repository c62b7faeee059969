"""Does a refactor change what attn does? The same commands through two checkouts, compared byte
for byte and bit for bit, then decoding and training timed side by side.

A baseline git revision (checked out as a worktree under --work) and a candidate checkout (by
default the one this script lives in) each run every case (`*_cases` below, one function per
group: data, training, averaging, help and dry runs, decoding and scoring, decoding under a
user's control, parsing, errors) through their own `python -m attn_cli` (PYTHONPATH set to the
checkout, verified at start-up), in a directory of their own with the same relative file names
(<work>/out-baseline/CASE, <work>/out-candidate/CASE; each command's stdout and stderr are kept in
<work>/logs-*). Then:

- stdout byte for byte; exit codes; stderr's `error:`/`warning:` lines (the whole stderr for the
  error cases), with each checkout's own directories replaced by placeholders and durations and
  rates masked (the rest of stderr is progress and timings);
- every file a case wrote: safetensors files by metadata (paths normalised, elapsed time left
  out) and by every tensor bitwise; metrics.jsonl row by row without its time fields; anything
  else byte for byte.

Every case's inputs are made once by the BASELINE and kept under --work (the data, vocabulary,
binarized data, a decode model trained for 6 minutes, two toy parsers, hypotheses and parses to
score), so a case depends on no other case's candidate output. Timing (decode beam 4 and greedy,
training, a one-sentence decode) runs both checkouts in turn, round after round, in one run.

    python -m checks.compare_revisions --baseline 14bcb5c
    python -m checks.compare_revisions --baseline 14bcb5c --candidate /path/to/checkout
    python -m checks.compare_revisions --baseline 14bcb5c --quick --no-timing
    python -m checks.compare_revisions --baseline 14bcb5c --no-timing --only 'decode-*'

A report on stderr (one line per case: SAME, or DIFFERENT and the first difference), one JSON
object on stdout; exit status 0 when everything is identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import gzip
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from benchmarks._harness import BUNDLED_DATA as BUNDLED
from benchmarks._harness import REPO_ROOT as REPO
from benchmarks._harness import SHARED

PTB = SHARED / "data" / "ptb"
PTB_DEV = [PTB / f"wsj_{number:04d}.mrg" for number in range(160, 180)]
PTB_SOME = [PTB / f"wsj_{number:04d}.mrg" for number in range(1, 6)]
THREADS = str(os.cpu_count() or 1)  # every command's CPU threads (--threads, OMP_NUM_THREADS)
# metrics.jsonl fields that measure time, not what was computed
TIME_FIELDS = {"elapsed_s", "tokens_per_s", "src_tokens_per_s", "valid_s"}
# safetensors metadata that measures time: the training state's `elapsed_seconds` (wall time of
# the run so far). Paths in metadata (the state's `options` names the run directory) are
# normalised like stderr's, not skipped.
VOLATILE_METADATA = {"elapsed_seconds"}
COMMAND_TIMEOUT = 3 * 3600


def log(message: str = "") -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ checkouts


@dataclass
class Ran:
    """What one command did."""

    args: list[str]
    returncode: int
    stdout: bytes
    stderr: bytes
    seconds: float


@dataclass
class Checkout:
    """One side of the comparison: its code, and the directories its commands write into."""

    label: str  # baseline / candidate
    root: Path
    work: Path

    @property
    def out(self) -> Path:  # <work>/out-LABEL/CASE: each case's files
        return self.work / f"out-{self.label}"

    @property
    def cwd(self) -> Path:  # neutral: not a checkout, so `import attn_cli` cannot come from it
        return self.work / f"cwd-{self.label}"

    @property
    def logs(self) -> Path:  # every command's stdout and stderr, for a look afterwards
        return self.work / f"logs-{self.label}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.root), "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": THREADS, "MKL_NUM_THREADS": THREADS}

    def command(self, args: list[str], torchrun: int = 0) -> list[str]:
        if torchrun:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(torchrun), "-m", "attn_cli", *args]
        return [sys.executable, "-m", "attn_cli", *args]

    def run(self, args: list, stdin: bytes | Path | None = None, torchrun: int = 0,
            log_name: str | None = None) -> Ran:
        args = [str(arg) for arg in args]
        self.cwd.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if isinstance(stdin, Path):
                feed = {"stdin": stack.enter_context(open(stdin, "rb"))}
            else:
                feed = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
            done = subprocess.run(self.command(args, torchrun), cwd=self.cwd, env=self.env(),
                                  capture_output=True, timeout=COMMAND_TIMEOUT, **feed)
        ran = Ran(args, done.returncode, done.stdout, done.stderr,
                  time.perf_counter() - started)
        if log_name:
            self.logs.mkdir(parents=True, exist_ok=True)
            (self.logs / f"{log_name}.cmd").write_text(" ".join(args) + "\n")
            (self.logs / f"{log_name}.stdout").write_bytes(done.stdout)
            (self.logs / f"{log_name}.stderr").write_bytes(done.stderr)
        return ran

    def must(self, args: list, stdin: bytes | Path | None = None, torchrun: int = 0) -> Ran:
        """Run a command that makes an input; stop with its stderr if it fails."""
        ran = self.run(args, stdin, torchrun)
        if ran.returncode != 0:
            raise SystemExit(f"{self.label}: attn {' '.join(ran.args)} failed "
                             f"({ran.returncode}):\n{ran.stderr.decode(errors='replace')}")
        return ran

    def verify(self) -> None:
        """PYTHONPATH must win over an installed attn (an editable install points at one
        checkout, whichever it is)."""
        self.cwd.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-c", "import attn_cli; print(attn_cli.__file__)"],
                              cwd=self.cwd, env=self.env(), capture_output=True, text=True)
        found = Path(done.stdout.strip()).resolve() if done.returncode == 0 else None
        if found is None or not found.is_relative_to(self.root.resolve()):
            raise SystemExit(f"{self.label}: with PYTHONPATH={self.root}, attn_cli is imported "
                             f"from {found or done.stderr.strip()}, not from that checkout")
        log(f"{self.label}: {self.root} ({describe_revision(self.root)}), attn_cli from {found}")


def git(*args: str, repo: Path = REPO) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def describe_revision(root: Path) -> str:
    try:
        head = git("rev-parse", "--short", "HEAD", repo=root)
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "attn_cli", repo=root)
        return head + (" + uncommitted changes in attn_cli/" if dirty else "")
    except subprocess.CalledProcessError:
        return "not a git checkout"


def baseline_worktree(work: Path, revision: str) -> Path:
    """<work>/baseline at `revision`: reused when it is there, moved when it is elsewhere."""
    wanted = git("rev-parse", f"{revision}^{{commit}}")
    path = work / "baseline"
    if path.exists():
        if git("rev-parse", "HEAD", repo=path) != wanted:
            log(f"baseline: moving the worktree {path} to {revision}")
            git("checkout", "--detach", "--force", wanted, repo=path)
        return path
    git("worktree", "prune")
    git("worktree", "add", "--detach", str(path), wanted)
    return path


# ---------------------------------------------------------------------------------- comparisons


def show(line: bytes, width: int = 90) -> str:
    text = repr(line.decode("utf-8", "backslashreplace"))
    return text if len(text) <= width else text[:width - 3] + "..."


def text_difference(a: bytes, b: bytes, what: str) -> str | None:
    """None when equal, else the first differing line (1-based)."""
    if a == b:
        return None
    lines_a, lines_b = a.split(b"\n"), b.split(b"\n")
    for number, (line_a, line_b) in enumerate(zip(lines_a, lines_b), 1):
        if line_a != line_b:
            return f"{what} line {number}: {show(line_a)} vs {show(line_b)}".lstrip()
    return (f"{what} {len(lines_a) - 1} vs {len(lines_b) - 1} lines "
            f"({len(a)} vs {len(b)} bytes)").lstrip()


class Normaliser:
    """A side's own directories → placeholders, so the two sides' messages can be compared."""

    def __init__(self, checkout: Checkout, case_dir: Path):
        pairs = [(case_dir, "{CASE}"), (checkout.out, "{OUT}"), (checkout.cwd, "{CWD}"),
                 (checkout.root, "{CHECKOUT}")]
        self.pairs = sorted(((str(path), mark) for path, mark in pairs),
                            key=lambda pair: -len(pair[0]))

    def text(self, text: str) -> str:
        for path, mark in self.pairs:
            text = text.replace(path, mark)
        return text

    def bytes(self, data: bytes) -> bytes:
        return self.text(data.decode("utf-8", "surrogateescape")).encode(
            "utf-8", "surrogateescape")


# durations (0.03s, 12s) and rates (153.4 sentences/s) in progress lines differ from run to run
DURATION = re.compile(rb"\d[\d,]*(?:\.\d+)?(?=s\b)")
RATE = re.compile(rb"\d[\d,]*(?:\.\d+)?(?= [\w ]*?/s\b)")


def mask_times(data: bytes) -> bytes:
    return RATE.sub(b"<rate>", DURATION.sub(b"<secs>", data))


def error_lines(data: bytes) -> bytes:
    return b"\n".join(line for line in data.split(b"\n")
                      if line.startswith((b"error:", b"warning:")))


def safetensors_difference(a: Path, b: Path, norm_a: Normaliser, norm_b: Normaliser,
                           tensors_only: bool = False) -> str | None:
    """None when the metadata (normalised) and every tensor (bitwise) agree."""
    if a.read_bytes() == b.read_bytes():
        return None
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not tensors_only:
        meta = []
        for path, norm in ((a, norm_a), (b, norm_b)):
            with safe_open(str(path), "pt") as handle:
                meta.append({key: norm.text(value) for key, value in
                             (handle.metadata() or {}).items() if key not in VOLATILE_METADATA})
        for key in sorted(meta[0].keys() | meta[1].keys()):
            if meta[0].get(key) != meta[1].get(key):
                return (f"metadata {key!r}: {str(meta[0].get(key))[:80]!r} vs "
                        f"{str(meta[1].get(key))[:80]!r}")
    first, second = load_file(str(a)), load_file(str(b))
    if first.keys() != second.keys():
        only = sorted(first.keys() ^ second.keys())
        return f"tensor names differ: {only[:3]}"
    for name in sorted(first):
        x, y = first[name], second[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"tensor {name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        # bitwise, not ==: -0.0 == 0.0 and NaN != NaN would hide or invent a difference
        if not torch.equal(x.contiguous().reshape(-1).view(torch.uint8),
                           y.contiguous().reshape(-1).view(torch.uint8)):
            if x.is_floating_point():
                diff = (x.double() - y.double()).abs().max().item()
                why = "" if diff else " (bitwise only: signed zeros or NaNs)"
                return f"tensor {name}: max abs diff {diff:.3g}{why}"
            changed = (x != y).sum().item()
            return f"tensor {name}: {changed} elements differ"
    return None


def metrics_difference(a: Path, b: Path) -> str | None:
    rows = []
    for path in (a, b):
        rows.append([{key: value for key, value in json.loads(line).items()
                      if key not in TIME_FIELDS}
                     for line in path.read_text().splitlines() if line.strip()])
    for number, (row_a, row_b) in enumerate(zip(*rows), 1):
        if row_a != row_b:
            key = next(key for key in sorted(row_a.keys() | row_b.keys())
                       if row_a.get(key) != row_b.get(key))
            return (f"row {number} (step {row_a.get('step')}) {key}: {row_a.get(key)} vs "
                    f"{row_b.get(key)}")
    if len(rows[0]) != len(rows[1]):
        return f"{len(rows[0])} vs {len(rows[1])} rows"
    return None


# files that name the process that wrote them: a run directory's lock ("pid 123 on host")
PROCESS_ID = re.compile(rb"\bpid \d+")


def file_difference(a: Path, b: Path, norm_a: Normaliser, norm_b: Normaliser) -> str | None:
    if a.suffix == ".st":
        return safetensors_difference(a, b, norm_a, norm_b)
    if a.name == "metrics.jsonl":
        return metrics_difference(a, b)
    data_a, data_b = a.read_bytes(), b.read_bytes()
    if a.name == "train.lock":
        data_a, data_b = PROCESS_ID.sub(b"pid <pid>", data_a), PROCESS_ID.sub(b"pid <pid>", data_b)
    if data_a == data_b:
        return None
    if b"\0" in data_a[:4096] or b"\0" in data_b[:4096]:
        return f"{len(data_a)} vs {len(data_b)} bytes, contents differ"
    return text_difference(data_a, data_b, "")


def tree_difference(a: Path, b: Path, norm_a: Normaliser, norm_b: Normaliser) -> str | None:
    """Every file under two case directories, by relative name."""
    names = [{str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
             for root in (a, b)]
    if names[0] != names[1]:
        return (f"files only in baseline: {sorted(names[0] - names[1])[:4]}, "
                f"only in candidate: {sorted(names[1] - names[0])[:4]}")
    for name in sorted(names[0]):
        found = file_difference(a / name, b / name, norm_a, norm_b)
        if found:
            return f"{name}: {found}"
    return None


# ----------------------------------------------------------------------------------- the cases


@dataclass
class Step:
    """One `attn` command of a case."""

    args: list
    stdin: bytes | Path | None = None
    torchrun: int = 0  # processes, through torch.distributed.run


@dataclass
class Case:
    name: str
    group: str
    # The case's commands, given its directory (empty; the function may write inputs into it).
    steps: Callable[[Path], list[Step]]
    errors: bool = False  # an error case: the whole stderr is compared, a non-zero exit expected
    files: bool = True  # compare the files the case wrote
    prepare: Callable[[], None] | None = None  # makes the case's shared inputs, before both sides
    # The CPU may refuse it (bf16 without native support): exit 2 in the baseline makes it an
    # error case, compared by exit code and message.
    may_refuse: bool = False


@dataclass
class Inputs:
    """Everything the cases read, made once by the baseline under <work>/fixtures."""

    data: Path  # raw Multi30k text
    fx: Path
    quick: bool

    @property
    def suffix(self) -> str:  # what --quick makes differently is named apart, not overwritten
        return "-quick" if self.quick else ""

    @property
    def test_en(self) -> Path:
        return self.data / f"test{self.suffix}.en"

    @property
    def test_de(self) -> Path:
        return self.data / f"test{self.suffix}.de"

    @property
    def model(self) -> Path:
        return self.fx / f"model{self.suffix}.st"

    @property
    def model2(self) -> Path:
        return self.fx / f"model2{self.suffix}.st"

    @property
    def hyp(self) -> Path:
        return self.fx / f"test{self.suffix}.hyp"

    def parser(self, terminals: str) -> Path:
        return self.fx / f"parser-{terminals}"


def vocab_cases(inp: Inputs) -> list[Case]:
    """1: vocabulary and binarized data (both binarize with the baseline's vocabulary)."""
    data, fx = inp.data, inp.fx
    return [
        Case("vocab", "data", lambda out: [Step(
            ["vocab", data / "train.en", data / "train.de", "-o", out / "spm.model", "--size",
             "8000", "--threads", THREADS])]),
        *[Case(f"binarize-{split}", "data", lambda out, split=split: [Step(
            ["binarize", "--vocab", fx / "spm.model", data / f"{split}.en", data / f"{split}.de",
             "-o", out / f"{split}.st", "--threads", THREADS])]) for split in ("train", "val")],
    ]


def train_options(inp: Inputs, steps: int) -> list[str]:
    """Case 2's training command, minus the run directory."""
    if inp.quick:
        size = ["--preset", "tiny", "--save-every", "20", "--log-every", "10"]
    else:
        size = ["--preset", "small", "--save-every", "100", "--log-every", "50"]
    return [*size, "--max-steps", str(steps), "--seed", "1", "--device", "cpu",
            "--valid", inp.fx / "val.st", "--valid-metric", "bleu", "--valid-ref",
            inp.data / "val.de", "--keep-best", "3"]


def training_steps(inp: Inputs) -> int:
    return 60 if inp.quick else 300


def train_cases(inp: Inputs) -> list[Case]:
    """2-4: a run, the same run interrupted and resumed, two gloo processes."""
    train, total = inp.fx / "train.st", training_steps(inp)
    return [
        Case("train", "train", lambda out: [Step(
            ["train", train, "-o", out / "run", *train_options(inp, total)])]),
        Case("train-resume", "train", lambda out: [
            Step(["train", train, "-o", out / "run", *train_options(inp, total // 2)]),
            Step(["train", train, "-o", out / "run", *train_options(inp, total), "--resume"])]),
        Case("train-torchrun", "train", lambda out: [Step(
            ["train", train, "-o", out / "run", "--preset", "tiny", "--device", "cpu",
             "--max-steps", "20", "--batch-tokens", "1200", "--max-tokens", "300", "--seed", "1"],
            torchrun=2)]),
    ]


def average_cases(inp: Inputs, baseline_train: Path) -> list[Case]:
    """5: averaging case 2's run of the baseline (both sides read the same checkpoints, copied
    out of the baseline's directory, so that the averaged files name the same paths), export."""
    run = inp.fx / "average-run"

    def copy_run() -> None:  # case 2 of this run: fresh each time
        if not (baseline_train / "metrics.jsonl").exists():
            raise SystemExit(f"{baseline_train} is missing: run the `train` case first")
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(baseline_train, run)

    def average(*options: str) -> Callable[[Path], list[Step]]:
        return lambda out: [Step(["average", run, *options, "-o", out / "model.st"])]
    return [
        Case("average-last2", "average", average("--last", "2"), prepare=copy_run),
        Case("average-best2", "average", average("--best", "2"), prepare=copy_run),
        Case("export-ct2", "average", lambda out: [Step(
            ["export", "ct2", inp.model, "-o", out / "ct2"])]),
    ]


DRY_RUNS = {  # case 6: name → options of `attn train --dry-run`
    "base": ["--preset", "base", "--vocab-size", "37000"],
    "big": ["--preset", "big", "--vocab-size", "37000"],
    "small": ["--preset", "small", "--vocab-size", "37000"],
    "parse-wsj": ["--preset", "parse-wsj", "--vocab-size", "37000"],
    "data-nproc3": ["{train}", "--preset", "small", "--nproc", "3", "--max-tokens", "4096"],
    "data-base": ["{train}", "--preset", "base"],
}


def help_and_dry_run_cases(inp: Inputs) -> list[Case]:
    """6, and the help texts: what the CLI prints without doing anything."""
    cases = [Case(f"dry-run-{name}", "dry-run", lambda out, options=options: [Step(
        ["train", *[str(inp.fx / "train.st") if o == "{train}" else o for o in options],
         "--dry-run"])]) for name, options in DRY_RUNS.items()]
    for command in ([], ["vocab"], ["binarize"], ["train"], ["average"], ["decode"], ["score"],
                    ["parse"], ["parse", "linearize"], ["export", "ct2"], ["export", "hf"],
                    ["import", "hf"], ["shortlist"], ["serve"], ["plot"]):
        cases.append(Case("help" + "".join(f"-{word}" for word in command), "help",
                          lambda out, command=command: [Step([*command, "--help"])]))
    cases.append(Case("version", "help", lambda out: [Step(["--version"])]))
    return cases


def head(path: Path, count: int, out: Path) -> Path:
    """The first `count` lines of a file, as a file of its own in the case directory."""
    lines = path.read_bytes().split(b"\n")[:count]
    target = out / f"{path.stem}.head{count}{path.suffix}"
    target.write_bytes(b"\n".join(lines) + b"\n")
    return target


def decode_cases(inp: Inputs) -> list[Case]:
    """7: decoding options (1000 test lines, 100 with --quick) and scoring."""
    few = 20 if inp.quick else 100  # --stop limit is slow: this many lines
    decode = [  # name, options, input lines (None: all)
        ("decode-beam4", [], None),
        ("decode-beam1", ["--beam", "1"], None),
        ("decode-nbest4", ["--nbest", "4"], None),
        ("decode-buffer1", ["--buffer-size", "1"], None),
        ("decode-raw", ["--raw"], None),
        ("decode-best-ends", ["--stop", "best-ends"], None),
        ("decode-stop-limit", ["--stop", "limit"], few),
        ("decode-sample-topk", ["--sample", "--seed", "3", "--topk", "10"], None),
        ("decode-sample-topp", ["--sample", "--topp", "0.9", "--temperature", "0.8"], None),
        ("decode-bf16", ["--dtype", "bf16"], None),
        ("decode-ensemble", ["-m", inp.model2], None),
        ("decode-attention", ["--attention", "{out}/maps.st"], 20),
        ("decode-workers2", ["--workers", "2"], None),
        ("decode-workers1", ["--workers", "1"], None),
    ]
    cases = []
    for name, options, lines in decode:
        def steps(out: Path, options=options, lines=lines) -> list[Step]:
            source = inp.test_en if lines is None else head(inp.test_en, lines, out)
            return [Step(["decode", "-m", inp.model, "--device", "cpu", "--threads", THREADS,
                          *[str(o).replace("{out}", str(out)) for o in options]], stdin=source)]
        cases.append(Case(name, "decode", steps, may_refuse="bf16" in options))
    score = [  # name, arguments of `attn score`
        ("score-text", ["--ref", inp.test_de, inp.hyp]),
        ("score-ter", ["--ref", inp.test_de, inp.hyp, "--metrics", "bleu,chrf,ter"]),
        ("score-compound-split", ["--ref", inp.test_de, inp.hyp, "--tokenize",
                                  "compound-split"]),
        ("score-sentence-level", ["--ref", inp.test_de, inp.hyp, "--sentence-level"]),
        ("score-json", ["--ref", inp.test_de, inp.hyp, "--format", "json"]),
        ("score-sentence-json", ["--ref", inp.test_de, inp.hyp, "--sentence-level", "--format",
                                 "json"]),
        ("score-lowercase", ["--ref", inp.test_de, inp.hyp, "--lowercase"]),
        ("score-model", ["-m", inp.model, inp.test_en, inp.test_de]),
        ("score-model-json", ["-m", inp.model, inp.test_en, inp.test_de, "--format", "json"]),
        ("score-ensemble", ["-m", inp.model, "-m", inp.model2, inp.test_en, inp.test_de]),
    ]
    for name, args in score:
        device = ["--device", "cpu", "--threads", THREADS] if "-m" in args else []
        cases.append(Case(name, "score", lambda out, args=args, device=device: [
            Step(["score", *args, *device])]))
    return cases


# Glossary terms and banned phrases of the control cases: words common in Multi30k's tests.
GLOSSARY = b"""# source<TAB>target
man\tHerr
dog\tHund
two\tzwei
street\tStra\xc3\x9fe
red shirt\trotes Hemd
"""
BANS = b"# one phrase per line\nMann\nein Hund\n"


def control_inputs(inp: Inputs, out: Path, lines: int) -> dict[str, Path]:
    """The first `lines` test sentences laid out as each control option reads them: with a
    prefix (the reference's first two words), with constraints (its longest word, and a second
    phrase every fourth line), both, paragraphs of two sentences; the glossary and bans."""
    sources = inp.test_en.read_text(encoding="utf-8").split("\n")[:lines]
    references = inp.test_de.read_text(encoding="utf-8").split("\n")[:lines]
    prefixed, constrained, both = [], [], []
    for number, (source, reference) in enumerate(zip(sources, references)):
        words = reference.split()
        prefix = " ".join(words[:2])
        phrases = [max(words, key=len)] + ([" ".join(words[-2:])] if number % 4 == 0 else [])
        prefixed.append(f"{source}\t{prefix}" if number % 3 else source)  # some without
        constrained.append("\t".join([source, *phrases]))
        both.append("\t".join([source, prefix if number % 2 else "", *phrases]))
    paragraphs = [" ".join(sources[i:i + 2]) for i in range(0, len(sources), 2)]
    paragraphs[1:1] = ["", "   "]  # an empty and a blank line stay as they are
    made = {"prefix": prefixed, "constraints": constrained, "both": both,
            "paragraphs": paragraphs}
    paths = {name: out / f"{name}.txt" for name in made}
    for name, texts in made.items():
        paths[name].write_text("\n".join(texts) + "\n", encoding="utf-8")
    (out / "glossary.tsv").write_bytes(GLOSSARY)
    (out / "bans.txt").write_bytes(BANS)
    return {**paths, "glossary": out / "glossary.tsv", "bans": out / "bans.txt"}


def control_cases(inp: Inputs) -> list[Case]:
    """7b: decoding under a user's control and faster decoding (attn_cli/decode/): prefixes,
    constraints, glossaries, bans, shortlists, split sentences, alignments, target tags,
    --int8, --compile, on the first 200 test lines (40 with --quick), and their refusals."""
    lines = 40 if inp.quick else 200
    shortlist = inp.fx / "shortlist.st"
    table = [  # name, options, the input (a key of control_inputs, or "plain")
        ("prefix", ["--prefix"], "prefix"),
        ("prefix-nbest3", ["--prefix", "--nbest", "3"], "prefix"),
        ("prefix-greedy", ["--prefix", "--beam", "1"], "prefix"),
        ("prefix-sample", ["--prefix", "--sample", "--seed", "5"], "prefix"),
        ("constraints", ["--constraints"], "constraints"),
        ("constraints-all", ["--constraints", "--constraint-search", "all"], "constraints"),
        ("constraints-greedy", ["--constraints", "--beam", "1"], "constraints"),
        ("constraints-nbest2", ["--constraints", "--nbest", "2"], "constraints"),
        ("prefix-constraints", ["--prefix", "--constraints"], "both"),
        ("glossary", ["--glossary", "{glossary}"], "plain"),
        ("glossary-split", ["--glossary", "{glossary}", "--split-sentences"], "paragraphs"),
        ("ban", ["--ban", "{bans}"], "plain"),
        ("ban-sample", ["--ban", "{bans}", "--sample"], "plain"),
        ("glossary-ban-prefix", ["--glossary", "{glossary}", "--ban", "{bans}", "--prefix"],
         "prefix"),
        ("shortlist", ["--shortlist", shortlist], "plain"),
        ("shortlist-greedy", ["--shortlist", shortlist, "--beam", "1"], "plain"),
        ("shortlist-sample", ["--shortlist", shortlist, "--sample"], "plain"),
        ("shortlist-constraints", ["--shortlist", shortlist, "--constraints"], "constraints"),
        ("shortlist-ban-prefix", ["--shortlist", shortlist, "--ban", "{bans}", "--prefix"],
         "prefix"),
        ("split-sentences", ["--split-sentences"], "paragraphs"),
        ("split-alignment", ["--split-sentences", "--alignment"], "paragraphs"),
        ("alignment", ["--alignment"], "plain"),
        ("alignment-nbest2", ["--alignment", "--nbest", "2"], "plain"),
        ("int8", ["--int8"], "plain"),
        ("int8-constraints", ["--int8", "--constraints"], "constraints"),
        ("compile", ["--compile", "on", "--beam", "1"], "plain"),
    ]
    cases = []
    for name, options, source in table:
        def steps(out: Path, options=options, source=source) -> list[Step]:
            made = control_inputs(inp, out, lines)
            stdin = head(inp.test_en, lines, out) if source == "plain" else made[source]
            return [Step(["decode", "-m", inp.model, "--device", "cpu", "--threads", THREADS,
                          *[made[str(o)[1:-1]] if str(o).startswith("{") else o
                            for o in options]], stdin=stdin)]
        cases.append(Case(f"control-{name}", "control", steps, may_refuse="--int8" in options))
    refused = [  # name, options, input: each one `error:` line
        ("split-prefix", ["--split-sentences", "--prefix"], b"a\tb\n"),
        ("attention-constraints", ["--constraints", "--attention", "x.st"], b"a\tb\n"),
        ("sample-glossary", ["--sample", "--glossary", "{glossary}"], b"a\n"),
        ("empty-constraint", ["--constraints"], b"A man.\tHerr\t\n"),
        ("prefix-two-tabs", ["--prefix"], b"A man.\tEin\tMann\n"),
        ("prefix-outside-vocabulary", ["--prefix"], "A man.\t\u2603\u2603\n".encode()),
        ("glossary-outside-vocabulary", ["--glossary", "{bad_glossary}"], b"A man.\n"),
        ("glossary-malformed", ["--glossary", "{bans}"], b"A man.\n"),
        ("ban-empty", ["--ban", "{empty}"], b"A man.\n"),
        ("ban-missing", ["--ban", "{missing}"], b"A man.\n"),
        ("shortlist-missing", ["--shortlist", "{missing}"], b"A man.\n"),
        ("shortlist-not-one", ["--shortlist", "{glossary}"], b"A man.\n"),
        ("shortlist-other-vocabulary", ["--shortlist", inp.fx / "shortlist-parser.st"],
         b"A man.\n"),
        ("alignment-raw", ["--alignment", "--raw"], b"A man.\n"),
    ]
    for name, options, stdin in refused:
        def error_steps(out: Path, name=name, options=options, stdin=stdin) -> list[Step]:
            made = control_inputs(inp, out, 4)
            (out / "bad_glossary.tsv").write_text("man\t\u2603\n", encoding="utf-8")
            (out / "empty.txt").write_text("# nothing\n\n", encoding="utf-8")
            made.update(bad_glossary=out / "bad_glossary.tsv", empty=out / "empty.txt",
                        missing=out / "absent.txt")
            return [Step(["decode", "-m", inp.model, "--device", "cpu", "--threads", THREADS,
                          *[made[str(o)[1:-1]] if str(o).startswith("{") else o
                            for o in options]], stdin=stdin)]
        cases.append(Case(f"error-control-{name}", "errors", error_steps, errors=True))
    return cases


def ptb_count(inp: Inputs) -> int:
    return 20 if inp.quick else 60


def parse_cases(inp: Inputs) -> list[Case]:
    """8: two toy parsers on their toy dev sentences and on PTB dev sentences; linearize;
    tree scoring of the baseline's parses."""
    searches = {  # terminals → the searches that apply (--score-words needs --constrain)
        "words": [[], ["--constrain", "--score-words", "given"],
                  ["--constrain", "--score-words", "joint"]],
        "placeholders": [[], ["--constrain"]],
    }
    inputs = {"toy": lambda terminals: inp.parser(terminals) / "dev.src",
              "ptb": lambda terminals: inp.fx / f"ptb-dev{ptb_count(inp)}.src"}
    cases = []
    for terminals, variants in searches.items():
        for beam in ("1", "4", "21"):
            for options in variants:
                for corpus, source in inputs.items():
                    label = "-".join(o.lstrip("-") for o in options if o != "--score-words")
                    name = f"parse-{terminals}-{corpus}-beam{beam}" + (f"-{label}" * bool(label))
                    cases.append(Case(name, "parse", lambda out, t=terminals, b=beam, o=options,
                                      s=source: [Step(
                                          ["parse", "-m", inp.parser(t) / "parser.st", "--beam",
                                           b, *o, "--device", "cpu", "--threads", THREADS],
                                          stdin=s(t))]))
    linearize = {"words": ["--terminals", "words"],
                 "placeholders": ["--terminals", "placeholders"],
                 "words-subtrees": ["--terminals", "words", "--subtrees"],
                 "placeholders-subtrees": ["--terminals", "placeholders", "--subtrees"]}
    for name, options in linearize.items():
        cases.append(Case(f"linearize-{name}", "parse", lambda out, options=options: [Step(
            ["parse", "linearize", *PTB_SOME, "-o", out / "ptb", *options])]))
    scored = {  # name → (the baseline's trees, the gold trees)
        "ptb-words": (inp.fx / f"ptb-dev{ptb_count(inp)}.words.trees",
                      inp.fx / f"ptb-dev{ptb_count(inp)}.mrg"),
        "ptb-placeholders": (inp.fx / f"ptb-dev{ptb_count(inp)}.placeholders.trees",
                             inp.fx / f"ptb-dev{ptb_count(inp)}.mrg"),
        "toy-words": (inp.fx / "toy-dev.words.trees", inp.parser("words") / "dev.mrg"),
        "toy-placeholders": (inp.fx / "toy-dev.placeholders.trees",
                             inp.parser("placeholders") / "dev.mrg"),
    }
    formats = {"text": [], "json": ["--format", "json"], "sentence-level": ["--sentence-level"],
               "by-length": ["--by-length", "10,20,30,40"]}
    for name, (trees, gold) in scored.items():
        for label, options in formats.items():
            cases.append(Case(f"score-trees-{name}-{label}", "parse",
                              lambda out, trees=trees, gold=gold, options=options: [Step(
                                  ["score", "--trees", "--ref", gold, trees, *options])]))
    return cases


BAD_UTF8 = b"ok\n\xff\xfe bad\n"


def error_cases(inp: Inputs) -> list[Case]:
    """9: bad input, bad options: exit code, stdout and the whole stderr (normalised)."""
    model, fx, data = inp.model, inp.fx, inp.data
    decode = ["decode", "--device", "cpu", "--threads", THREADS]
    tiny = ["--preset", "tiny", "--device", "cpu", "--max-steps", "1"]

    def write(out: Path, name: str, content: bytes) -> Path:
        (out / name).write_bytes(content)
        return out / name

    table: list[tuple[str, Callable[[Path], list[Step]]]] = [
        ("missing-model", lambda out: [Step([*decode, "-m", out / "absent.st"], b"x\n")]),
        ("empty-model", lambda out: [Step([*decode, "-m", write(out, "empty.st", b"")],
                                          b"x\n")]),
        ("corrupt-model", lambda out: [Step(
            [*decode, "-m", write(out, "corrupt.st", model.read_bytes()[:3000])], b"x\n")]),
        ("data-file-as-model", lambda out: [Step([*decode, "-m", fx / "val.st"], b"x\n")]),
        ("missing-input", lambda out: [Step([*decode, "-m", model, "-i", out / "none.txt"])]),
        ("unknown-preset", lambda out: [Step(
            ["train", "--preset", "huge", "--vocab-size", "100", "--dry-run"])]),
        ("unknown-option", lambda out: [Step(["vocab", "--frobnicate", "x"])]),
        ("missing-required-option", lambda out: [Step(["binarize", "a", "b"])]),
        ("bad-choice-device", lambda out: [Step(["decode", "-m", model, "--device", "gpu"])]),
        ("bad-choice-vocab-type", lambda out: [Step(
            ["vocab", data / "val.en", "-o", out / "v.model", "--type", "wordpiece"])]),
        ("bad-choice-stop", lambda out: [Step([*decode, "-m", model, "--stop", "soon"],
                                              b"x\n")]),
        ("binarize-line-counts", lambda out: [Step(
            ["binarize", "--vocab", fx / "spm.model", data / "val.en", data / "test.de", "-o",
             out / "x.st"])]),
        ("binarize-invalid-utf8", lambda out: [Step(
            ["binarize", "--vocab", fx / "spm.model", write(out, "bad.en", BAD_UTF8),
             write(out, "bad.de", b"gut\nschlecht\n"), "-o", out / "x.st"])]),
        ("binarize-replace-invalid", lambda out: [Step(
            ["binarize", "--vocab", fx / "spm.model", write(out, "bad.en", BAD_UTF8),
             write(out, "bad.de", b"gut\nschlecht\n"), "-o", out / "x.st",
             "--replace-invalid"])]),
        ("score-line-counts", lambda out: [Step(["score", "--ref", data / "val.de",
                                                 data / "test.de"])]),
        ("score-strict-invalid-utf8", lambda out: [Step(
            ["score", "--ref", write(out, "ref", b"ok\nbad\n"), write(out, "hyp", BAD_UTF8),
             "--strict"])]),
        ("score-invalid-utf8", lambda out: [Step(
            ["score", "--ref", write(out, "ref", b"ok\nbad\n"), write(out, "hyp", BAD_UTF8),
             "--sentence-level"])]),
        ("decode-strict-invalid-utf8", lambda out: [Step(
            [*decode, "-m", model, "--strict"], BAD_UTF8)]),
        ("decode-invalid-utf8", lambda out: [Step(  # past five bad lines: a count at the end
            [*decode, "-m", model, "--beam", "1", "--max-len-b", "5"], BAD_UTF8 * 7)]),
        ("score-trees-malformed-gold", lambda out: [Step(
            ["score", "--trees", "--ref", write(out, "gold.mrg", b"(S (NP (DT the) (NN cat)) "
                                                b"(VP (VBZ sleeps))\n"),
             write(out, "test.mrg", b"(S (NP (DT the) (NN cat)) (VP (VBZ sleeps)))\n")])]),
        # a malformed test tree is an error sentence, counted, not an error (as EVALB)
        ("score-trees-malformed", lambda out: [Step(
            ["score", "--trees", "--ref", write(out, "gold.mrg", b"(S (NP (DT the) (NN cat)) "
                                                b"(VP (VBZ sleeps)))\n"),
             write(out, "test.mrg", b"(S (NP (DT the) (NN cat)) (VP (VBZ sleeps))\n")])]),
        ("score-trees-too-many-errors", lambda out: [Step(
            ["score", "--trees", "--max-errors", "0", "--ref",
             write(out, "gold.mrg", b"(S (NP (DT the) (NN cat)) (VP (VBZ sleeps)))\n"),
             write(out, "test.mrg", b"(S (NP (DT a) (NN dog)) (VP (VBZ runs)))\n")])]),
        ("train-existing-run", lambda out: [
            Step(["train", fx / "train.st", "-o", out / "run", *tiny]),
            Step(["train", fx / "train.st", "-o", out / "run", *tiny])]),
        ("train-resume-another-architecture", lambda out: [
            Step(["train", fx / "train.st", "-o", out / "run", *tiny]),
            Step(["train", fx / "train.st", "-o", out / "run", "--preset", "small", "--device",
                  "cpu", "--max-steps", "2", "--resume"])]),
        ("train-valid-another-vocab", lambda out: [Step(
            ["train", fx / "train.st", "-o", out / "run", *tiny, "--valid",
             inp.parser("words") / "train.st"])]),
        ("average-architectures", lambda out: [Step(
            ["average", model, fx / "tiny.st", "-o", out / "avg.st"])]),
        ("ensemble-vocabularies", lambda out: [Step(
            [*decode, "-m", model, "-m", inp.parser("words") / "parser.st"], b"x\n")]),
        ("topk-without-sample", lambda out: [Step([*decode, "-m", model, "--topk", "5"],
                                                  b"x\n")]),
        ("nbest-with-sample", lambda out: [Step([*decode, "-m", model, "--nbest", "2",
                                                 "--sample"], b"x\n")]),
        ("topp-zero", lambda out: [Step([*decode, "-m", model, "--sample", "--topp", "0"],
                                        b"x\n")]),
        ("temperature-zero", lambda out: [Step(
            [*decode, "-m", model, "--sample", "--temperature", "0"], b"x\n")]),
        ("parse-without-model", lambda out: [Step(["parse"], b"a b\n")]),
        ("parse-unknown-terminals", lambda out: [Step(
            ["parse", "-m", inp.parser("words") / "parser.st", "--terminals", "leaves"],
            b"a b\n")]),
        ("parse-strict-invalid-utf8", lambda out: [Step(
            ["parse", "-m", inp.parser("words") / "parser.st", "--beam", "2", "--strict",
             "--device", "cpu"], BAD_UTF8)]),
        ("export-existing-directory", lambda out: [Step(
            ["export", "ct2", model, "-o", write_dir(out / "taken")])]),
        ("export-missing-model", lambda out: [Step(
            ["export", "ct2", out / "none.st", "-o", out / "y"])]),
        ("plot-no-metrics", lambda out: [Step(["plot", out, "-o", out / "x.png"])]),
    ]
    return [Case(f"error-{name}", "errors", steps, errors=True) for name, steps in table]


def write_dir(path: Path) -> Path:
    path.mkdir()
    (path / "notes.txt").write_text("mine\n")
    return path


# ---------------------------------------------------------------------------- making the inputs


def gunzip_data(work: Path, quick: bool) -> Path:
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train"), ("val", "val"), ("test_2016_flickr", "test")):
        for lang in ("en", "de"):
            target = data / f"{name}.{lang}"
            if not target.exists():
                with gzip.open(BUNDLED / f"{split}.{lang}.gz", "rb") as handle:
                    atomic_write(target, handle.read())
            quick_copy = data / f"{name}-quick.{lang}"
            if name == "test" and not quick_copy.exists():
                lines = target.read_bytes().split(b"\n")[:100]
                atomic_write(quick_copy, b"\n".join(lines) + b"\n")
    return data


def atomic_write(path: Path, content: bytes) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_bytes(content)
    temp.replace(path)


def once(target: Path, make: Callable[[], None], what: str) -> None:
    """Make an input with the baseline unless it is already there (from an earlier run)."""
    if target.exists():
        return
    log(f"inputs: making {what} with the baseline ...")
    started = time.perf_counter()
    make()
    if not target.exists():
        raise SystemExit(f"inputs: {target} was not made")
    log(f"inputs: {what} in {time.perf_counter() - started:.0f} s")


def make_inputs(base: Checkout, inp: Inputs) -> None:
    data, fx = inp.data, inp.fx
    fx.mkdir(parents=True, exist_ok=True)
    once(fx / "spm.model", lambda: base.must(
        ["vocab", data / "train.en", data / "train.de", "-o", fx / "spm.model", "--size", "8000",
         "--threads", THREADS]), "the 8000-piece vocabulary")
    for split in ("train", "val"):
        once(fx / f"{split}.st", lambda split=split: base.must(
            ["binarize", "--vocab", fx / "spm.model", data / f"{split}.en", data / f"{split}.de",
             "-o", fx / f"{split}.st", "--threads", THREADS]), f"{split}.st")
    make_decode_models(base, inp)
    once(fx / "shortlist.st", lambda: base.must(
        ["shortlist", fx / "train.st", "-o", fx / "shortlist.st"]), "the vocabulary shortlist")
    once(inp.hyp, lambda: atomic_write(inp.hyp, base.must(
        ["decode", "-m", inp.model, "--device", "cpu", "--threads", THREADS],
        stdin=inp.test_en).stdout), "the hypotheses to score")

    def tiny() -> None:  # another architecture, the same vocabulary: for `average`'s refusal
        shutil.rmtree(fx / "tiny-run", ignore_errors=True)
        base.must(["train", fx / "train.st", "-o", fx / "tiny-run", "--preset", "tiny",
                   "--device", "cpu", "--max-steps", "2"])
        shutil.copy(fx / "tiny-run" / "checkpoint-2.st", fx / "tiny.st")
    once(fx / "tiny.st", tiny, "a tiny checkpoint")
    for terminals in ("words", "placeholders"):
        once(inp.parser(terminals) / "parser.st",
             lambda terminals=terminals: train_parser(base, inp.parser(terminals), terminals),
             f"the toy parser with {terminals} terminals")
    once(fx / "shortlist-parser.st", lambda: base.must(  # another vocabulary's
        ["shortlist", inp.parser("words") / "train.st", "-o", fx / "shortlist-parser.st"]),
        "a shortlist of the toy parser's vocabulary")
    make_ptb_dev(base, inp)
    for terminals, options in (("words", ["--constrain"]), ("placeholders", [])):
        parser = ["parse", "-m", inp.parser(terminals) / "parser.st", "--beam", "4", *options,
                  "--device", "cpu", "--threads", THREADS]
        for corpus, source, target in (
                ("ptb", fx / f"ptb-dev{ptb_count(inp)}.src",
                 fx / f"ptb-dev{ptb_count(inp)}.{terminals}.trees"),
                ("toy", inp.parser(terminals) / "dev.src", fx / f"toy-dev.{terminals}.trees")):
            once(target, lambda parser=parser, source=source, target=target: atomic_write(
                target, base.must(parser, stdin=source).stdout), f"{corpus} trees to score")


def make_decode_models(base: Checkout, inp: Inputs) -> None:
    """`small` for 6 minutes (1 with --quick) on all of Multi30k; its last 3 averaged, and its
    last one alone for ensembles."""
    run = inp.fx / f"decode-run{inp.suffix}"

    def train() -> None:
        shutil.rmtree(run, ignore_errors=True)
        duration, every = ("1m", "20s") if inp.quick else ("6m", "2m")
        base.must(["train", inp.fx / "train.st", "-o", run, "--preset", "small", "--max-time",
                   duration, "--save-every", every, "--device", "cpu"])
        base.must(["average", run, "--last", "1", "-o", inp.model2])
        base.must(["average", run, "--last", "3", "-o", inp.model])
        # A time limit on a busy machine gives few steps: a weak model with short outputs
        # exercises less of the search. Say so; deleting the model file trains it again.
        steps = max(int(path.name.split("-")[1].split(".")[0])
                    for path in run.glob("checkpoint-*.st"))
        log(f"inputs: the decode model trained {steps} steps in {duration}"
            + (" (few: was the machine busy? delete " + str(inp.model) + " to train again)"
               if steps < (25 if inp.quick else 150) else ""))
    once(inp.model, train, f"the decode model ({'1' if inp.quick else '6'} min of training)")


def train_parser(base: Checkout, directory: Path, terminals: str) -> None:
    """As tests/conftest.py's _train_parser: toy trees (tests/toys.py of the baseline),
    linearize, vocab with the bracket symbols, binarize, tiny training, the last checkpoint."""
    spec = importlib.util.spec_from_file_location("toys", base.root / "tests" / "toys.py")
    toys = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toys)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    (directory / "train.mrg").write_text(toys.toy_treebank(600, seed=1), encoding="utf-8")
    (directory / "dev.mrg").write_text(toys.toy_treebank(30, seed=2), encoding="utf-8")
    for split in ("train", "dev"):
        base.must(["parse", "linearize", directory / f"{split}.mrg", "-o", directory / split,
                   "--terminals", terminals])
    steps = {"words": "400", "placeholders": "600"}[terminals]  # conftest's PARSER_STEPS
    base.must(["vocab", directory / "train.src", directory / "train.tgt", "-o",
               directory / "spm.model", "--size", "60", "--symbols", directory / "train.symbols"])
    base.must(["binarize", "--vocab", directory / "spm.model", directory / "train.src",
               directory / "train.tgt", "-o", directory / "train.st"])
    base.must(["train", directory / "train.st", "-o", directory / "run", "--preset", "tiny",
               "--max-steps", steps, "--batch-tokens", "1500", "--warmup", "100", "--lr-scale",
               "0.3", "--save-every", steps, "--log-every", steps, "--device", "cpu"])
    base.must(["average", directory / "run", "--last", "1", "-o", directory / "parser.st"])


def split_trees(text: str) -> list[str]:
    """The top-level bracketed trees of a treebank file, each on one line."""
    trees, depth, current = [], 0, []
    for token in re.findall(r"\(|\)|[^\s()]+", text):
        current.append(token)
        depth += {"(": 1, ")": -1}.get(token, 0)
        if depth == 0 and token == ")":
            trees.append(" ".join(current).replace("( ", "(").replace(" )", ")"))
            current = []
    return trees


def make_ptb_dev(base: Checkout, inp: Inputs) -> None:
    """The first N sentences of the PTB dev files (words) and their gold trees."""
    count = ptb_count(inp)
    src, gold = inp.fx / f"ptb-dev{count}.src", inp.fx / f"ptb-dev{count}.mrg"

    def make() -> None:
        base.must(["parse", "linearize", *PTB_DEV, "-o", inp.fx / "ptb-dev", "--terminals",
                   "words"])
        words = (inp.fx / "ptb-dev.src").read_bytes().split(b"\n")
        trees = [tree for path in PTB_DEV for tree in split_trees(path.read_text())]
        if len(trees) != len(words) - 1:  # the .src ends with a newline
            raise SystemExit(f"inputs: {len(trees)} PTB dev trees but {len(words) - 1} lines of "
                             "words: cannot pair sentences with their gold trees")
        atomic_write(gold, ("\n".join(trees[:count]) + "\n").encode())
        atomic_write(src, b"\n".join(words[:count]) + b"\n")
    once(src, make, f"the first {count} PTB dev sentences and gold trees")


# ---------------------------------------------------------------------------- running the cases


@dataclass
class Outcome:
    case: Case
    identical: bool
    detail: str
    runs: dict[str, list[Ran]] = field(default_factory=dict)
    broken: bool = False  # the baseline itself failed a command that should work


def run_side(checkout: Checkout, case: Case) -> tuple[Path, list[Ran]]:
    case_dir = checkout.out / case.name
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    steps = case.steps(case_dir)
    runs = []
    for number, step in enumerate(steps, 1):
        ran = checkout.run(step.args, step.stdin, step.torchrun, log_name=f"{case.name}.{number}")
        runs.append(ran)
        if ran.returncode != 0:
            break  # the steps after a failed one would only fail again
    return case_dir, runs


def compare_case(case: Case, base: Checkout, cand: Checkout) -> Outcome:
    if case.prepare:
        case.prepare()
    dir_a, runs_a = run_side(base, case)
    dir_b, runs_b = run_side(cand, case)
    norm_a, norm_b = Normaliser(base, dir_a), Normaliser(cand, dir_b)
    outcome = Outcome(case, True, "", {"baseline": runs_a, "candidate": runs_b})
    errors = case.errors or (case.may_refuse and runs_a[-1].returncode == 2)
    if not errors and any(ran.returncode != 0 for ran in runs_a):
        failed = next(ran for ran in runs_a if ran.returncode != 0)
        last = (failed.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]
        outcome.identical, outcome.broken = False, True
        outcome.detail = f"the baseline failed (exit {failed.returncode}): {last}"
        return outcome

    def differ(detail: str) -> Outcome:
        outcome.identical, outcome.detail = False, detail
        return outcome

    if len(runs_a) != len(runs_b):
        return differ(f"baseline ran {len(runs_a)} step(s), candidate {len(runs_b)} "
                      f"(candidate exit {runs_b[-1].returncode})")
    for number, (a, b) in enumerate(zip(runs_a, runs_b), 1):
        step = f"step {number}: " if len(runs_a) > 1 else ""
        if a.returncode != b.returncode:
            last = (b.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
            return differ(f"{step}exit {a.returncode} vs {b.returncode} ({last[:100]})")
        found = text_difference(norm_a.bytes(a.stdout), norm_b.bytes(b.stdout), "stdout")
        if found:
            return differ(step + found)
        if errors:
            err_a, err_b = (mask_times(norm.bytes(ran.stderr))
                            for norm, ran in ((norm_a, a), (norm_b, b)))
        else:
            err_a, err_b = (error_lines(norm.bytes(ran.stderr))
                            for norm, ran in ((norm_a, a), (norm_b, b)))
        found = text_difference(err_a, err_b, "stderr")
        if found:
            return differ(step + found)
    if case.files:
        found = tree_difference(dir_a, dir_b, norm_a, norm_b)
        if found:
            return differ(found)
    codes = sorted({ran.returncode for ran in runs_a})
    outcome.detail = (f"{len(runs_a)} command(s), exit {','.join(map(str, codes))}, "
                      f"{count_files(dir_a)} file(s)")
    if errors and not case.errors:
        outcome.detail += " (refused by this CPU in both: exit codes and messages compared)"
    return outcome


def count_files(directory: Path) -> int:
    return sum(1 for path in directory.rglob("*") if path.is_file())


@dataclass
class Check:
    """A property within one checkout (not baseline against candidate)."""

    name: str
    identical: bool
    detail: str


def consistency_checks(outcomes: dict[str, Outcome], checkouts: list[Checkout],
                       inp: Inputs) -> list[Check]:
    """What must hold inside each checkout: a resumed run ends where the uninterrupted run ends;
    --workers 1 and 2 write the same lines."""
    checks = []
    for checkout in checkouts:
        if {"train", "train-resume"} <= outcomes.keys():
            final = f"checkpoint-{training_steps(inp)}"
            whole = checkout.out / "train" / "run"
            resumed = checkout.out / "train-resume" / "run"
            norm_whole = Normaliser(checkout, checkout.out / "train")
            norm_resumed = Normaliser(checkout, checkout.out / "train-resume")
            if (whole / f"{final}.st").exists() and (resumed / f"{final}.st").exists():
                found = (safetensors_difference(whole / f"{final}.st", resumed / f"{final}.st",
                                                norm_whole, norm_resumed)
                         or safetensors_difference(whole / f"{final}.state.st",
                                                   resumed / f"{final}.state.st", norm_whole,
                                                   norm_resumed, tensors_only=True))
            else:
                found = f"{final}.st missing"
            checks.append(Check(f"resume-equals-uninterrupted ({checkout.label})", not found,
                                found or f"{final}.st and the Adam state bitwise equal"))
        if {"decode-workers1", "decode-workers2"} <= outcomes.keys():
            one = outcomes["decode-workers1"].runs[checkout.label][-1].stdout
            two = outcomes["decode-workers2"].runs[checkout.label][-1].stdout
            found = text_difference(one, two, "stdout")
            checks.append(Check(f"decode-workers1-equals-workers2 ({checkout.label})",
                                not found, found or f"{len(one.splitlines())} lines equal"))
    return checks


# --------------------------------------------------------------------------------------- timing


SENTENCES_PER_S = re.compile(r"([\d.]+) sentences/s")


@dataclass
class Bench:
    name: str
    unit: str
    higher_is_better: bool
    measure: Callable[[Checkout], float]


def benches(inp: Inputs, work: Path) -> list[Bench]:
    lines = inp.test_en

    def decode_rate(options: list[str]) -> Callable[[Checkout], float]:
        def measure(checkout: Checkout) -> float:
            ran = checkout.must(["decode", "-m", inp.model, "--device", "cpu", "--threads",
                                 THREADS, *options], stdin=lines)
            found = SENTENCES_PER_S.findall(ran.stderr.decode())
            if not found:
                raise SystemExit(f"{checkout.label}: no sentences/s in decode's stderr")
            return float(found[-1])
        return measure

    def train_rate(checkout: Checkout) -> float:
        run = work / "timing" / f"train-{checkout.label}"
        shutil.rmtree(run, ignore_errors=True)
        steps, every = ("60", "20") if inp.quick else ("150", "50")
        checkout.must(["train", inp.fx / "train.st", "-o", run, "--preset", "small",
                       "--max-steps", steps, "--log-every", every, "--device", "cpu",
                       "--seed", "1"])
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        shutil.rmtree(run)
        return statistics.median(row["tokens_per_s"] for row in rows[1:])  # the first: warm-up

    def one_sentence(checkout: Checkout) -> float:  # the whole process: start-up and loading
        best = float("inf")
        for _ in range(5):
            ran = checkout.must(["decode", "-m", inp.model, "--device", "cpu"],
                                stdin=b"A man is riding a bike.\n")
            best = min(best, ran.seconds)
        return best

    return [
        Bench("decode-beam4", "sentences/s", True, decode_rate([])),
        Bench("decode-beam1", "sentences/s", True, decode_rate(["--beam", "1"])),
        Bench("train-small", "target tokens/s", True, train_rate),
        Bench("decode-one-sentence", "s wall, best of 5", False, one_sentence),
    ]


def run_timing(inp: Inputs, work: Path, base: Checkout, cand: Checkout,
               rounds: int) -> list[dict]:
    figures: dict[str, dict[str, list[float]]] = {}
    table = benches(inp, work)
    for round_ in range(1, rounds + 1):
        for bench in table:
            for checkout in (base, cand):  # interleaved: drift of the machine hits both
                # Another busy process on these 2 cores slows OpenMP's 2 threads far more than
                # by half: the load average beside each figure says which ones to doubt.
                load = os.getloadavg()[0]
                value = bench.measure(checkout)
                got = figures.setdefault(bench.name, {"baseline": [], "candidate": [],
                                                      "load_baseline": [],
                                                      "load_candidate": []})
                got[checkout.label].append(value)
                got[f"load_{checkout.label}"].append(round(load, 2))
                log(f"timing: round {round_}/{rounds} {bench.name:20} {checkout.label:9} "
                    f"{value:10.3f} {bench.unit} (load average before: {load:.2f})")
    results = []
    for bench in table:
        got = figures[bench.name]
        ratio = statistics.median(got["candidate"]) / statistics.median(got["baseline"])
        results.append({"name": bench.name, "unit": bench.unit,
                        "higher_is_better": bench.higher_is_better, **got,
                        "ratio_of_medians": ratio})
    return results


# ---------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="A git revision of this repository.")
    parser.add_argument("--candidate", type=Path, default=REPO,
                        help="The checkout to compare (default: the one this script is in).")
    default_work = Path(os.environ.get("TMPDIR") or "/tmp") / "attn-compare"
    parser.add_argument("--work", type=Path, default=default_work,
                        help=f"Inputs, worktree, outputs; reused (default: {default_work}).")
    parser.add_argument("--quick", action="store_true",
                        help="Fewer steps and lines: for trying the script.")
    parser.add_argument("--no-timing", action="store_true", help="Compare outputs only.")
    parser.add_argument("--rounds", type=int, default=3, help="Timing rounds (default 3).")
    parser.add_argument("--only", action="append", default=[], metavar="GLOB",
                        help="Run only the cases whose name matches (again for several).")
    args = parser.parse_args()
    started = time.perf_counter()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = Checkout("baseline", baseline_worktree(work, args.baseline), work)
    cand = Checkout("candidate", args.candidate.resolve(), work)
    if base.root == cand.root:
        raise SystemExit("the baseline and the candidate are the same directory")
    base.verify()
    cand.verify()
    inp = Inputs(gunzip_data(work, args.quick), work / "fixtures", args.quick)
    make_inputs(base, inp)

    cases = [*vocab_cases(inp), *train_cases(inp),
             *average_cases(inp, base.out / "train" / "run"), *help_and_dry_run_cases(inp),
             *decode_cases(inp), *control_cases(inp), *parse_cases(inp), *error_cases(inp)]
    if args.only:
        cases = [case for case in cases
                 if any(fnmatch.fnmatch(case.name, pattern) for pattern in args.only)]
    log(f"{len(cases)} cases{' (--quick)' if args.quick else ''}")
    outcomes: dict[str, Outcome] = {}
    for case in cases:
        case_started = time.perf_counter()
        outcome = compare_case(case, base, cand)
        outcomes[case.name] = outcome
        verdict = "SAME" if outcome.identical else ("BROKEN" if outcome.broken else "DIFFERENT")
        log(f"{verdict:9} {case.name:48} {outcome.detail} "
            f"[{time.perf_counter() - case_started:.0f} s]")
    checks = consistency_checks(outcomes, [base, cand], inp)
    for check in checks:
        log(f"{'SAME' if check.identical else 'DIFFERENT':9} {check.name:48} {check.detail}")

    timing = [] if args.no_timing else run_timing(inp, work, base, cand, args.rounds)
    same = sum(outcome.identical for outcome in outcomes.values())
    identical = same == len(outcomes) and all(check.identical for check in checks)
    log()
    log(f"{same}/{len(outcomes)} cases SAME, {sum(c.identical for c in checks)}/{len(checks)} "
        f"checks SAME; {time.perf_counter() - started:.0f} s in all")
    for outcome in outcomes.values():
        if not outcome.identical:
            log(f"  DIFFERENT {outcome.case.name}: {outcome.detail}")
    for result in timing:
        log(f"timing {result['name']:20} ({result['unit']}): baseline "
            f"{' '.join(f'{v:.2f}' for v in result['baseline'])} | candidate "
            f"{' '.join(f'{v:.2f}' for v in result['candidate'])} | candidate/baseline "
            f"{result['ratio_of_medians']:.3f}"
            f" ({'higher' if result['higher_is_better'] else 'lower'} is better)")
    report = {
        "baseline": {"revision": args.baseline, "root": str(base.root),
                     "head": describe_revision(base.root)},
        "candidate": {"root": str(cand.root), "head": describe_revision(cand.root)},
        "quick": args.quick,
        "identical": identical,
        "cases": [{"name": name, "group": o.case.group, "identical": o.identical,
                   "detail": o.detail} for name, o in outcomes.items()],
        "checks": [{"name": c.name, "identical": c.identical, "detail": c.detail}
                   for c in checks],
        "timing": timing,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report, indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
