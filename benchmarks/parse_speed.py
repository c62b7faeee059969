"""Parsing speed of `attn parse` (beam 21, α 0.3, --constrain: the parse recipe's search), with
the code of another revision as a same-run reference and its trees as the guard.

It runs the real command in a subprocess over a file of sentences (the recipe's dev.src) and
reports the seconds of the parse itself (the command's own summary: reading, batching, search,
tree repair, writing; start-up and model loading apart), the median of `--repeats` runs. With
`--baseline REV`, the same command from a checkout of git revision REV (a temporary worktree)
runs alternately with it, on the same model and input: the ratio of the two is what carries to
another machine, and the trees must be byte-identical (a faster search that changes a tree is a
different search). Scoring against gold trees is `attn score --trees`'s job, not this script's.

    python -m benchmarks.parse_speed -m examples/wsj-parse/work/parser.st \
        --src examples/wsj-parse/work/dev.src --baseline HEAD~3

Report on stderr (with the CPU model and ISA), one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._harness import REPO_ROOT, decode_stats, log, supports
from benchmarks.machine import cpu_info


def parse_once(code_root: Path, model: str, src: str, options: list[str]) -> tuple[float, bytes]:
    """(seconds the parse took by its own summary, the trees) with the attn_cli of `code_root`."""
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    with tempfile.TemporaryDirectory() as scratch, open(src, "rb") as stdin:
        stats_path = Path(scratch) / "stats.json"
        stats = ["--stats-json", str(stats_path)] if supports(code_root, "parse",
                                                              "--stats-json") else []
        done = subprocess.run([sys.executable, "-m", "attn_cli", "parse", "-m", model, *options,
                               *stats], stdin=stdin, capture_output=True, env=env, cwd=code_root)
        if done.returncode != 0:
            raise SystemExit(f"parse failed ({code_root}):\n{done.stderr.decode()}")
        return decode_stats(stats_path, done.stderr.decode())["seconds"], done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", required=True, help="A parser model file.")
    parser.add_argument("--src", required=True, help="Sentences, one per line.")
    parser.add_argument("--baseline", help="A git revision to time beside the working tree.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--extra", default="--beam 21 --alpha 0.3 --constrain",
                        help="Options of `attn parse` (default: the recipe's search).")
    args = parser.parse_args()
    options = args.extra.split()
    # each revision runs in its own checkout: the files are named from where we are
    model, src = str(Path(args.model).resolve()), str(Path(args.src).resolve())
    name, isa = cpu_info()
    log(f"CPU: {name} ({isa}), {os.cpu_count()} cores; attn parse {' '.join(options)}")
    roots = {"current": REPO_ROOT}
    with tempfile.TemporaryDirectory() as scratch:
        if args.baseline:
            baseline = Path(scratch) / "baseline"
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach",
                            str(baseline), args.baseline], check=True, capture_output=True)
            roots["baseline"] = baseline
        try:
            seconds: dict[str, list[float]] = {label: [] for label in roots}
            trees: dict[str, bytes] = {}
            for repeat in range(args.repeats):
                for label, root in roots.items():
                    took, output = parse_once(root, model, src, options)
                    seconds[label].append(took)
                    if trees.setdefault(label, output) != output:
                        raise SystemExit(f"{label}: another run gave other trees")
                    log(f"round {repeat + 1}: {label} {took:.1f} s")
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force",
                                str(roots["baseline"])], capture_output=True)
    report = {"cpu": name, "isa": isa, "options": options,
              "sentences": trees["current"].count(b"\n"),
              "seconds": {label: statistics.median(values) for label, values in seconds.items()}}
    if args.baseline:
        report["baseline"] = args.baseline
        report["speedup"] = report["seconds"]["baseline"] / report["seconds"]["current"]
        report["identical_trees"] = trees["baseline"] == trees["current"]
        log(f"median: {report['seconds']['current']:.1f} s against {args.baseline}'s "
            f"{report['seconds']['baseline']:.1f} s: {report['speedup']:.2f}x; trees "
            f"{'identical' if report['identical_trees'] else 'DIFFERENT'}")
    else:
        log(f"median: {report['seconds']['current']:.1f} s")
    print(json.dumps(report))
    if args.baseline and not report["identical_trees"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
