"""Decoding speed of `attn decode`, with BLEU as a guard and CTranslate2 as a same-run reference.

For beam 4 (the paper's search) and beam 1 (greedy), on the Multi30k test set (1000 lines,
bundled), it runs the real command in a subprocess and reports:
- sentences/s and output tokens/s (EOS included) of the decoding itself, from the command's
  own summary line (reading, batching, search, detokenizing, writing), the median of
  `--repeats` runs (this VM's speed drifts 10-40% between runs);
- process start (interpreter + imports) and model load, apart;
- BLEU (sacreBLEU, 13a) of the output, and the same for the one-sentence-at-a-time path
  (`--buffer-size 1`: every sentence alone in its batch), which must give identical output;
- when `ctranslate2` is installed (`pip install ctranslate2`), the same model converted weight
  for weight to CTranslate2 (benchmarks/ct2_reference.py), float32, timed on the same batches in
  the same run, each attn run next to a CTranslate2 run: attn's speed as a ratio of its
  (target: >= 1.0x output tokens/s at beam 4 and greedy);
- start-up: the wall time of a one-sentence `echo ... | attn decode -m model.st` against
  `python -c "import torch"`, alternated after an untimed pair, medians (target: at most
  0.3 s more than torch's import).

    python -m benchmarks.decode_speed -m model.st
    python -m benchmarks.decode_speed -m model.st --beams 4 --extra "--dtype bf16"
    python -m benchmarks.decode_speed -m model.st --int8

`--int8`: attn with `--int8` against CTranslate2's `int8` compute type, and attn's float32 BLEU
of the same run beside (target: within 0.3).

`--shortlist FILE` (from `attn shortlist`): each beam timed again with `attn decode --shortlist`
against CTranslate2 with the same shortlist as its vocabulary map (`use_vmap`), the full
vocabulary's runs beside in the same run. `--compile`: every configuration again with `attn
decode --compile on` (its compile in the decode time, as a run of the command has it).

The headline rows decode with attn's default, exact search (`--stop bound`: the result of a
search run to the length limit). CTranslate2 at a length penalty above 0 (here 0.6) stops a
sentence once beam-many hypotheses have ended (fairseq's rule), which decodes ~10% fewer rows:
each beam above 1 is therefore timed again as `beamK-patience`, attn with `--stop patience`,
CTranslate2's rule, against the same CTranslate2 runs' configuration (`--no-same-rule`: not;
an `--extra` naming `--stop` has its own rule already).

Report on stderr (with the CPU model and ISA), one JSON object on stdout. Only the same-run
ratios carry from one machine to another; the absolute figures are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attn_cli.formats import BATCH_TOKENS, GPU_BATCH_TOKENS, TRANSLATION
from benchmarks._harness import attn_command, decode_stats, log, read_bundled
from benchmarks.machine import cpu_info

CT2_RATIO_TARGET = 1.0  # attn / CTranslate2 output tokens/s
STARTUP_TARGET_S = 0.3  # one-sentence decode wall - `import torch` wall
ONE_SENTENCE = "A man is riding a bike down the street.\n"
CONFIGURATIONS = {"shortlist": "attn --shortlist, CTranslate2 use_vmap",
                  "compiled": "attn --compile on",
                  "patience": "attn --stop patience, CTranslate2's own stopping rule at a "
                               "length penalty above 0; inexact, not the headline"}


def decode(model: str, source: str, beam: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        stats_path = Path(scratch) / "stats.json"
        command = [*attn_command(), "decode", "-m", model, "--beam", str(beam), *extra,
                   "--stats-json", str(stats_path)]
        started = time.perf_counter()
        result = subprocess.run(command, input=source.encode(), capture_output=True, check=True)
        wall = time.perf_counter() - started
        stats = decode_stats(stats_path, result.stderr.decode())
    seconds, load = stats["seconds"], stats["load_seconds"]
    return {"output": result.stdout.decode(), "sentences": stats["sentences"],
            "tokens": stats["output_tokens"], "decode_s": seconds, "load_s": load,
            "start_s": wall - seconds - load, "wall_s": wall,
            "sentences_per_s": stats["sentences_per_s"], "tokens_per_s": stats["tokens_per_s"]}


def startup(model: str, repeats: int, extra: list[str]) -> dict:
    """Wall seconds of `python -c "import torch"` and of a one-sentence decode, alternated,
    after one untimed pair, as A/B timers do (the first of each reads its files
    from a cold page cache when another program ran before)."""
    torch_s, decode_s = [], []
    for round_ in range(repeats + 1):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        torch_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        subprocess.run([*attn_command(), "decode", "-m", model, *extra],
                       input=ONE_SENTENCE.encode(), capture_output=True, check=True)
        decode_s.append(time.perf_counter() - started)
        if round_ == 0:
            torch_s, decode_s = [], []
    torch_median, decode_median = statistics.median(torch_s), statistics.median(decode_s)
    return {"import_torch_s": torch_median, "one_sentence_decode_s": decode_median,
            "overhead_s": decode_median - torch_median, "import_torch_all": torch_s,
            "decode_all": decode_s, "pass": decode_median - torch_median <= STARTUP_TARGET_S}


def median_run(runs: list[dict]) -> dict:
    """The run of median decoding time, with every run's time listed."""
    ordered = sorted(runs, key=lambda run: run["decode_s"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle["decode_s_all"] = [round(run["decode_s"], 3) for run in runs]
    return middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--beams", default=f"{TRANSLATION.beam},1",
                        help="Beam sizes to time, comma-separated (1: greedy).")
    parser.add_argument("--repeats", type=int, default=3, help="Runs of each; medians reported.")
    parser.add_argument("--extra", default="", help="More `attn decode` options, quoted.")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads for both attn and CTranslate2.")
    parser.add_argument("--no-single", action="store_true",
                        help="Skip the one-sentence-at-a-time comparison.")
    parser.add_argument("--startup-repeats", type=int, default=5,
                        help="One-sentence decodes (and `import torch`) timed; 0: none.")
    parser.add_argument("--int8", action="store_true", help="attn --int8 against "
                        "CTranslate2 int8, with attn's float32 BLEU for the difference.")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: attn decode --device cuda (bf16 unless --extra names a "
                        "--dtype) against CTranslate2 on the same GPU (bfloat16, int8_bfloat16 "
                        "with --int8), both on attn's GPU batches")
    parser.add_argument("--no-reference", action="store_true",
                        help="Skip CTranslate2 even if it is installed.")
    parser.add_argument("--compile", action="store_true",
                        help="Also time attn with --compile on (each configuration), the "
                        "compile inside its decode time, as a user's run has it.")
    parser.add_argument("--no-same-rule", action="store_true",
                        help="Skip the rows timing attn with CTranslate2's stopping rule "
                        "(--stop patience) beside the exact default.")
    parser.add_argument("--shortlist", help="Also time attn with this `attn shortlist` file "
                        "(--shortlist) against CTranslate2 with the same shortlist as its "
                        "vocabulary map (use_vmap), each beam.")
    args = parser.parse_args()
    import sacrebleu

    source = read_bundled("test_2016_flickr.en.gz")
    lines = source.splitlines()
    references = read_bundled("test_2016_flickr.de.gz").splitlines()
    extra = ["--threads", str(args.threads), *args.extra.split(),
             *(["--int8"] if args.int8 else [])]
    compute_type = "int8" if args.int8 else "float32"
    batch_tokens = BATCH_TOKENS
    if args.device == "cuda":
        extra += ["--device", "cuda", *([] if "--dtype" in extra else ["--dtype", "bf16"])]
        fp32 = extra[extra.index("--dtype") + 1] == "fp32"
        compute_type = ("int8_" if args.int8 else "") + ("float32" if fp32 else "bfloat16")
        batch_tokens = GPU_BATCH_TOKENS
    reference = None
    if not args.no_reference:
        # (from fc03f90 to here a bare `import ct2_reference` failed under `python -m`, and
        # the reference was skipped as if CTranslate2 were missing)
        try:
            import ctranslate2  # noqa: F401

            from benchmarks import ct2_reference as reference
        except ImportError:
            log("ctranslate2 is not installed: no same-run reference (pip install ctranslate2)")
    cpu_name, isa = cpu_info()
    log(f"{cpu_name} ({isa}), {args.threads} threads")
    report = {"model": args.model, "extra": args.extra, "threads": args.threads,
              "cpu": cpu_name, "isa": isa, "runs": {}}
    if args.startup_repeats:
        report["startup"] = up = startup(args.model, args.startup_repeats, extra)
        log(f"start-up: one-sentence decode {up['one_sentence_decode_s']:.2f}s, `import torch` "
            f"{up['import_torch_s']:.2f}s (medians of {args.startup_repeats}): "
            f"{up['overhead_s']:+.2f}s (target <= +{STARTUP_TARGET_S}s: "
            f"{'PASS' if up['pass'] else 'FAIL'})")
    with tempfile.TemporaryDirectory() as ct2_dir:
        if reference is not None:
            reference.convert(args.model, ct2_dir)
        configurations = [("", extra, False)]
        if args.shortlist:
            configurations.append(("-shortlist", extra + ["--shortlist", args.shortlist], True))
            if reference is not None:
                reference.write_vmap(args.shortlist, args.model, ct2_dir)
        if args.compile:  # each again with the step compiled, its compile time included
            configurations += [(suffix + "-compiled", options + ["--compile", "on"], use_vmap)
                               for suffix, options, use_vmap in configurations]
        if not args.no_same_rule and "--stop" not in extra:
            configurations.append(("-patience", extra + ["--stop", "patience"], False))
        for beam, (suffix, extra, use_vmap) in ((int(b), configuration)
                                                 for b in args.beams.split(",")
                                                 for configuration in configurations):
            if beam == 1 and suffix == "-patience":  # greedy: every rule is the same
                continue
            if suffix:
                said = ", ".join(CONFIGURATIONS[part] for part in suffix[1:].split("-"))
                log(f"beam {beam}, {suffix[1:]} ({said}):")
            attn_runs, ct2_runs = [], []
            for _ in range(args.repeats):  # interleaved: both see the same machine
                attn_runs.append(decode(args.model, source, beam, extra))
                if reference is not None:
                    outputs, seconds, tokens = reference.translate(
                        ct2_dir, lines, beam, args.threads, compute_type=compute_type,
                        use_vmap=use_vmap, device=args.device, batch_tokens=batch_tokens)
                    ct2_runs.append({"output": outputs, "decode_s": seconds, "tokens": tokens,
                                     "sentences_per_s": len(lines) / seconds,
                                     "tokens_per_s": tokens / seconds})
            batched = median_run(attn_runs)
            bleu = sacrebleu.corpus_bleu(batched["output"].splitlines(), [references]).score
            run = {key: value for key, value in batched.items() if key != "output"}
            run["bleu"] = bleu
            if args.int8:  # the float32 output's BLEU, to say what int8 costs
                fp32 = decode(args.model, source, beam, [x for x in extra if x != "--int8"])
                run["fp32_bleu"] = sacrebleu.corpus_bleu(fp32["output"].splitlines(),
                                                         [references]).score
                log(f"beam {beam}: --int8 BLEU {bleu:.2f} against float32 "
                    f"{run['fp32_bleu']:.2f} ({bleu - run['fp32_bleu']:+.2f}; target within "
                    f"0.3: {'PASS' if abs(bleu - run['fp32_bleu']) <= 0.3 else 'FAIL'})")
            log(f"beam {beam}: {run['sentences_per_s']:.1f} sentences/s, "
                f"{run['tokens_per_s']:.0f} tokens/s; BLEU {bleu:.2f}; decode "
                f"{run['decode_s']:.2f}s (runs: {run['decode_s_all']}), model load "
                f"{run['load_s']:.2f}s, process start {run['start_s']:.2f}s")
            if ct2_runs:
                ct2 = median_run(ct2_runs)
                ct2_bleu = sacrebleu.corpus_bleu(ct2["output"], [references]).score
                run["ctranslate2"] = {
                    "sentences_per_s": ct2["sentences_per_s"],
                    "tokens_per_s": ct2["tokens_per_s"], "decode_s": ct2["decode_s"],
                    "decode_s_all": ct2["decode_s_all"], "bleu": ct2_bleu,
                    "attn_speed_ratio": ct2["decode_s"] / run["decode_s"],
                    "attn_tokens_per_s_ratio": run["tokens_per_s"] / ct2["tokens_per_s"]}
                ratio = run["ctranslate2"]["attn_tokens_per_s_ratio"]
                run["pass"] = ratio >= CT2_RATIO_TARGET
                log(f"        CTranslate2 {compute_type}, same batches: "
                    f"{ct2['sentences_per_s']:.1f} "
                    f"sentences/s, {ct2['tokens_per_s']:.0f} tokens/s, BLEU {ct2_bleu:.2f} "
                    f"(runs: {ct2['decode_s_all']}); attn/CTranslate2: "
                    f"{run['ctranslate2']['attn_speed_ratio']:.2f}x sentences/s, "
                    f"{ratio:.2f}x tokens/s (target >= {CT2_RATIO_TARGET}x: "
                    f"{'PASS' if run['pass'] else 'FAIL'})")
            if not args.no_single:
                single = decode(args.model, source, beam, extra + ["--buffer-size", "1"])
                single_bleu = sacrebleu.corpus_bleu(single["output"].splitlines(),
                                                    [references]).score
                same = sum(a == b for a, b in zip(batched["output"].splitlines(),
                                                  single["output"].splitlines()))
                run["single"] = {"bleu": single_bleu, "identical_lines": same,
                                 "sentences_per_s": single["sentences_per_s"]}
                log(f"        one at a time: BLEU {single_bleu:.2f}, {same}/{run['sentences']} "
                    f"identical lines, {single['sentences_per_s']:.1f} sentences/s")
            report["runs"][f"beam{beam}{suffix}"] = run
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
