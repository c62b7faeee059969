"""Where `attn decode`'s time goes, op by op: the test set searched in one process on one torch
thread (one search worker), under torch.profiler, with the search's own parts labelled.

    python -m benchmarks.decode_profile -m model.st [--beam 4] [--int8] [--lines 1000] [--top 25]
    python -m benchmarks.decode_profile -m model.st --write before.txt   # then, changed:
    python -m benchmarks.decode_profile -m model.st --check before.txt --no-profile
    python -m benchmarks.decode_profile -m parser.st --parse --src dev.src   # beam 21, α 0.3,
                                                     # --constrain: the parse recipe's search

Prints on stderr the wall time of a plain run (no profiler) and the profiled table of the ops
that took the most time (self CPU time), and on stdout one JSON object: the plain seconds, the
output tokens, and the top ops with their self time in ms and call counts. With `--check FILE`
the outputs are compared with FILE (one line per line) and the differences counted: the way to
show that a change to the search is byte-identical.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from benchmarks import _harness


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--beam", type=int, help="Default: 4, with --parse 21.")
    parser.add_argument("--nbest", type=int, default=1)
    parser.add_argument("--int8", action="store_true", help="attn decode --int8's model.")
    parser.add_argument("--compile", default="off", help="attn decode --compile's mode.")
    parser.add_argument("--step", default="auto", help="attn decode --step's mode (auto: the "
                        "C++ step; eager: torch's ops from Python).")
    parser.add_argument("--split", action="store_true",
                        help="Also say how much of a plain run is the decoder's steps (the "
                        "rest: the encoder, the search, batching and pieces).")
    parser.add_argument("--parse", action="store_true",
                        help="A parser model, searched as `attn parse --beam 21 --alpha 0.3 "
                        "--constrain` (the recipe's search; --beam and --alpha still apply): "
                        "the outputs are the hypotheses' pieces, not repaired trees.")
    parser.add_argument("--alpha", type=float, help="Length penalty (default: the command's).")
    parser.add_argument("--src", help="Input lines (default: the bundled test2016 English).")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=3, help="Plain runs; the best is shown.")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--check", help="A file of expected outputs, one line per line.")
    parser.add_argument("--write", help="Write the outputs here.")
    args = parser.parse_args()

    from attn_cli.decode.translator import load_translator

    torch.set_num_threads(1)
    options = {} if args.alpha is None else {"alpha": args.alpha}
    from attn_cli.formats import PARSING, TRANSLATION

    if args.parse:
        from attn_cli.parse.constraint import tree_constraints

        beam = args.beam or PARSING.beam
        options = {"alpha": PARSING.alpha, "max_len_a": PARSING.max_len_a,
                   "max_len_b": PARSING.max_len_b, **options,
                   "constraint_for": tree_constraints()}
    else:
        beam = args.beam or TRANSLATION.beam
    translator = load_translator(args.model, beam=beam, nbest=args.nbest, device="cpu",
                                 threads=1, workers=1, int8=args.int8,
                                 compile=args.compile, step=args.step, **options)
    gc.freeze()  # as `attn decode` does once its model is loaded (cli._collector_on)
    if args.src:
        with open(args.src, encoding="utf-8") as source:
            lines = source.read().splitlines()[:args.lines]
    else:
        lines = _harness.read_bundled("test_2016_flickr.en.gz").splitlines()[:args.lines]
    started = time.perf_counter()
    translator.translate(lines[:20])  # oneDNN's kernels made, caches touched (and compiled)
    print(f"first 20 lines: {time.perf_counter() - started:.2f} s", file=sys.stderr)
    best, outputs = float("inf"), []
    for _ in range(args.repeats):
        started = time.perf_counter()
        outputs = translator.translate(lines)
        best = min(best, time.perf_counter() - started)
    tokens = sum(len(line.split()) for line in outputs)
    print(f"plain: {best:.3f} s for {len(lines)} lines (best of {args.repeats}), beam "
          f"{beam}, 1 thread", file=sys.stderr)
    report = {"seconds": best, "lines": len(lines), "beam": beam}
    if args.split:
        report.update(split_steps(translator, lines))
    if args.write:
        with open(args.write, "w", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in outputs)
    if args.check:
        with open(args.check, encoding="utf-8") as expected_file:
            expected = expected_file.read().split("\n")[:len(outputs)]
        differ = sum(a != b for a, b in zip(outputs, expected)) + abs(len(outputs) -
                                                                      len(expected))
        print(f"check: {differ} of {len(outputs)} lines differ from {args.check}",
              file=sys.stderr)
        report["differ"] = differ
    if not args.no_profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            translator.translate(lines)
        table = prof.key_averages()
        ranked = sorted(table, key=lambda e: -e.self_cpu_time_total)[:args.top]
        total = sum(e.self_cpu_time_total for e in table) / 1e3
        print(f"profiled: {total:.0f} ms of op self time (the profiler adds its own)",
              file=sys.stderr)
        for event in ranked:
            print(f"  {event.key:<40} {event.self_cpu_time_total / 1e3:9.1f} ms "
                  f"{event.count:>8} calls", file=sys.stderr)
        report["ops"] = [{"op": e.key, "ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                         for e in ranked]
    report["output_words"] = tokens
    print(json.dumps(report))


def split_steps(translator, lines: list[str]) -> dict:
    """One more plain run with the decoder's steps timed and counted (rows, calls)."""
    stepped = translator.stepped
    step, spent, rows, calls = stepped.decode_step, [0.0], [0], [0]

    def timed(tokens, cache):
        started = time.perf_counter()
        result = step(tokens, cache)
        spent[0] += time.perf_counter() - started
        rows[0] += len(tokens)
        calls[0] += 1
        return result

    stepped.decode_step = timed
    try:
        started = time.perf_counter()
        translator.translate(lines)
        total = time.perf_counter() - started
    finally:
        del stepped.decode_step
    print(f"split: {total:.3f} s, of which decoder steps {spent[0]:.3f} s ({calls[0]} steps, "
          f"{rows[0]} rows), the rest {total - spent[0]:.3f} s", file=sys.stderr)
    return {"split_seconds": total, "step_seconds": spent[0], "steps": calls[0],
            "rows": rows[0]}


if __name__ == "__main__":
    main()
