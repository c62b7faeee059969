"""CTranslate2 as a decoding-speed reference: the same attn model, converted weight for weight.

`convert` writes a CTranslate2 model directory from an attn model file (`attn export ct2`,
attn_cli/interop/ct2.py); `translate` decodes lines with
it as `attn decode` would (same SentencePiece model, same source EOS, same token-budget batches,
pad and BOS banned, output limit |x| + 50) and returns the outputs, the seconds and the output
tokens (EOS included). Run on its own, it times both thread layouts on the Multi30k test set:

    python -m benchmarks.ct2_reference -m model.st [--beam 4] [--threads 2] [--lines 1000]

Report on stderr, one JSON object on stdout. Differences from attn's search that remain: CTranslate2
normalises a finished hypothesis by |Y|^lp (|Y| without the EOS), not GNMT's ((5 + |Y|) / 6)^α,
and at a length penalty other than 0 its beam search stops a sentence once beam-many hypotheses
have ended (`attn decode --stop patience`; ours by default: once no live beam can win); a sentence
that reaches the length limit gets no EOS (ours is forced to end with one). Greedy search with no
length penalty is exactly attn's `--beam 1 --alpha 0`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from attn_cli.batching import balanced_batches
from attn_cli.formats import (
    BATCH_TOKENS,
    BOS_ID,
    EOS_ID,
    MAX_SOURCE_TOKENS,
    PAD_ID,
    SPECIAL_PIECES,
    TRANSLATION,
)
from attn_cli.interop.ct2 import export_ct2
from attn_cli.vocab import Vocabulary
from benchmarks._harness import BUNDLED_DATA

TEST_SET = BUNDLED_DATA / "test_2016_flickr.en.gz"


def convert(model_path: str, output_dir: str) -> str:
    """Write the CTranslate2 model (float32 weights) of `model_path` to `output_dir`, with the
    SentencePiece models beside it (source.spm, target.spm) for `translate`: `attn export ct2`,
    except that `translate` appends the source EOS itself (the EOS piece, as attn does)."""
    export_ct2(model_path, output_dir, "float32", add_source_eos=False, force=True)
    return output_dir


def write_vmap(shortlist_path: str, model_path: str, ct2_dir: str) -> None:
    """The attn shortlist as CTranslate2's vocabulary map, where its Translator reads one
    (vmap.txt in the model directory), so that both decoders keep the same candidates."""
    from attn_cli.decode.shortlist import Shortlist
    from attn_cli.modelfile import load_model

    loaded = load_model(model_path)
    lines = Shortlist.load(shortlist_path).vmap_lines(loaded.src_vocab, loaded.tgt_vocab)
    Path(ct2_dir, "vmap.txt").write_text("".join(line + "\n" for line in lines),
                                         encoding="utf-8")


def translate(ct2_dir: str, lines: list[str], beam: int, threads: int, layout: str = "inter",
              length_penalty: float | None = None, batch_tokens: int = BATCH_TOKENS,
              compute_type: str = "float32",
              use_vmap: bool = False, device: str = "cpu") -> tuple[list[str], float, int]:
    """Decode `lines` (non-empty) → (outputs, seconds, output tokens with one EOS each).

    layout "inter": `threads` batches at once, one thread each (as attn's CPU default, one
    search worker per thread), the faster; "intra": one batch at a time on `threads` threads
    (6-10x slower on a busy 2-core VM, its OpenMP threads waiting on each other). Seconds run
    from tokenizing to detokenizing, model load excluded (as attn decode's summary line).
    `compute_type`: CTranslate2's ("int8": its int8 weights and activations). `use_vmap`: its
    vocabulary map (vmap.txt in the model directory: `write_vmap`). `device` "cuda": one GPU,
    batches one after another (as attn decodes on a GPU: one search worker), of
    `batch_tokens` as attn's GPU batches are (pass formats.GPU_BATCH_TOKENS); the PyPI wheel
    finds CUDA 12's cuBLAS (libcublas.so.12) on the library path, where CUDA torch's
    nvidia-cublas-cu12 package has it (site-packages/nvidia/cublas/lib)."""
    import ctranslate2

    src_vocab, tgt_vocab = (Vocabulary.from_file(Path(ct2_dir, f"{name}.spm"))
                            for name in ("source", "target"))
    src_pieces = [src_vocab.processor.id_to_piece(i) for i in range(len(src_vocab))]
    tgt_ids = {tgt_vocab.processor.id_to_piece(i): i for i in range(len(tgt_vocab))}
    inter, intra = (threads, 1) if layout == "inter" else (1, threads)
    if device != "cpu":
        inter, intra = 1, 1
    translator = ctranslate2.Translator(ct2_dir, device=device, compute_type=compute_type,
                                       inter_threads=inter, intra_threads=intra)
    if length_penalty is None:
        length_penalty = TRANSLATION.alpha if beam > 1 else 0.0

    started = time.perf_counter()
    eos, pad, bos = (SPECIAL_PIECES[id_] for id_ in (EOS_ID, PAD_ID, BOS_ID))
    sources = [[src_pieces[i] for i in ids[:MAX_SOURCE_TOKENS]] + [eos]
               for ids in src_vocab.encode(lines)]
    # attn's own batches (sorted by length, sentences × longest ≤ batch_tokens / beam, cut
    # evenly for the workers: `balanced_batches`), each submitted on its own so that CT2's
    # inter_threads workers take them side by side. CT2 has one output limit per call, not per
    # sentence: the batch's longest a·|x| + b (sources in a batch differ by a token or two,
    # being sorted by length).
    batches = balanced_batches([len(s) for s in sources], max(1, batch_tokens // beam), inter)
    pending = [translator.translate_batch(
        [sources[i] for i in batch], asynchronous=True, beam_size=beam,
        length_penalty=length_penalty, max_input_length=0,  # truncated above, as attn does
        max_decoding_length=max(len(sources[i]) - 1 for i in batch) + TRANSLATION.max_len_b,
        suppress_sequences=[[pad], [bos]],  # attn bans these two
        use_vmap=use_vmap)
        for batch in batches]
    hypotheses: list = [None] * len(lines)
    for batch, results in zip(batches, pending):
        for i, result in zip(batch, results):
            hypotheses[i] = [tgt_ids[piece] for piece in result.result().hypotheses[0]]
    outputs = tgt_vocab.decode(hypotheses)
    seconds = time.perf_counter() - started
    return outputs, seconds, sum(len(h) + 1 for h in hypotheses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-m", "--model", required=True, help="An attn model file (.st).")
    parser.add_argument("--beam", type=int, default=TRANSLATION.beam)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--lines", type=int, default=0, help="First N test lines (0: all).")
    parser.add_argument("--layouts", default="inter,intra", help="Thread layouts to time.")
    parser.add_argument("--length-penalty", type=float, default=None,
                        help=f"Default: {TRANSLATION.alpha} with beam > 1, else 0.")
    parser.add_argument("--compare", help="Count lines identical to this file (attn's output).")
    parser.add_argument("--output", help="Write the (last layout's) translations here.")
    args = parser.parse_args()

    with gzip.open(TEST_SET, "rt", encoding="utf-8") as handle:
        lines = handle.read().splitlines()[:args.lines or None]
    report = {"model": args.model, "beam": args.beam, "threads": args.threads,
              "sentences": len(lines), "runs": {}}
    with tempfile.TemporaryDirectory() as ct2_dir:
        started = time.perf_counter()
        convert(args.model, ct2_dir)
        report["convert_s"] = time.perf_counter() - started
        for layout in args.layouts.split(","):
            outputs, seconds, tokens = translate(ct2_dir, lines, args.beam, args.threads,
                                                 layout, args.length_penalty)
            run = {"decode_s": seconds, "output_tokens": tokens,
                   "sentences_per_s": len(lines) / seconds, "tokens_per_s": tokens / seconds}
            if args.compare:
                expected = Path(args.compare).read_text(encoding="utf-8").splitlines()
                run["identical_lines"] = sum(a == b for a, b in zip(outputs, expected))
            report["runs"][layout] = run
            print(f"ctranslate2 beam {args.beam}, {layout} threads ({args.threads}): "
                  f"{run['sentences_per_s']:.1f} sentences/s, {run['tokens_per_s']:.0f} "
                  f"tokens/s, {seconds:.2f}s" + (f"; {run['identical_lines']}/{len(lines)} "
                  "lines identical" if args.compare else ""), file=sys.stderr)
    if args.output:
        Path(args.output).write_text("".join(o + "\n" for o in outputs), encoding="utf-8")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
