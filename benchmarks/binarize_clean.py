"""Benchmark `attn binarize`'s cleaning filters: their cost in time and peak memory at WMT14
en-de's size (4.5M pairs), and the language identifier's speed and accuracy alone.

What it measures:

1. The corpus. No WMT here: Multi30k's training pair (29,000 pairs) repeated to `--pairs` pairs,
   copy k with the number k appended to both sides (so that --dedup does not collapse the copies),
   and a known share of bad pairs planted, one kind for each line number modulo 100:
   1 ratio (the target four times over), 2 control (a zero-width space in the source), 3 copy
   (the source as target, lower-cased, spaces doubled), 4 digits (a number more in the target),
   5 duplicate (the pair five lines up, spaces doubled), 6 wrong language (the target in French,
   or Czech; only --langid drops these). Multi30k's own faults repeat in every copy.

2. Time and memory. `attn binarize` in a fresh process (this script with `--child`, which runs
   the real entry point and reports its peak RSS: VmHWM, reset at exec, and ru_maxrss), filters
   off and with every filter but --langid on (`--clean --dropped FILE`), alternating, `--repeats`
   times each; the best time of each is kept, and the largest peak. Targets: filtered time within
   1.3x the unfiltered, peak RSS within 1.5x.

3. The identifier alone (`--langid`'s py3langid): sentences per second over Multi30k's English,
   German, French and Czech sides, over all its languages and narrowed to en/de, and how often
   each calls a sentence what it is (English and German: how many good sides --langid would drop;
   French and Czech put where German is expected: how many bad ones it catches).

Run it from the checkout's root:

    python -m benchmarks.binarize_clean                      # 4.5M pairs, 2 repeats (~7 min)
    python -m benchmarks.binarize_clean --pairs 500000 --repeats 1

The human-readable report goes to stderr; the numbers, as one JSON object, to stdout. Everything
is written in a temporary directory (under --work, default the system's) removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import REPO_ROOT, SHARED, log

DEFAULT_DATA_DIR = SHARED / "data" / "multi30k"
TIME_TARGET = 1.3  # filtered time / unfiltered, at most
MEMORY_TARGET = 1.5  # filtered peak RSS / unfiltered, at most
PLANTED = {1: "ratio", 2: "control", 3: "copy", 4: "digits", 5: "duplicate", 6: "langid"}
FILTERS = ["--clean"]  # every filter but --langid, --max-ratio 3


# ------------------------------------------------------------------------------------- corpus


def read_side(data_dir: Path, language: str) -> list[str]:
    path = data_dir / f"train.{language}"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist (--data-dir: Multi30k's plain text)")
    return path.read_text(encoding="utf-8").splitlines()


def planted(index: int, source: str, target: str, lines: dict, wrong: list[str],
            copy: int) -> tuple[str, str]:
    """Line `index` of the corpus (from 0), bad in the way PLANTED gives for index % 100."""
    kind = PLANTED.get(index % 100)
    if kind == "ratio":
        return source, " ".join([target] * 4)
    if kind == "control":
        middle = len(source) // 2
        return source[:middle] + "\u200b" + source[middle:], target
    if kind == "copy":
        return source, source.lower().replace(" ", "  ")
    if kind == "digits":
        return source, f"{target} 7"
    if kind == "duplicate":
        earlier = index - 5
        size = len(lines["en"])
        return (f"{lines['en'][earlier % size]}  {earlier // size}",
                f"{lines['de'][earlier % size]}   {earlier // size}")
    if kind == "langid":
        return source, f"{wrong[index % len(wrong)]} {copy}"
    return source, target


def build_corpus(lines: dict, wrong: list[str], pairs: int, work: Path) -> dict[str, Path]:
    """`pairs` lines of each side (module docstring, 1) in `work`; streams, a copy at a time."""
    size = len(lines["en"])
    paths = {side: work / f"corpus.{side}" for side in ("en", "de")}
    with open(paths["en"], "w", encoding="utf-8") as src, \
            open(paths["de"], "w", encoding="utf-8") as tgt:
        for index in range(pairs):
            copy, line = divmod(index, size)
            source, target = planted(index, f"{lines['en'][line]} {copy}",
                                     f"{lines['de'][line]} {copy}", lines, wrong, copy)
            src.write(source + "\n")
            tgt.write(target + "\n")
    return paths


def learn_vocabulary(data_dir: Path, size: int, model_path: Path) -> None:
    command = [sys.executable, "-m", "attn_cli", "vocab", str(data_dir / "train.en"),
               str(data_dir / "train.de"), "-o", str(model_path), "--size", str(size)]
    finished = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if finished.returncode != 0:
        raise SystemExit(f"error: `attn vocab` failed:\n{finished.stderr}")


# ------------------------------------------------------------------------------ time, memory


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def child(args: list[str]) -> None:
    """`--child ARGS...`: `attn ARGS` through the real entry point, then this process's peak
    RSS as JSON on stdout (binarize writes nothing there)."""
    from attn_cli.cli import main

    started = time.perf_counter()
    try:
        main(args)
    except SystemExit as exit_:
        if exit_.code:
            raise
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": time.perf_counter() - started,
                      "cpu_s": usage.ru_utime + usage.ru_stime,
                      "vm_hwm_kib": proc_status_kib("VmHWM"), "ru_maxrss_kib": usage.ru_maxrss}))


def run_binarize(paths: dict, model_path: Path, out: Path, extra: list[str],
                 threads: int) -> dict:
    command = [sys.executable, "-m", "benchmarks.binarize_clean", "--child", "binarize",
               "--vocab", str(model_path), str(paths["en"]), str(paths["de"]), "-o", str(out),
               "--threads", str(threads), *extra]
    started = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    wall = time.perf_counter() - started
    if finished.returncode != 0:
        raise SystemExit(f"error: binarize {' '.join(extra)} failed:\n{finished.stderr}")
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    result["summary"] = finished.stderr.strip().splitlines()[0]
    result["output_bytes"] = out.stat().st_size
    out.unlink()
    return result


def measure(paths: dict, model_path: Path, repeats: int, threads: int, work: Path) -> dict:
    """Filters off and on, alternating (module docstring, 2)."""
    dropped = work / "dropped.tsv"
    configurations = {"off": [], "clean": [*FILTERS, "--dropped", str(dropped)]}
    runs: dict[str, list[dict]] = {name: [] for name in configurations}
    for repeat in range(repeats):
        for name, extra in configurations.items():
            run = run_binarize(paths, model_path, work / f"{name}.st", extra, threads)
            runs[name].append(run)
            log(f"  {repeat + 1}/{repeats} {name:5s} {run['wall_s']:7.1f} s (CPU "
                f"{run['cpu_s']:6.1f} s)  peak "
                f"{run['vm_hwm_kib'] / 1024:7.1f} MiB   {run['summary']}")
    dropped_counts: dict[str, int] = {}
    with open(dropped, encoding="utf-8") as handle:
        for line in handle:
            name = line.split("\t", 1)[0]
            dropped_counts[name] = dropped_counts.get(name, 0) + 1
    best = {name: min(run["wall_s"] for run in found) for name, found in runs.items()}
    cpu = {name: min(run["cpu_s"] for run in found) for name, found in runs.items()}
    peak = {name: max(run["vm_hwm_kib"] for run in found) for name, found in runs.items()}
    ratio_time, ratio_memory = best["clean"] / best["off"], peak["clean"] / peak["off"]
    return {"runs": runs, "best_s": best, "best_cpu_s": cpu, "peak_kib": peak,
            "dropped": dropped_counts, "ratio_time": ratio_time,
            "ratio_cpu": cpu["clean"] / cpu["off"], "ratio_memory": ratio_memory,
            "time_target": TIME_TARGET, "memory_target": MEMORY_TARGET,
            "pass": ratio_time <= TIME_TARGET and ratio_memory <= MEMORY_TARGET}


# ------------------------------------------------------------------------------ identifier


def identifier_speed(data_dir: Path, sentences: int) -> dict:
    """py3langid alone (module docstring, 3), through cleaning.LanguageCheck's identifier."""
    from attn_cli.cleaning import LanguageCheck

    found = {}
    for candidates in ("all", "en,de"):
        identifier = LanguageCheck(("en", "de")).identifier
        if candidates != "all":
            identifier.set_languages(candidates.split(","))
        rows = {}
        for language in ("en", "de", "fr", "cs"):
            path = data_dir / f"train.{language}"
            if not path.is_file():
                continue
            lines = path.read_text(encoding="utf-8").splitlines()[:sentences]
            started = time.perf_counter()
            labels = [identifier.classify(line)[0] for line in lines]
            seconds = time.perf_counter() - started
            rows[language] = {"sentences": len(lines), "sentences_per_s": len(lines) / seconds,
                              "called_right": labels.count(language) / len(lines),
                              "called_de": labels.count("de") / len(lines)}
        total = sum(row["sentences"] for row in rows.values())
        seconds = sum(row["sentences"] / row["sentences_per_s"] for row in rows.values())
        found[candidates] = {"languages": rows, "sentences_per_s": total / seconds}
    return found


# ------------------------------------------------------------------------------------ report


def cpu_line() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                  if line.startswith("Model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("Flags")), [])
    named = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"),
                                     ("amx_tile", "AMX")) if flag in flags]
    return f"{model}, {os.cpu_count()} CPUs, {' + '.join(named) or 'no AVX2'}"


def report(pairs: int, timing: dict, identifier: dict, cpu: str) -> None:
    log()
    log(f"binarize at {pairs} pairs ({cpu}); best time, largest peak RSS (VmHWM)")
    for name in ("off", "clean"):
        log(f"  {name:5s}  {timing['best_s'][name]:7.1f} s (CPU {timing['best_cpu_s'][name]:6.1f}"
            f" s)   {timing['peak_kib'][name] / 1024:7.1f} MiB")
    verdict = "PASS" if timing["pass"] else "FAIL"
    log(f"  ratio clean/off: time {timing['ratio_time']:.3f} (CPU time "
        f"{timing['ratio_cpu']:.3f}; target <= {TIME_TARGET}), peak memory "
        f"{timing['ratio_memory']:.3f} (target <= {MEMORY_TARGET})   {verdict}")
    log(f"  --dropped lines by filter: {timing['dropped']}")
    log()
    log("py3langid alone (one thread): sentences/s; share called its own language (en, de),")
    log("share called German, so kept where German is expected (fr, cs)")
    for candidates, found in identifier.items():
        cells = "  ".join(
            f"{language} {row['sentences_per_s']:7,.0f}/s "
            f"{row['called_right'] if language in ('en', 'de') else row['called_de']:.3f}"
            for language, row in found["languages"].items())
        log(f"  {candidates:6s} {found['sentences_per_s']:8,.0f}/s   {cells}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Time and peak memory of `attn binarize --clean` against no filters, at "
                    "WMT14 en-de's size, and the language identifier's speed.")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="Multi30k as plain text: train.{en,de}, and train.fr or train.cs "
                             "for the wrong-language pairs (default: ../shared/data/multi30k).")
    parser.add_argument("--pairs", type=int, default=4_500_000, help="Corpus size (pairs).")
    parser.add_argument("--repeats", type=int, default=2, help="Runs of each (alternating).")
    parser.add_argument("--size", type=int, default=8000, help="Vocabulary size to learn.")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="binarize --threads (default: os.cpu_count()).")
    parser.add_argument("--langid-sentences", type=int, default=5000,
                        help="Sentences of each language for the identifier alone.")
    parser.add_argument("--work", type=Path, default=None,
                        help="Where the temporary directory goes (the corpus: ~0.7 GB).")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return
    if args.pairs < 1000 or args.repeats < 1:
        parser.error("--pairs must be at least 1000 and --repeats at least 1")
    total_started = time.perf_counter()
    lines = {side: read_side(args.data_dir, side) for side in ("en", "de")}
    wrong_language = "fr" if (args.data_dir / "train.fr").is_file() else "cs"
    wrong = read_side(args.data_dir, wrong_language)
    cpu = cpu_line()
    with tempfile.TemporaryDirectory(prefix="attn-binarize-clean.", dir=args.work) as directory:
        work = Path(directory)
        started = time.perf_counter()
        paths = build_corpus(lines, wrong, args.pairs, work)
        del lines, wrong
        log(f"corpus: {args.pairs} pairs in {time.perf_counter() - started:.1f}s "
            f"({paths['en'].stat().st_size + paths['de'].stat().st_size:,} bytes)")
        model_path = work / "spm.model"
        learn_vocabulary(args.data_dir, args.size, model_path)
        log(f"binarize: filters off and {' '.join(FILTERS)}, {args.repeats} each, alternating")
        timing = measure(paths, model_path, args.repeats, args.threads, work)
    identifier = identifier_speed(args.data_dir, args.langid_sentences)
    report(args.pairs, timing, identifier, cpu)
    seconds = time.perf_counter() - total_started
    log(f"\ntotal {seconds:.1f}s")
    print(json.dumps({"pairs": args.pairs, "cpu": cpu, "threads": args.threads,
                      "binarize": timing, "identifier": identifier, "total_seconds": seconds,
                      "python": sys.version.split()[0]}, indent=2))


if __name__ == "__main__":
    main()
