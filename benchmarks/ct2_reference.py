"""CTranslate2 as a decoding-speed reference: the same attn model, converted weight for weight.

`convert` writes a CTranslate2 model directory from an attn model file (post- or pre-norm,
sinusoidal or learned positions, shared or separate embeddings); `translate` decodes lines with
it as `attn decode` would (same SentencePiece model, same source EOS, same token-budget batches,
pad and BOS banned, output limit |x| + 50) and returns the outputs, the seconds and the output
tokens (EOS included). Run on its own, it times both thread layouts on the Multi30k test set:

    python benchmarks/ct2_reference.py -m model.st [--beam 4] [--threads 2] [--lines 1000]

Report on stderr, one JSON object on stdout. Differences from attn's search that remain: CTranslate2
normalises a finished hypothesis by |Y|^lp (|Y| without the EOS), not GNMT's ((5 + |Y|) / 6)^α,
and its beam search stops once the best beam ends (ours: once no live beam can win); a sentence
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

from ctranslate2.converters.converter import Converter
from ctranslate2.specs import transformer_spec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attn_cli.formats import (  # noqa: E402
    BATCH_TOKENS,
    BOS_ID,
    EOS_ID,
    MAX_SOURCE_TOKENS,
    PAD_ID,
    SHARED_EMBEDDING,
    SOURCE_EMBEDDING,
    SPECIAL_PIECES,
    TRANSLATION,
)
from attn_cli.modelfile import load_model  # noqa: E402
from attn_cli.translate import token_budget_batches  # noqa: E402
from attn_cli.vocab import Vocabulary  # noqa: E402

TEST_SET = Path(__file__).resolve().parent.parent / "examples/multi30k/data/test_2016_flickr.en.gz"


class AttnConverter(Converter):
    """Fills a `TransformerSpec` from an attn model; `Converter.convert` validates and saves."""

    def __init__(self, model_path: str):
        self.model_path = model_path

    def _load(self):
        loaded = self.loaded = load_model(self.model_path)
        config, model = loaded.config, loaded.model
        if config.d_k != config.d_v or config.heads * config.d_k != config.d_model:
            # TransformerSpec.from_config derives head_dim = d_model / heads.
            raise NotImplementedError("CTranslate2 needs d_k = d_v = d_model / heads")
        w = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
        pre = config.norm == "pre"
        spec = transformer_spec.TransformerSpec.from_config(
            (config.encoder_layers, config.decoder_layers), config.heads, pre_norm=pre)
        spec.config.layer_norm_epsilon = config.layer_norm_eps
        spec.config.add_source_eos = False  # translate() appends EOS itself, as attn does
        # Our interleaved sin/cos table (CTranslate2's default concatenates them), or the
        # learned one; long enough for the longest source and output attn allows.
        length = config.max_positions if config.positions == "learned" else \
            MAX_SOURCE_TOKENS + 1 + TRANSLATION.max_len_b
        positions = model.positions(0, length).detach().numpy()

        def linear(layer_spec, name, bias=False):
            layer_spec.weight = w[f"{name}.weight"]  # torch's (out, in) layout, as CT2's
            if bias:
                layer_spec.bias = w[f"{name}.bias"]  # attention projections have none

        def norm(layer_spec, name):
            layer_spec.gamma, layer_spec.beta = w[f"{name}.weight"], w[f"{name}.bias"]

        def ffn(ffn_spec, prefix, index):
            norm(ffn_spec.layer_norm, f"{prefix}.sub.norms.{index}")
            linear(ffn_spec.linear_0, f"{prefix}.ffn.inner", bias=True)
            linear(ffn_spec.linear_1, f"{prefix}.ffn.outer", bias=True)

        def self_attention(attention, prefix):  # linear[0]: fused q, k, v; linear[1]: out
            norm(attention.layer_norm, f"{prefix}.sub.norms.0")
            linear(attention.linear[0], f"{prefix}.self_attn.qkv_proj")
            linear(attention.linear[1], f"{prefix}.self_attn.out_proj")

        # With pre_norm the spec's sub-layer norms come before each sub-layer and a final norm
        # ends each stack; without, they follow each residual add: both are ours.
        spec.encoder.embeddings[0].weight = w[SOURCE_EMBEDDING]
        spec.encoder.position_encodings.encodings = positions
        for i, layer in enumerate(spec.encoder.layer):
            self_attention(layer.self_attention, f"encoder_layers.{i}")
            ffn(layer.ffn, f"encoder_layers.{i}", 1)
        spec.decoder.embeddings.weight = w[SHARED_EMBEDDING]
        spec.decoder.position_encodings.encodings = positions
        spec.decoder.projection.weight = w[SHARED_EMBEDDING]  # tied, no bias
        for i, layer in enumerate(spec.decoder.layer):
            prefix = f"decoder_layers.{i}"
            self_attention(layer.self_attention, prefix)
            cross = layer.attention  # linear[0]: q; linear[1]: fused k, v; linear[2]: out
            norm(cross.layer_norm, f"{prefix}.sub.norms.1")
            linear(cross.linear[0], f"{prefix}.cross_attn.q_proj")
            linear(cross.linear[1], f"{prefix}.cross_attn.kv_proj")
            linear(cross.linear[2], f"{prefix}.cross_attn.out_proj")
            ffn(layer.ffn, prefix, 2)
        if pre:
            norm(spec.encoder.layer_norm, "encoder_norm")
            norm(spec.decoder.layer_norm, "decoder_norm")
        # Pieces in id order: attn's <pad> <unk> <s> </s> (ids 0-3) are CT2's default specials.
        for vocab, register in ((loaded.src_vocab, spec.register_source_vocabulary),
                                (loaded.tgt_vocab, spec.register_target_vocabulary)):
            register([vocab.processor.id_to_piece(i) for i in range(len(vocab))])
        return spec


def convert(model_path: str, output_dir: str) -> str:
    """Write the CTranslate2 model (float32 weights) of `model_path` to `output_dir`, with the
    SentencePiece models beside it (source.spm, target.spm) for `translate`."""
    converter = AttnConverter(model_path)
    converter.convert(output_dir, quantization="float32", force=True)
    for name, vocab in (("source", converter.loaded.src_vocab),
                        ("target", converter.loaded.tgt_vocab)):
        Path(output_dir, f"{name}.spm").write_bytes(vocab.model_bytes)
    return output_dir


def translate(ct2_dir: str, lines: list[str], beam: int, threads: int, layout: str = "inter",
              length_penalty: float | None = None, batch_tokens: int = BATCH_TOKENS
              ) -> tuple[list[str], float, int]:
    """Decode `lines` (non-empty) → (outputs, seconds, output tokens with one EOS each).

    layout "inter": `threads` batches at once, one thread each (as attn's CPU default, one
    search worker per thread), the faster; "intra": one batch at a time on `threads` threads
    (6-10x slower on a busy 2-core VM, its OpenMP threads waiting on each other). Seconds run
    from tokenizing to detokenizing, model load excluded (as attn decode's summary line)."""
    import ctranslate2

    src_vocab, tgt_vocab = (Vocabulary.from_file(Path(ct2_dir, f"{name}.spm"))
                            for name in ("source", "target"))
    src_pieces = [src_vocab.processor.id_to_piece(i) for i in range(len(src_vocab))]
    tgt_ids = {tgt_vocab.processor.id_to_piece(i): i for i in range(len(tgt_vocab))}
    inter, intra = (threads, 1) if layout == "inter" else (1, threads)
    translator = ctranslate2.Translator(ct2_dir, device="cpu", compute_type="float32",
                                       inter_threads=inter, intra_threads=intra)
    if length_penalty is None:
        length_penalty = TRANSLATION.alpha if beam > 1 else 0.0

    started = time.perf_counter()
    eos, pad, bos = (SPECIAL_PIECES[id_] for id_ in (EOS_ID, PAD_ID, BOS_ID))
    sources = [[src_pieces[i] for i in ids[:MAX_SOURCE_TOKENS]] + [eos]
               for ids in src_vocab.encode(lines)]
    # attn's own batches (sorted by length, sentences × longest ≤ batch_tokens / beam), each
    # submitted on its own so that CT2's inter_threads workers take them side by side. CT2 has
    # one output limit per call, not per sentence: the batch's longest a·|x| + b (sources in a
    # batch differ by a token or two, being sorted by length).
    batches = token_budget_batches([len(s) for s in sources], max(1, batch_tokens // beam))
    pending = [translator.translate_batch(
        [sources[i] for i in batch], asynchronous=True, beam_size=beam,
        length_penalty=length_penalty, max_input_length=0,  # truncated above, as attn does
        max_decoding_length=max(len(sources[i]) - 1 for i in batch) + TRANSLATION.max_len_b,
        suppress_sequences=[[pad], [bos]])  # attn bans these two
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
