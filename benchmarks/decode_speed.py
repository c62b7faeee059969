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
  the same run, each attn run next to a CTranslate2 run: attn's speed as a ratio of its.

    python benchmarks/decode_speed.py -m model.st
    python benchmarks/decode_speed.py -m model.st --beams 4 --extra "--dtype bf16"

Report on stderr, one JSON object on stdout. Targets (2-core CPU, the `small` preset trained as in
examples/multi30k): beam 4 >= 120 sentences/s and 1800 tokens/s; greedy >= 300 sentences/s and
4500 tokens/s.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from attn_cli.formats import TRANSLATION  # noqa: E402

DATA_DIR = REPO_ROOT / "examples" / "multi30k" / "data"
TARGETS = {TRANSLATION.beam: (120, 1800), 1: (300, 4500)}  # sentences/s, tokens/s
SUMMARY = re.compile(r"(\d+) sentences, (\d+) output tokens .* in ([\d.]+)s")
LOADED = re.compile(r"model loaded in ([\d.]+)s")


def log(message: str = "") -> None:
    print(message, file=sys.stderr, flush=True)


def read_gz(name: str) -> str:
    with gzip.open(DATA_DIR / name, "rt", encoding="utf-8") as handle:
        return handle.read()


def decode(model: str, source: str, beam: int, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "attn_cli", "decode", "-m", model, "--beam", str(beam),
               *extra]
    started = time.perf_counter()
    result = subprocess.run(command, input=source.encode(), capture_output=True, check=True)
    wall = time.perf_counter() - started
    stderr = result.stderr.decode()
    sentences, tokens, seconds = SUMMARY.search(stderr).groups()
    load = float(LOADED.search(stderr).group(1))
    seconds = float(seconds)
    return {"output": result.stdout.decode(), "sentences": int(sentences),
            "tokens": int(tokens), "decode_s": seconds, "load_s": load,
            "start_s": wall - seconds - load, "wall_s": wall,
            "sentences_per_s": int(sentences) / seconds, "tokens_per_s": int(tokens) / seconds}


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
    parser.add_argument("--no-reference", action="store_true",
                        help="Skip CTranslate2 even if it is installed.")
    args = parser.parse_args()
    import sacrebleu

    source = read_gz("test_2016_flickr.en.gz")
    lines = source.splitlines()
    references = read_gz("test_2016_flickr.de.gz").splitlines()
    extra = ["--threads", str(args.threads), *args.extra.split()]
    reference = None
    if not args.no_reference:
        try:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import ct2_reference as reference
        except ImportError:
            log("ctranslate2 is not installed: no same-run reference (pip install ctranslate2)")
    report = {"model": args.model, "extra": args.extra, "threads": args.threads, "runs": {}}
    with tempfile.TemporaryDirectory() as ct2_dir:
        if reference is not None:
            reference.convert(args.model, ct2_dir)
        for beam in (int(b) for b in args.beams.split(",")):
            attn_runs, ct2_runs = [], []
            for _ in range(args.repeats):  # interleaved: both see the same machine
                attn_runs.append(decode(args.model, source, beam, extra))
                if reference is not None:
                    outputs, seconds, tokens = reference.translate(ct2_dir, lines, beam,
                                                                   args.threads)
                    ct2_runs.append({"output": outputs, "decode_s": seconds, "tokens": tokens,
                                     "sentences_per_s": len(lines) / seconds,
                                     "tokens_per_s": tokens / seconds})
            batched = median_run(attn_runs)
            bleu = sacrebleu.corpus_bleu(batched["output"].splitlines(), [references]).score
            run = {key: value for key, value in batched.items() if key != "output"}
            run["bleu"] = bleu
            low_s, low_t = TARGETS.get(beam, (0, 0))
            run["pass"] = run["sentences_per_s"] >= low_s and run["tokens_per_s"] >= low_t
            log(f"beam {beam}: {run['sentences_per_s']:.1f} sentences/s, "
                f"{run['tokens_per_s']:.0f} tokens/s (target {low_s}/{low_t}: "
                f"{'PASS' if run['pass'] else 'FAIL'}); BLEU {bleu:.2f}; decode "
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
                log(f"        CTranslate2 float32, same batches: {ct2['sentences_per_s']:.1f} "
                    f"sentences/s, {ct2['tokens_per_s']:.0f} tokens/s, BLEU {ct2_bleu:.2f} "
                    f"(runs: {ct2['decode_s_all']}); attn/CTranslate2: "
                    f"{run['ctranslate2']['attn_speed_ratio']:.2f}x sentences/s, "
                    f"{run['ctranslate2']['attn_tokens_per_s_ratio']:.2f}x tokens/s")
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
            report["runs"][f"beam{beam}"] = run
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
