"""Benchmark `attn binarize` against SentencePiece's own batch encoder, and check its memory bound.

What it measures, on the Multi30k training pair (29,000 sentence pairs, English-German):

1. Speed. The reference is SentencePiece's raw batch encoder,
   `SentencePieceProcessor(model_file=...).encode(lines, num_threads=T)`, called once on the
   source lines and once on the target lines; the lines are already in memory and only the two
   encode calls are timed. Ours is `attn_cli.data.binarize(src, tgt, out, vocab, threads=T)` end to
   end: reading both files, decoding UTF-8, encoding, filtering, and writing the safetensors data
   file. Both use the same thread count T and run `--repeats` times, interleaved; the best (min)
   time of each is kept. Target: ours runs at >= 50% of the reference speed (lines/s, tokens/s).

2. Memory. `binarize` runs in a fresh child process (this script with `--child`) on the 1x corpus
   and on a 10x concatenation of it. Each child reports its peak RSS (`ru_maxrss`) just before the
   call (after imports and loading the vocabulary: the baseline) and after it. Target: the 10x
   peak stays within 1.5x of the 1x peak (memory does not grow with the corpus). The children run
   before this process loads anything big, because on Linux a child's ru_maxrss starts at its
   parent's peak RSS; each child also reports VmHWM from /proc as a cross-check.

Run it from anywhere (the default data are the gzipped copies bundled in examples/multi30k/data):

    python -m benchmarks.binarize_speed
    python -m benchmarks.binarize_speed --data-dir ../shared/data/multi30k --threads 2 --repeats 5
    python -m benchmarks.binarize_speed --vocab spm.model      # skip learning a vocabulary
    python -m benchmarks.binarize_speed --profile               # also cProfile one 1x binarize

The human-readable report goes to stderr; the numbers, as one JSON object, to stdout. The exit
status is 0 whether or not the targets are met (read "speed.pass" / "memory.pass"), 2 on bad input.
Everything is written in a temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import BUNDLED_DATA, REPO_ROOT, log

DEFAULT_DATA_DIR = BUNDLED_DATA
SIDES = ("en", "de")  # source, target
SPEED_TARGET = 0.5  # ours / reference, at least
MEMORY_TARGET = 1.5  # peak RSS 10x / peak RSS 1x, at most
CONCATENATION = 10


def peak_rss_kib() -> int:
    """This process's peak resident set size so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def proc_status_kib(field: str) -> int:
    """A memory field of /proc/self/status in KiB (Linux; 0 where unavailable). VmRSS is the
    resident set now; VmHWM its peak in this program image (reset by exec, unlike ru_maxrss)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


# ------------------------------------------------------------------------------------ preparation


def materialize_corpus(data_dir: Path | None, work: Path) -> dict[str, Path]:
    """Copy (or gunzip) train.en / train.de into `work`, so that timing never includes gzip."""
    paths = {}
    for side in SIDES:
        target = work / f"train.{side}"
        if data_dir is None:
            source = DEFAULT_DATA_DIR / f"train.{side}.gz"
            opener = gzip.open
        else:
            source = data_dir / f"train.{side}"
            opener = open
        if not source.is_file():
            raise SystemExit(f"error: {source} does not exist")
        with opener(source, "rb") as reader, open(target, "wb") as writer:
            shutil.copyfileobj(reader, writer, 1 << 20)
        paths[side] = target
    return paths


def concatenate(paths: dict[str, Path], times: int, work: Path) -> dict[str, Path]:
    """`times` copies of each side, back to back (line N of src still pairs with line N of tgt)."""
    result = {}
    for side, path in paths.items():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            data += b"\n"
        target = work / f"train{times}x.{side}"
        with open(target, "wb") as writer:
            for _ in range(times):
                writer.write(data)
        result[side] = target
    return result


def learn_vocabulary(paths: dict[str, Path], size: int, model_path: Path) -> float:
    """Run `attn vocab train.en train.de -o spm.model --size SIZE` (in a subprocess, so that this
    process stays small: see `measure_memory`); returns seconds."""
    command = [sys.executable, "-m", "attn_cli", "vocab", *(str(p) for p in paths.values()),
               "-o", str(model_path), "--size", str(size)]
    started = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if finished.returncode != 0:
        raise SystemExit(f"error: `attn vocab` failed:\n{finished.stderr}")
    return time.perf_counter() - started


def read_lines(path: Path) -> list[str]:
    """The file's lines exactly as `binarize` splits them (only "\\n" breaks a line)."""
    text = path.read_bytes().decode("utf-8")
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


# ------------------------------------------------------------------------------------------ speed


def measure_speed(paths: dict[str, Path], model_path: Path, threads: int, repeats: int,
                  work: Path) -> dict:
    import sentencepiece

    from attn_cli.data import binarize
    from attn_cli.vocab import Vocabulary

    src, tgt = (paths[side] for side in SIDES)
    lines = {side: read_lines(paths[side]) for side in SIDES}
    pairs = len(lines[SIDES[0]])
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
    vocabulary = Vocabulary.from_file(model_path)  # builds its processor now, outside the timing
    out = work / "train.st"

    def reference() -> tuple[float, int]:
        started = time.perf_counter()
        encoded = [processor.encode(lines[side], num_threads=threads) for side in SIDES]
        seconds = time.perf_counter() - started
        return seconds, sum(len(ids) for side_ids in encoded for ids in side_ids)

    def ours() -> tuple[float, object]:
        started = time.perf_counter()
        stats = binarize(src, tgt, out, vocabulary, threads=threads)
        return time.perf_counter() - started, stats

    reference()  # warm-up: page cache, thread pools, allocator
    ours()
    reference_times, our_times = [], []
    for repeat in range(repeats):
        seconds, reference_tokens = reference()
        reference_times.append(seconds)
        seconds, stats = ours()
        our_times.append(seconds)
        log(f"  repeat {repeat + 1}/{repeats}: reference {reference_times[-1] * 1000:7.1f} ms,"
            f"  binarize {our_times[-1] * 1000:7.1f} ms")

    our_tokens = stats.src_tokens + stats.tgt_tokens
    best_reference, best_ours = min(reference_times), min(our_times)
    result = {
        "pairs": pairs,
        "threads": threads,
        "repeats": repeats,
        "reference": {
            "what": "SentencePieceProcessor.encode(lines, num_threads=T), src + tgt, in memory",
            "best_s": best_reference, "times_s": reference_times, "tokens": reference_tokens,
            "lines_per_s": pairs / best_reference,
            "tokens_per_s": reference_tokens / best_reference,
        },
        "binarize": {
            "what": "attn_cli.data.binarize(src, tgt, out, vocab, threads=T), files to file",
            "best_s": best_ours, "times_s": our_times, "tokens": our_tokens,
            "pairs_kept": stats.pairs,
            "lines_per_s": stats.lines / best_ours,
            "tokens_per_s": our_tokens / best_ours,
            "output_bytes": out.stat().st_size,
        },
    }
    result["ratio_lines_per_s"] = (result["binarize"]["lines_per_s"]
                                   / result["reference"]["lines_per_s"])
    result["ratio_tokens_per_s"] = (result["binarize"]["tokens_per_s"]
                                    / result["reference"]["tokens_per_s"])
    result["target"] = SPEED_TARGET
    result["pass"] = min(result["ratio_lines_per_s"], result["ratio_tokens_per_s"]) >= SPEED_TARGET
    return result


# ----------------------------------------------------------------------------------------- memory


def child(src: str, tgt: str, model_path: str, out: str, threads: int) -> None:
    """`--child` mode: one binarize in this fresh process; its RSS figures as JSON on stdout."""
    from attn_cli.data import binarize
    from attn_cli.vocab import Vocabulary

    vocabulary = Vocabulary.from_file(model_path)  # loads sentencepiece and the model
    baseline_peak, baseline_current = peak_rss_kib(), proc_status_kib("VmRSS")
    started = time.perf_counter()
    stats = binarize(src, tgt, out, vocabulary, threads=threads)
    seconds = time.perf_counter() - started
    print(json.dumps({
        "lines": stats.lines, "tokens": stats.src_tokens + stats.tgt_tokens, "seconds": seconds,
        "baseline_peak_rss_kib": baseline_peak, "baseline_rss_kib": baseline_current,
        "peak_rss_kib": peak_rss_kib(), "vm_hwm_kib": proc_status_kib("VmHWM"),
        "output_bytes": os.path.getsize(out),
    }))


def run_child(paths: dict[str, Path], model_path: Path, threads: int, out: Path) -> dict:
    command = [sys.executable, "-m", "benchmarks.binarize_speed", "--child",
               str(paths[SIDES[0]]), str(paths[SIDES[1]]), str(model_path), str(out),
               str(threads)]
    finished = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if finished.returncode != 0:
        raise SystemExit(f"error: the --child run failed:\n{finished.stderr}")
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    out.unlink(missing_ok=True)
    return result


def measure_memory(paths: dict[str, Path], model_path: Path, threads: int, work: Path) -> dict:
    """Run before anything big is loaded here: on Linux a child's ru_maxrss starts at its parent's
    peak RSS (it survives fork and exec), so a fat parent would hide the child's own peak."""
    big = concatenate(paths, CONCATENATION, work)
    parent_peak = peak_rss_kib()
    runs = {"1x": run_child(paths, model_path, threads, work / "child1x.st"),
            f"{CONCATENATION}x": run_child(big, model_path, threads, work / "child10x.st")}
    for path in big.values():
        path.unlink()
    for run in runs.values():
        run["increment_kib"] = run["peak_rss_kib"] - run["baseline_peak_rss_kib"]
        if run["baseline_peak_rss_kib"] <= parent_peak:
            log(f"warning: a child's baseline peak RSS ({run['baseline_peak_rss_kib']} KiB) is "
                f"not above this process's ({parent_peak} KiB): ru_maxrss may be inherited")
    small, large = runs["1x"], runs[f"{CONCATENATION}x"]
    ratio = large["peak_rss_kib"] / small["peak_rss_kib"]
    return {"runs": runs, "ratio_peak": ratio, "parent_peak_rss_kib": parent_peak,
            "ratio_vm_hwm": large["vm_hwm_kib"] / small["vm_hwm_kib"],
            "ratio_increment": large["increment_kib"] / max(small["increment_kib"], 1),
            "target": MEMORY_TARGET, "pass": ratio <= MEMORY_TARGET}


# ---------------------------------------------------------------------------------------- profile


def profile_once(paths: dict[str, Path], model_path: Path, threads: int, work: Path) -> str:
    """cProfile of one 1x binarize (the top entries by cumulative, then by own time)."""
    import cProfile
    import io
    import pstats

    from attn_cli.data import binarize
    from attn_cli.vocab import Vocabulary

    vocabulary = Vocabulary.from_file(model_path)
    profiler = cProfile.Profile()
    profiler.enable()
    binarize(paths[SIDES[0]], paths[SIDES[1]], work / "profile.st", vocabulary, threads=threads)
    profiler.disable()
    report = io.StringIO()
    statistics = pstats.Stats(profiler, stream=report).strip_dirs()
    statistics.sort_stats("cumulative").print_stats(15)
    statistics.sort_stats("tottime").print_stats(10)
    return report.getvalue()


# ------------------------------------------------------------------------------------------- main


def mib(kib: int) -> str:
    return f"{kib / 1024:7.1f} MiB"


def report(speed: dict, memory: dict, vocab_note: str) -> None:
    reference, ours = speed["reference"], speed["binarize"]
    log()
    log(f"binarize speed on Multi30k train ({speed['pairs']} pairs, {speed['threads']} threads, "
        f"best of {speed['repeats']}; {vocab_note})")
    log(f"  reference  spm encode   {reference['best_s'] * 1000:8.1f} ms"
        f"  {reference['lines_per_s']:11,.0f} lines/s  {reference['tokens_per_s']:12,.0f} tok/s"
        f"  ({reference['tokens']} tokens)")
    log(f"  ours       binarize     {ours['best_s'] * 1000:8.1f} ms"
        f"  {ours['lines_per_s']:11,.0f} lines/s  {ours['tokens_per_s']:12,.0f} tok/s"
        f"  ({ours['tokens']} tokens, {ours['pairs_kept']} pairs kept)")
    verdict = "PASS" if speed["pass"] else "FAIL"
    log(f"  ratio ours/reference: {speed['ratio_lines_per_s']:.3f} (lines/s), "
        f"{speed['ratio_tokens_per_s']:.3f} (tokens/s)   target >= {SPEED_TARGET}  {verdict}")
    log()
    log("binarize memory (fresh process each; baseline = peak RSS after imports + vocab load)")
    for name, run in memory["runs"].items():
        log(f"  {name:>4}  {run['lines']:8d} lines  {run['seconds']:6.2f} s   baseline "
            f"{mib(run['baseline_peak_rss_kib'])}   peak {mib(run['peak_rss_kib'])}   "
            f"increment {mib(run['increment_kib'])}   (VmHWM {mib(run['vm_hwm_kib'])})")
    verdict = "PASS" if memory["pass"] else "FAIL"
    log(f"  ratio peak 10x/1x: {memory['ratio_peak']:.3f}   (increment ratio "
        f"{memory['ratio_increment']:.2f}, VmHWM ratio {memory['ratio_vm_hwm']:.3f})   "
        f"target <= {MEMORY_TARGET}  {verdict}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Benchmark `attn binarize` against SentencePiece's batch encode "
                    "(speed) and check that its memory stays bounded.")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="Directory with plain train.en/train.de (default: the gzipped "
                             "copies in examples/multi30k/data).")
    parser.add_argument("--vocab", type=Path, default=None,
                        help="A SentencePiece model from `attn vocab` (default: learn one, "
                             "--size pieces, on the training pair).")
    parser.add_argument("--size", type=int, default=8000, help="Vocabulary size to learn.")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="Encoder threads for both sides of the comparison "
                             "(default: os.cpu_count()).")
    parser.add_argument("--repeats", type=int, default=5, help="Timed runs of each (best kept).")
    parser.add_argument("--profile", action="store_true",
                        help="Also print a cProfile of one 1x binarize to stderr.")
    parser.add_argument("--child", nargs=5, metavar=("SRC", "TGT", "VOCAB", "OUT", "THREADS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        src, tgt, model_path, out, threads = args.child
        child(src, tgt, model_path, out, int(threads))
        return
    if args.threads < 1 or args.repeats < 1:
        parser.error("--threads and --repeats must be at least 1")
    if args.vocab is not None and not args.vocab.is_file():
        parser.error(f"--vocab {args.vocab} does not exist")

    total_started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attn-binarize-bench.") as directory:
        work = Path(directory)
        paths = materialize_corpus(args.data_dir, work)
        source = args.data_dir or DEFAULT_DATA_DIR
        log(f"data: {source}/train.{{en,de}} -> {work}")
        if args.vocab is None:
            model_path = work / "spm.model"
            seconds = learn_vocabulary(paths, args.size, model_path)
            vocab_note = f"{args.size}-piece BPE vocabulary learned here"
            log(f"vocab: learned {args.size} pieces in {seconds:.1f}s")
        else:
            model_path = args.vocab.resolve()
            vocab_note = f"vocabulary {args.vocab}"
        log(f"memory: binarize in fresh processes on 1x and {CONCATENATION}x")
        memory = measure_memory(paths, model_path, args.threads, work)  # first: see its docstring
        log(f"speed: {args.repeats} interleaved repeats, {args.threads} threads")
        speed = measure_speed(paths, model_path, args.threads, args.repeats, work)
        report(speed, memory, vocab_note)
        if args.profile:
            log()
            log("cProfile of one 1x binarize:")
            log(profile_once(paths, model_path, args.threads, work))
    seconds = time.perf_counter() - total_started
    log(f"\ntotal {seconds:.1f}s")
    print(json.dumps({"speed": speed, "memory": memory, "total_seconds": seconds,
                      "python": sys.version.split()[0]}, indent=2))


if __name__ == "__main__":
    main()
