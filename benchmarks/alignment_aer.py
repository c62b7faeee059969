"""Alignment error rate (AER) of `attn decode --alignment`, decoder layer by layer and head by
head, against eflomal's alignments of Multi30k test2016 (issue 42: which layer, and whether to
average the heads, `alignment.default_layer` should read).

The reference is eflomal's (pip install eflomal: Östling and Tiedemann 2016's Bayesian
IBM1+HMM+fertility aligner; it builds a small C program), not people's: "silver" alignments.
eflomal aligns the training lines and test2016 together (more text, better alignments), each
direction, over the whitespace words of the raw lines (lowercased by eflomal; each word's
punctuation stripped for it, the words kept one for one), symmetrized here by
grow-diag-final-and (Koehn et al. 2005); only test2016's lines are kept. With no sure/possible
distinction, S = P = the reference, and AER = 1 - 2|A∩S|/(|A|+|S|) = 1 - F1, over the corpus.

The model's alignments are those `attn decode --alignment` prints (attn_cli/alignment.py: each
target piece with the source piece it attends to most, the source's </s> left out, pieces mapped
to whitespace words), but of the REFERENCE translation, teacher-forced (the pair eflomal
aligned), for every decoder layer with its heads averaged (what `--alignment-layer` chooses)
and with each head alone. The row `attn decode --alignment` is the shipped code path itself
(`alignment.align_lines` at its default layer and heads), checked equal to its row of the grid. Also
reported, as "shift": the same maps read one decoder step later, the query whose input is the
target piece rather than the one that predicts it (Chen et al. 2020's SHIFT-ATT), which attn
does not do. Baselines: the diagonal (target word j with source word round((j + 0.5)·n/m - 0.5))
and eflomal's own one-direction alignments and their intersection.

    python -m benchmarks.alignment_aer -m model.st --eflomal /path/to/venv-with-eflomal
    python -m benchmarks.alignment_aer -m model.st --eflomal venv --save-reference ref.gdfa
    python -m benchmarks.alignment_aer -m model.st --reference ref.gdfa --lines 500

`--eflomal`: a Python interpreter (or a virtual environment's folder) that has eflomal; without it
or `--reference`, this interpreter's own eflomal. `--reference FILE`: Pharaoh lines (`i-j`, source
word i, target word j) of test2016, as `--save-reference` writes them (FILE.fwd, FILE.rev beside
it, if there, give the one-direction baselines). eflomal samples: each run's reference differs a
little. A pair whose words attn counts otherwise than the whitespace (SentencePiece's
normalisation) is left out, and counted.

A markdown table on stdout, progress and the CPU on stderr.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks._harness import SHARED, log
from benchmarks.machine import cpu_info

if TYPE_CHECKING:
    from torch import Tensor

TEST = "test_2016_flickr"
TRAIN = "train"

Links = set[tuple[int, int]]  # (source word, target word) pairs of one line

EFLOMAL_RUN = """
import sys
import eflomal
source, target, forward, reverse = sys.argv[1:]
with open(source, encoding="utf-8") as src, open(target, encoding="utf-8") as tgt:
    eflomal.Aligner().align(src, tgt, links_filename_fwd=forward, links_filename_rev=reverse)
"""


# -- data and reference ---------------------------------------------------------------------------

def read_lines(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle]


def aligner_word(word: str) -> str:
    """A whitespace word as the aligner sees it: lowercased, its punctuation stripped ("dog."
    and "dog" one word), itself where it is all punctuation (the words stay one for one)."""
    lowered = word.lower()
    return "".join(c for c in lowered if not unicodedata.category(c).startswith("P")) or lowered


def aligner_line(line: str) -> str:
    return " ".join(aligner_word(word) for word in line.split())


def parse_pharaoh(line: str) -> Links:
    return {(int(i), int(j)) for i, j in (pair.split("-") for pair in line.split())}


def pharaoh(links: Links) -> str:
    return " ".join(f"{i}-{j}" for i, j in sorted(links))


def python_of(path: str) -> str:
    """--eflomal's interpreter: a Python executable, or a virtual environment's folder."""
    candidate = Path(path)
    return str(candidate / "bin" / "python") if candidate.is_dir() else str(candidate)


def run_eflomal(python: str, sources: list[str], targets: list[str],
                scratch: Path) -> tuple[list[Links], list[Links]]:
    """eflomal's forward and reverse alignments (both source-target pairs) of the lines."""
    try:
        subprocess.run([python, "-c", "import eflomal"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as error:
        raise SystemExit(f"{python} has no eflomal ({error}): python3 -m venv VENV && "
                         "VENV/bin/pip install eflomal, then --eflomal VENV; or --reference "
                         "FILE") from None
    src, tgt = scratch / "aligner.src", scratch / "aligner.tgt"
    src.write_text("".join(aligner_line(line) + "\n" for line in sources), encoding="utf-8")
    tgt.write_text("".join(aligner_line(line) + "\n" for line in targets), encoding="utf-8")
    forward, reverse = scratch / "links.fwd", scratch / "links.rev"
    subprocess.run([python, "-c", EFLOMAL_RUN, str(src), str(tgt), str(forward), str(reverse)],
                   check=True)
    return ([parse_pharaoh(line) for line in read_lines(forward)],
            [parse_pharaoh(line) for line in read_lines(reverse)])


NEIGHBOURS = [(-1, 0), (0, -1), (1, 0), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1)]


def grow_diag_final_and(forward: Links, reverse: Links) -> Links:
    """Koehn et al.'s symmetrization (Moses, fast_align's atools -c grow-diag-final-and): the
    intersection, grown into the union's neighbouring links (diagonals included) that bring an
    unaligned word, then the union's links whose two words are both still unaligned."""
    union = forward | reverse
    links = forward & reverse
    source = {i for i, _ in links}
    target = {j for _, j in links}
    grown = True
    while grown:
        grown = False
        for i, j in sorted(links):
            for di, dj in NEIGHBOURS:
                link = (i + di, j + dj)
                if link in union and link not in links and (
                        link[0] not in source or link[1] not in target):
                    links.add(link)
                    source.add(link[0])
                    target.add(link[1])
                    grown = True
    for direction in (forward, reverse):
        for i, j in sorted(direction):
            if i not in source and j not in target:
                links.add((i, j))
                source.add(i)
                target.add(j)
    return links


def diagonal(source_words: int, target_words: int) -> Links:
    """Each target word with the source word at the same relative position."""
    return {(min(source_words - 1, round((j + 0.5) * source_words / target_words - 0.5)), j)
            for j in range(target_words)}


# -- scores ---------------------------------------------------------------------------------------

def score(found: list[Links], reference: list[Links]) -> dict[str, float]:
    """Corpus precision, recall, F1 and AER (S = P = the reference: AER = 1 - F1)."""
    hits = sum(len(a & s) for a, s in zip(found, reference, strict=True))
    proposed = sum(len(a) for a in found)
    gold = sum(len(s) for s in reference)
    precision, recall = hits / max(proposed, 1), hits / max(gold, 1)
    return {"precision": precision, "recall": recall,
            "f1": 2 * hits / max(proposed + gold, 1),
            "aer": 1 - 2 * hits / max(proposed + gold, 1), "links": proposed}


# -- the model's alignments -----------------------------------------------------------------------

def prepare(translator, lines: list[str], references: list[str]):
    """attn's view of each pair (what `alignment.align_lines` computes): source ids and the word
    of each source piece, the reference's target ids and the word of each target piece; and the
    indices of the pairs whose words attn counts as the whitespace does (the others can't be
    compared with the reference)."""
    from attn_cli.alignment import clamped, piece_words, word_spans
    from attn_cli.decode.alignment import source_pieces

    src_vocab, tgt_vocab = translator.src_vocab, translator.tgt_vocab
    sources, targets = src_vocab.encode(lines), tgt_vocab.encode(references)
    texts = tgt_vocab.decode(targets)
    source_words, target_words, kept = [], [], []
    for i, line in enumerate(lines):
        pieces = source_pieces(src_vocab, line)
        if len(pieces) != len(sources[i]):
            pieces = [src_vocab.piece(token) for token in sources[i]]
        sources[i] = sources[i][:translator.max_source]
        from_pieces = piece_words(pieces[:translator.max_source])
        to_pieces = piece_words([tgt_vocab.piece(token) for token in targets[i]])
        words = len(line.split()), len(references[i].split())
        if (sources[i] and targets[i] and max(from_pieces) + 1 == words[0]
                and max(to_pieces) + 1 == words[1] == len(word_spans(texts[i]))):
            kept.append(i)
        source_words.append(clamped(from_pieces, len(word_spans(line))))
        target_words.append(clamped(to_pieces, len(word_spans(texts[i]))))
    return sources, targets, source_words, target_words, kept


def attention_maps(model, batch, layers: int, choices) -> dict[tuple[int, str], Tensor]:
    """{(layer, heads): (B, T + 1, S) map} of one batch, from ONE teacher-forced pass: what
    `alignment.alignment_attention` computes for each layer and heads (checked equal to it on
    the first batch), without its pass per choice."""
    import math

    from attn_cli.model import AttentionWeights

    memory, src_mask = model.encode(batch.src_tokens)
    weights = AttentionWeights(decoder=None)
    model.decode(batch.tgt_input, memory, src_mask, weights)
    config = model.config
    not_a_piece = (batch.src_tokens == config.eos_id) | (batch.src_tokens == config.pad_id)
    maps = {}
    for layer in range(layers):
        for name, heads in choices:
            chosen = weights.cross[layer]
            if heads is not None:
                chosen = chosen[:, list(heads)]
            maps[layer, name] = chosen.float().mean(dim=1).masked_fill_(not_a_piece[:, None, :],
                                                                        -math.inf)
    return maps


def attention_grid(translator, sources, targets, source_words, target_words,
                   sentences_per_pass: int = 32) -> dict[tuple[str, int, str], list[Links]]:
    """{(reading, layer, heads): each pair's links} for every decoder layer, its heads averaged
    ("avg") and each head alone ("h0", ...), read as attn does ("attn": the query predicting
    target piece t) and one step later ("shift": the query whose input is piece t), over the
    batches `alignment.align` makes."""
    import torch

    from attn_cli.alignment import word_pairs
    from attn_cli.batching import collate_pairs
    from attn_cli.decode.alignment import alignment_attention

    model, config = translator.model, translator.config
    layers, heads = config.decoder_layers, config.heads
    choices = [("avg", None)] + [(f"h{h}", [h]) for h in range(heads)]
    grid: dict[tuple[str, int, str], list[Links]] = {
        (reading, layer, name): [] for reading in ("attn", "shift") for layer in range(layers)
        for name, _ in choices}
    device = next(model.parameters()).device
    for start in range(0, len(sources), sentences_per_pass):
        pairs = list(zip(sources[start:start + sentences_per_pass],
                         targets[start:start + sentences_per_pass]))
        batch = collate_pairs(pairs, config.bos_id, config.eos_id, config.pad_id).to(device)
        with torch.inference_mode():
            maps = attention_maps(model, batch, layers, choices)
            nearest = {key: attention.argmax(dim=-1).tolist()  # (B, T + 1) each
                       for key, attention in maps.items()}
            if start == 0:  # the one pass reads what alignment_attention reads
                for (layer, name), chosen in choices_of(layers, choices):
                    again = alignment_attention(model, batch.src_tokens, batch.tgt_input,
                                                layer, chosen or list(range(heads)))
                    if again.argmax(dim=-1).tolist() != nearest[layer, name]:
                        raise SystemExit(f"layer {layer} {name}: not alignment_attention's")
        for (layer, name), rows in nearest.items():
            for offset, row in enumerate(rows):
                words = source_words[start + offset], target_words[start + offset]
                grid["attn", layer, name].append(set(word_pairs(row, *words)))
                grid["shift", layer, name].append(set(word_pairs(row[1:], *words)))
        done = min(start + sentences_per_pass, len(sources))
        if done % (8 * sentences_per_pass) == 0 or done == len(sources):
            log(f"  aligned {done}/{len(sources)} pairs")
    return grid


def default_choice(config) -> tuple[int, list[int] | None]:
    """The layer (from 0) and heads (None: all) `attn decode --alignment` reads by default
    (`alignment.chosen_heads`: a guided-alignment model's supervised head, else
    `alignment.default_layer`'s heads averaged)."""
    from attn_cli.decode import alignment

    layer, heads = alignment.chosen_heads(config)
    return layer, None if heads is None else list(heads)


def choices_of(layers: int, choices):
    return [((layer, name), heads) for layer in range(layers) for name, heads in choices]


# -- report ---------------------------------------------------------------------------------------

def row(name: str, scores: dict[str, float], best: bool = False) -> str:
    mark = "**" if best else ""
    return (f"| {name} | {scores['precision']:.3f} | {scores['recall']:.3f} | "
            f"{scores['f1']:.3f} | {mark}{scores['aer']:.3f}{mark} | {scores['links']} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", required=True, help="an attn model file (.st)")
    parser.add_argument("--data", type=Path, default=SHARED / "data" / "multi30k",
                        help="Multi30k's raw files (train.en, test_2016_flickr.de, ...) "
                             "[default: %(default)s]")
    parser.add_argument("--src", default="en", help="source language [default: en]")
    parser.add_argument("--tgt", default="de", help="target language [default: de]")
    parser.add_argument("--lines", type=int, default=0,
                        help="score the first N lines of test2016 (0: all) [default: 0]")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--eflomal", help="a Python (or a venv folder) that has eflomal "
                                          "[default: this interpreter]")
    source.add_argument("--reference", type=Path,
                        help="test2016's reference alignments (Pharaoh lines), not eflomal")
    parser.add_argument("--save-reference", type=Path,
                        help="write eflomal's test2016 alignments here (and .fwd, .rev)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: all)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    name, isa = cpu_info()
    log(f"CPU: {name} ({isa})")
    if not (args.data / f"{TEST}.{args.src}").exists():
        raise SystemExit(f"no {TEST}.{args.src} in {args.data}: Multi30k's raw files, --data DIR "
                         "(or $ATTN_SHARED/data/multi30k)")
    lines = read_lines(args.data / f"{TEST}.{args.src}")
    references = read_lines(args.data / f"{TEST}.{args.tgt}")
    count = min(args.lines or len(lines), len(lines))

    forward = reverse = None
    if args.reference:
        gold = [parse_pharaoh(line) for line in read_lines(args.reference)]
        sides = [Path(f"{args.reference}.{side}") for side in ("fwd", "rev")]
        if all(side.exists() for side in sides):
            forward, reverse = ([parse_pharaoh(line) for line in read_lines(side)]
                                for side in sides)
        log(f"reference: {args.reference} ({len(gold)} lines)")
    else:
        python = python_of(args.eflomal) if args.eflomal else sys.executable
        train_src = read_lines(args.data / f"{TRAIN}.{args.src}")
        train_tgt = read_lines(args.data / f"{TRAIN}.{args.tgt}")
        log(f"eflomal ({python}): {len(train_src)} training + {len(lines)} test2016 pairs, "
            "both directions")
        clock = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="alignment_aer.") as scratch:
            forward, reverse = run_eflomal(python, train_src + lines, train_tgt + references,
                                           Path(scratch))
        forward, reverse = forward[len(train_src):], reverse[len(train_src):]
        gold = [grow_diag_final_and(f, r) for f, r in zip(forward, reverse)]
        log(f"eflomal: {time.perf_counter() - clock:.1f}s")
        if args.save_reference:
            for path, links in ((args.save_reference, gold),
                                (Path(f"{args.save_reference}.fwd"), forward),
                                (Path(f"{args.save_reference}.rev"), reverse)):
                path.write_text("".join(pharaoh(line) + "\n" for line in links))
            log(f"reference written to {args.save_reference} (and .fwd, .rev)")
    if len(gold) < count:
        raise SystemExit(f"the reference has {len(gold)} lines, {count} to score")

    from attn_cli.decode import alignment
    from attn_cli.decode.translator import load_translator

    clock = time.perf_counter()
    translator = load_translator(args.model, device="cpu", threads=args.threads)
    config = translator.config
    log(f"model {args.model}: {config.decoder_layers} decoder layers, {config.heads} heads "
        f"({time.perf_counter() - clock:.1f}s to load)")
    lines, references = lines[:count], references[:count]
    sources, targets, source_words, target_words, kept = prepare(translator, lines, references)
    left_out = count - len(kept)
    log(f"{count} pairs, {left_out} left out (attn counts their words otherwise)")

    clock = time.perf_counter()
    grid = attention_grid(translator, sources, targets, source_words, target_words)
    # The shipped path, at its defaults, must be the grid's row of the default layer and heads.
    shipped = [set(links) for links in alignment.align_lines(
        translator.model, translator.src_vocab, translator.tgt_vocab, lines, targets,
        translator.max_source)]
    default, default_heads = default_choice(translator.model.config)
    default_name = "avg" if default_heads is None else f"h{default_heads[0]}"
    if shipped != grid["attn", default, default_name]:
        differ = sum(a != b for a, b in zip(shipped, grid["attn", default, default_name]))
        raise SystemExit(f"align_lines and the grid differ on {differ} pairs")
    log(f"attention: {time.perf_counter() - clock:.1f}s (align_lines checked equal to the "
        f"grid at layer {default}, {default_name})")

    def kept_of(links: list[Links]) -> list[Links]:
        return [links[i] for i in kept]

    reference = kept_of(gold[:count])
    scores = {key: score(kept_of(found), reference) for key, found in grid.items()}
    best = min(scores, key=lambda key: scores[key]["aer"])
    best_attn = min((key for key in scores if key[0] == "attn"),
                    key=lambda key: scores[key]["aer"])

    out = [f"AER against eflomal (grow-diag-final-and) on {TEST} {args.src}-{args.tgt}, "
           f"{len(kept)} of {count} pairs ({left_out} left out), reference translations "
           f"teacher-forced; model `{args.model}` ({config.decoder_layers} decoder layers × "
           f"{config.heads} heads); {name} ({isa}).", "",
           "| alignment | precision | recall | F1 | AER | links |",
           "|---|---:|---:|---:|---:|---:|"]
    reads = "heads averaged" if default_name == "avg" else f"head {default_name[1:]}"
    out.append(row(f"`attn decode --alignment` (its default: layer {default}, {reads})",
                   score(kept_of(shipped), reference)))
    for reading in ("attn", "shift"):
        for layer in range(config.decoder_layers):
            for heads in ["avg"] + [f"h{h}" for h in range(config.heads)]:
                key = (reading, layer, heads)
                label = "heads averaged" if heads == "avg" else f"head {heads[1:]}"
                name_ = f"{reading}: layer {layer} (= {layer - config.decoder_layers}), {label}"
                out.append(row(name_, scores[key], key in (best, best_attn)))
    count_words = [(len(lines[i].split()), len(references[i].split())) for i in kept]
    out.append(row("baseline: diagonal", score([diagonal(n, m) for n, m in count_words],
                                               reference)))
    if forward is not None:
        out.append(row("baseline: eflomal forward only", score(kept_of(forward[:count]),
                                                                reference)))
        out.append(row("baseline: eflomal reverse only", score(kept_of(reverse[:count]),
                                                                reference)))
        out.append(row("baseline: eflomal intersection",
                       score([f & r for f, r in zip(kept_of(forward[:count]),
                                                    kept_of(reverse[:count]))], reference)))
    out += ["", f"Lowest AER as attn reads: {best_attn[0]} layer {best_attn[1]} "
                f"{best_attn[2]} ({scores[best_attn]['aer']:.3f}); overall: {best[0]} layer "
                f"{best[1]} {best[2]} ({scores[best]['aer']:.3f}). "
                f"{time.perf_counter() - started:.0f}s in all."]
    print("\n".join(out))


if __name__ == "__main__":
    main()
