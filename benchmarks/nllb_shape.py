"""An NLLB-200-distilled-600M-shaped model (random weights: no download) through `attn import
hf`, then loaded and decoding beside `transformers.generate` on the same machine.

    python -m benchmarks.nllb_shape [--work DIR] [--lines 16] [--beams 4,1] [--new-tokens 32]

The model: `M2M100ForConditionalGeneration` with NLLB-200-distilled-600M's config (d_model
1024, 12 + 12 layers, 16 heads, d_ff 4096, 256,206 embeddings: 615M parameters, 2.46 GB in
float32), its tokenizer an NllbTokenizer made from a SentencePiece model learned on the bundled
Multi30k text with NLLB's four language codes used here (the other ids are embeddings no text
reaches: the output projection is the full 256,206 rows). Figures:
- import: `attn import hf` wall seconds and its peak RSS;
- load: `attn decode`'s model load (its --stats-json `load_seconds`) and the process's peak
  RSS against the weights' bytes (the issue's bound: 1.3);
- decoding: the first `--lines` bundled English test sentences into French, attn (`attn
  decode`, all cores) against `generate` (the same threads, the lines in one padded batch, the
  tokens it writes counted without padding), each `--new-tokens` tokens after the decoder's
  start (a random model writes to the limit: both write the same count), at each beam;
  tokens/s of decoding only (attn's summary seconds; generate's call).
Report on stderr with the CPU, one JSON object on stdout. Needs attn[hf] and ~8 GB of memory.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import attn_command, log, read_bundled
from benchmarks.machine import cpu_info

NLLB_600M = dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                 decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096,
                 vocab_size=256206, max_position_embeddings=1024, pad_token_id=1,
                 bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                 scale_embedding=True, activation_function="relu", dropout=0.1,
                 attention_dropout=0.1)
CODES = ["eng_Latn", "fra_Latn", "deu_Latn", "ces_Latn"]


def build(directory: Path) -> int:
    """The random model and its tokenizer in `directory`; returns the weights' bytes."""
    import sentencepiece
    import torch
    import transformers

    text = read_bundled("train.en.gz").splitlines() + read_bundled("train.de.gz").splitlines()
    model_bytes = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=model_bytes, model_type="bpe",
        vocab_size=8000, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sentencepiece.bpe.model").write_bytes(model_bytes.getvalue())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "NllbTokenizer", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn"}))
    tokenizer = transformers.NllbTokenizer.from_pretrained(
        directory, additional_special_tokens=CODES, src_lang="eng_Latn")
    tokenizer.save_pretrained(directory)
    torch.manual_seed(1)
    model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**NLLB_600M))
    with torch.no_grad():  # a random model would write little but its language tokens (which
        # attn leaves out of its output, as skip_special_tokens): small rows, as a trained
        # model's, so that both write the same count of pieces
        special = tokenizer.convert_tokens_to_ids(["<s>", "<mask>", *CODES])
        model.model.shared.weight[special] *= 0.1
    model.save_pretrained(directory)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def peak_rss_of(argv: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float, int]:
    """Run argv; (its result, wall seconds, its peak RSS in bytes: wait4's ru_maxrss). Its
    output goes through files, not pipes: a child filling a pipe would wait forever."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(argv, stdout=kwargs.pop("stdout", out), stderr=err,
                                   text=True, **kwargs)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(map(str, argv))} failed:\n{stderr.strip()}")
    return subprocess.CompletedProcess(argv, code, stdout, stderr), seconds, \
        usage.ru_maxrss * 1024


def generate_rate(directory: Path, lines: list[str], beam: int, new_tokens: int,
                  threads: int) -> dict:
    """transformers' generate of the lines in one padded batch: tokens written a second."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.M2M100ForConditionalGeneration.from_pretrained(directory).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.src_lang = "eng_Latn"
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    forced = tokenizer.convert_tokens_to_ids("fra_Latn")
    with torch.inference_mode():
        started = time.perf_counter()
        found = model.generate(**batch, num_beams=beam, do_sample=False,
                               forced_bos_token_id=forced, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens)
        seconds = time.perf_counter() - started
    written = int((found[:, 1:] != tokenizer.pad_token_id).sum())
    return {"seconds": seconds, "tokens": written, "tokens_per_s": written / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, help="Where the model goes (default: a temporary "
                        "directory, removed after).")
    parser.add_argument("--lines", type=int, default=16)
    parser.add_argument("--beams", default="4,1")
    parser.add_argument("--new-tokens", type=int, default=32)
    # what the report runs in processes of its own: this one stays small, so that a child's
    # peak RSS (wait4's, which counts what a fork shares with its parent) is the child's own
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--generate", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--source", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--beam", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        print(json.dumps({"weight_bytes": build(args.build)}))
        return
    if args.generate:
        lines = args.source.read_text().splitlines()
        print(json.dumps(generate_rate(args.generate, lines, args.beam, args.new_tokens,
                                       len(os.sched_getaffinity(0)))))
        return

    cpu_name, isa = cpu_info()
    threads = len(os.sched_getaffinity(0))
    log(f"{cpu_name} ({isa}), {threads} threads")
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        hf = work / "nllb-600m-shape"
        started = time.perf_counter()
        here = [sys.executable, "-m", "benchmarks.nllb_shape"]
        weight_bytes = json.loads(peak_rss_of([*here, "--build", str(hf)])[0].stdout
                                  )["weight_bytes"]
        log(f"built the random model ({weight_bytes / 1e9:.2f} GB of weights) in "
            f"{time.perf_counter() - started:.0f}s")
        model = work / "nllb.st"
        _, import_s, import_rss = peak_rss_of([*attn_command(), "import", "hf", str(hf), "-o",
                                               str(model)])
        log(f"import: {import_s:.1f}s, peak RSS {import_rss / 1e9:.2f} GB")
        lines = read_bundled("test_2016_flickr.en.gz").splitlines()[:args.lines]
        source = work / "source.en"
        source.write_text("\n".join(lines) + "\n")
        report = {"cpu": cpu_name, "isa": isa, "threads": threads, "lines": len(lines),
                  "new_tokens": args.new_tokens, "weight_bytes": weight_bytes,
                  "import_seconds": import_s, "import_peak_rss": import_rss, "beams": {}}
        for beam in map(int, args.beams.split(",")):
            stats = work / f"stats.{beam}.json"
            # outputs of exactly new_tokens after the decoder's start: the forced language
            # token, new_tokens - 2 pieces and EOS (a random model writes to the limit)
            with open(source) as stdin:
                _, _, rss = peak_rss_of(
                    [*attn_command(), "decode", "-m", str(model), "--source-lang", "eng_Latn",
                     "--target-lang", "fra_Latn", "--beam", str(beam), "--max-len-a", "0",
                     "--max-len-b", str(args.new_tokens), "--stats-json", str(stats)],
                    stdin=stdin, stdout=subprocess.DEVNULL)
            ours = json.loads(stats.read_text())
            # attn counts the output tokens without the forced language token: add it back
            tokens = ours["output_tokens"] + ours["sentences"]
            theirs = json.loads(peak_rss_of([*here, "--generate", str(hf), "--source",
                                             str(source), "--beam", str(beam), "--new-tokens",
                                             str(args.new_tokens)])[0].stdout)
            row = {"attn_tokens_per_s": tokens / ours["seconds"], "attn_tokens": tokens,
                   "attn_seconds": ours["seconds"], "load_seconds": ours["load_seconds"],
                   "peak_rss": rss, "peak_rss_over_weights": rss / weight_bytes,
                   "transformers_tokens_per_s": theirs["tokens_per_s"],
                   "transformers_tokens": theirs["tokens"],
                   "transformers_seconds": theirs["seconds"]}
            row["x"] = row["attn_tokens_per_s"] / row["transformers_tokens_per_s"]
            report["beams"][beam] = row
            log(f"beam {beam}: load {row['load_seconds']:.1f}s, peak RSS {rss / 1e9:.2f} GB "
                f"({row['peak_rss_over_weights']:.2f}x the weights); attn "
                f"{row['attn_tokens_per_s']:.1f} tokens/s ({tokens} in {ours['seconds']:.1f}s), "
                f"transformers {theirs['tokens_per_s']:.1f} ({theirs['tokens']} in "
                f"{theirs['seconds']:.1f}s): {row['x']:.2f}x")
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
