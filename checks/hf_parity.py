"""Does `transformers` compute what attn computes? An attn model exported with `attn export hf`,
run by MarianMTModel: greedy `generate` against `attn decode --beam 1` on a test set, line for
line, and the largest difference of their teacher-forced logits (fp32, CPU).

    python -m checks.hf_parity -m model.st [--src test.en] [--hf DIR] [--lines N]

Needs `pip install 'attn[hf]'`. The export's LayerNorm runs with Marian's fixed epsilon (1e-5); a
model trained with another (attn's default is 1e-6) differs by that alone, which the second
logits row shows by running Marian's layers with the model's own epsilon.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from attn_cli.modelfile import load_model
from attn_cli.search import max_output_length
from benchmarks._harness import BUNDLED_DATA

DEFAULT_SRC = BUNDLED_DATA / "test_2016_flickr.en.gz"  # plain text or gzipped


def attn_greedy(model: Path, src: Path) -> list[str]:
    run = subprocess.run([sys.executable, "-m", "attn_cli", "decode", "-m", str(model),
                          "--beam", "1"], stdin=src.open("rb"), capture_output=True, check=True)
    return run.stdout.decode().split("\n")[:-1]


def hf_greedy(marian, tokenizer, lines: list[str], batch: int = 64) -> list[str]:
    """Greedy generate with attn's length limit (|x| + 50 tokens, the last one EOS), batches of
    equal source length so that one max_new_tokens is every sentence's limit."""
    encoded = [tokenizer(line)["input_ids"] for line in lines]
    order = sorted(range(len(lines)), key=lambda i: len(encoded[i]))
    out = [""] * len(lines)
    start = 0
    while start < len(order):
        length = len(encoded[order[start]])
        group = [i for i in order[start:start + batch] if len(encoded[i]) == length]
        start += len(group)
        ids = torch.tensor([encoded[i] for i in group])
        limit = max_output_length(length - 1, 1.0, 50)
        with torch.inference_mode():
            generated = marian.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        num_beams=1, do_sample=False, max_length=1 + limit)
        for i, text in zip(group, tokenizer.batch_decode(generated, skip_special_tokens=True)):
            out[i] = text
    return out


def largest_logit_difference(loaded, marian, tokenizer, lines: list[str],
                             outputs: list[str]) -> float:
    """max |attn logits - transformers logits| teacher-forced on the given outputs."""
    config, worst = loaded.config, 0.0
    for line, output in zip(lines, outputs):
        src = torch.tensor([tokenizer(line)["input_ids"]])
        target = loaded.tgt_vocab.encode([output])[0]
        decoder_input = torch.tensor([[config.bos_id] + target])
        with torch.inference_mode():
            ours = loaded.model(src, decoder_input)
            theirs = marian(input_ids=src, decoder_input_ids=decoder_input).logits
        worst = max(worst, float((ours - theirs).abs().max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", type=Path, required=True)
    parser.add_argument("--src", type=Path, default=DEFAULT_SRC)
    parser.add_argument("--hf", type=Path, help="the exported directory (default: export now)")
    parser.add_argument("--lines", type=int, default=0, help="only the first N (0: all)")
    parser.add_argument("--logit-lines", type=int, default=200)
    args = parser.parse_args()
    from transformers import MarianMTModel, MarianTokenizer

    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.hf or Path(scratch) / "hf"
        if args.hf is None:
            subprocess.run([sys.executable, "-m", "attn_cli", "export", "hf", str(args.model),
                            "-o", str(directory)], check=True)
        opener = gzip.open if args.src.suffix == ".gz" else open
        with opener(args.src, "rt", encoding="utf-8") as handle:
            lines = handle.read().split("\n")[:-1]
        if args.lines:
            lines = lines[:args.lines]
        src = Path(scratch) / "src.txt"
        src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        started = time.perf_counter()
        ours = attn_greedy(args.model, src)
        attn_seconds = time.perf_counter() - started
        marian = MarianMTModel.from_pretrained(directory).eval()
        tokenizer = MarianTokenizer.from_pretrained(directory)
        started = time.perf_counter()
        theirs = hf_greedy(marian, tokenizer, lines)
        hf_seconds = time.perf_counter() - started
        same = sum(a == b for a, b in zip(ours, theirs))
        print(f"greedy: {same}/{len(lines)} lines equal (attn decode {attn_seconds:.1f} s, "
              f"transformers generate {hf_seconds:.1f} s)")
        for a, b in [(a, b) for a, b in zip(ours, theirs) if a != b][:3]:
            print(f"  attn: {a}\n  hf:   {b}")
        loaded = load_model(args.model)
        loaded.model.eval()
        sample = slice(0, args.logit_lines)
        difference = largest_logit_difference(loaded, marian, tokenizer, lines[sample],
                                              ours[sample])
        print(f"largest logit difference, {len(lines[sample])} lines: {difference:.3g} "
              "(Marian's LayerNorm epsilon 1e-5)")
        for module in marian.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.eps = loaded.config.layer_norm_eps
        difference = largest_logit_difference(loaded, marian, tokenizer, lines[sample],
                                              ours[sample])
        print(f"largest logit difference, {len(lines[sample])} lines: {difference:.3g} "
              f"(epsilon {loaded.config.layer_norm_eps:g}, the model's)")


if __name__ == "__main__":
    main()
