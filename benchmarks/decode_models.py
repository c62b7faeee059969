"""Several models (or one model under several decoding options) decoding the same text, timed in
the same run: a teacher against its student, fp32 against --int8.

    python -m benchmarks.decode_models --input test.en --ref test.de \\
        --run teacher=teacher.st --run student=student.st --run "student int8=student.st --int8" \\
        [--beams 4,1] [--rounds 3] [--markdown results.md]

Each --run is NAME=MODEL followed by any `attn decode` options. For each beam size, every run
decodes the whole input once a round, the runs taking turns round by round (so that a busy
moment of the machine falls on all of them alike); a run's time is the median of its rounds'
decoding seconds as `attn decode --stats-json` reports them (the model's load is apart).

The rates are per second of decoding: input lines, output words (whitespace-separated, the
same unit whatever each model's vocabulary) and output pieces (each model's own subwords, EOS
included: not comparable between vocabularies of different sizes); `x` is the words/s against
the first run's at the same beam. With --ref, the first round's output is scored (sacreBLEU's
BLEU and chrF). Report on stderr (with the CPU), one JSON object on stdout, and with --markdown
the table as a file.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from attn_cli.files import atomic_path
from benchmarks._harness import attn_command, log
from benchmarks.machine import cpu_info


def parse_run(text: str) -> tuple[str, str, list[str]]:
    """'NAME=MODEL --opt ...' as (name, model, options)."""
    name, sep, rest = text.partition("=")
    words = shlex.split(rest)
    if not sep or not name.strip() or not words:
        raise SystemExit(f"--run {text!r}: expected NAME=MODEL [attn decode options]")
    return name.strip(), words[0], words[1:]


def decode_once(model: str, options: list[str], beam: int, source: Path, hypothesis: Path,
                threads: int) -> dict:
    """One `attn decode` of the whole input; its --stats-json figures and the output's words."""
    stats = hypothesis.with_suffix(".stats.json")
    argv = [*attn_command(), "decode", "-m", model, "--beam", str(beam), "--threads",
            str(threads), "--stats-json", str(stats), *options]
    with open(source, "rb") as stdin, open(hypothesis, "wb") as stdout:
        result = subprocess.run(argv, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE,
                                text=True)
    if result.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} failed:\n{result.stderr.strip()}")
    figures = json.loads(stats.read_text())
    figures["words"] = len(hypothesis.read_text(encoding="utf-8").split())
    return figures


def scores(hypothesis: Path, reference: Path) -> dict:
    import sacrebleu

    hyps = hypothesis.read_text(encoding="utf-8").splitlines()
    refs = reference.read_text(encoding="utf-8").splitlines()
    if len(hyps) != len(refs):
        raise SystemExit(f"{reference}: {len(refs)} lines against {len(hyps)} decoded")
    return {"bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
            "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score}


def markdown(report: dict) -> str:
    scored = any("bleu" in row for row in report["rows"])
    head = "| model | beam | lines/s | words/s | pieces/s | x words/s |"
    rule = "|---|---:|---:|---:|---:|---:|"
    if scored:
        head, rule = head + " BLEU | chrF |", rule + "---:|---:|"
    lines = [f"{report['cpu']} ({report['isa']}), {report['threads']} threads, "
             f"{report['lines']} lines, median of {report['rounds']} rounds", "", head, rule]
    for row in report["rows"]:
        cells = [row["name"], str(row["beam"]), f"{row['lines_per_s']:.1f}",
                 f"{row['words_per_s']:.0f}", f"{row['pieces_per_s']:.0f}",
                 f"{row['x_words_per_s']:.2f}x"]
        if scored:
            cells += [f"{row['bleu']:.2f}", f"{row['chrf']:.2f}"] if "bleu" in row else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", type=Path, required=True, help="Source text, a line each.")
    parser.add_argument("--ref", type=Path, help="References: BLEU and chrF of each run's output.")
    parser.add_argument("--run", action="append", required=True,
                        help="NAME=MODEL [attn decode options]; the first is the reference.")
    parser.add_argument("--beams", default="4,1", help="Beam sizes (1: greedy).")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="attn decode --threads.")
    parser.add_argument("--markdown", type=Path, help="Also write the table here.")
    args = parser.parse_args()

    runs = [parse_run(text) for text in args.run]
    cpu_name, isa = cpu_info()
    lines = len(args.input.read_text(encoding="utf-8").splitlines())
    threads = args.threads or len(__import__("os").sched_getaffinity(0))
    log(f"{cpu_name} ({isa}), {threads} threads, {lines} lines, {args.rounds} rounds")
    report = {"cpu": cpu_name, "isa": isa, "threads": threads, "lines": lines,
              "rounds": args.rounds, "input": str(args.input), "rows": []}
    with tempfile.TemporaryDirectory() as scratch:
        for beam in map(int, args.beams.split(",")):
            rounds: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
            first: dict[str, Path] = {}
            for round_ in range(args.rounds):
                for index, (name, model, options) in enumerate(runs):
                    hypothesis = Path(scratch) / f"{index}.{beam}.{round_}.hyp"
                    figures = decode_once(model, options, beam, args.input, hypothesis,
                                          args.threads)
                    rounds[name].append(figures)
                    first.setdefault(name, hypothesis)
                    log(f"beam {beam} round {round_ + 1}: {name}: {figures['seconds']:.2f}s")
            base = None
            for name, model, options in runs:
                seconds = statistics.median(f["seconds"] for f in rounds[name])
                figures = rounds[name][0]
                row = {"name": name, "model": model, "options": options, "beam": beam,
                       "seconds": seconds, "lines_per_s": figures["sentences"] / seconds,
                       "words_per_s": figures["words"] / seconds,
                       "pieces_per_s": figures["output_tokens"] / seconds}
                base = base or row["words_per_s"]
                row["x_words_per_s"] = row["words_per_s"] / base
                if args.ref:
                    row.update(scores(first[name], args.ref))
                report["rows"].append(row)
                log(f"beam {beam}: {name}: {row['lines_per_s']:.1f} lines/s, "
                    f"{row['words_per_s']:.0f} words/s ({row['x_words_per_s']:.2f}x)"
                    + (f", BLEU {row['bleu']:.2f}, chrF {row['chrf']:.2f}" if args.ref else ""))
    if args.markdown:
        with atomic_path(args.markdown) as temporary:
            Path(temporary).write_text(markdown(report), encoding="utf-8")
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
