"""Where a parser loses F1, by sentence length: the search or the model.

For each sentence it scores the gold tree and the tree `attn parse` found with the score the
constrained search ranks by (`attn parse --constrain --score-words given`: brackets and EOS by
the model's log-probability, each word by the model's probability of *a* word at its place, the
sum over the GNMT length penalty). A found tree scoring below the gold tree is a *search error*:
a wider beam or another length penalty could have found something better. A found tree scoring
at least the gold's is a *model error*: the model prefers a wrong tree. With EVALB's F1 of each
bucket (`attn score --trees --by-length` gives the same figures), this says whether long
sentences fall short for want of search or for want of training.

    attn parse -m parser.st --constrain < dev.src > dev.parsed
    python -m checks.parse_errors -m parser.st --src dev.src --gold dev.gold \
        --parsed dev.parsed [--alpha 0.3] [--edges 10,20,30,40]

Report on stderr, one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from attn_cli.formats import PARSING
from attn_cli.modelfile import load_model
from attn_cli.parse.constraint import TreeConstraint
from attn_cli.parse.evalb import BracketCounts, evalb_sentence, evalb_tree, length_buckets
from attn_cli.parse.trees import clean, linearize, read_treebank, read_trees
from attn_cli.search import length_penalty


def search_scores(loaded, words: list[str], sequences: list[str], alpha: float) -> list[float]:
    """The constrained search's ranking score of each linearized tree over `words`."""
    vocab, config, model = loaded.tgt_vocab, loaded.config, loaded.model
    pieces = [vocab.processor.id_to_piece(i) for i in range(vocab.processor.get_piece_size())]
    classes = TreeConstraint.for_pieces(pieces, config.eos_id, [], placeholder=None)
    kind = classes.piece_classes
    brackets = (kind == TreeConstraint.OPEN) | (kind == TreeConstraint.CLOSE)
    word_starts = (kind == TreeConstraint.TERMINAL) & classes.piece_starts_word
    src = torch.tensor([loaded.src_vocab.encode([" ".join(words)])[0] + [config.eos_id]])
    scores = []
    for sequence in sequences:
        target = vocab.encode([sequence])[0] + [config.eos_id]
        tgt_in = torch.tensor([[config.bos_id] + target[:-1]])
        with torch.no_grad():
            log_probs = torch.log_softmax(model(src, tgt_in)[0].float(), dim=-1)
        total = 0.0
        for position, token in enumerate(target):
            if brackets[token] or token == config.eos_id:
                total += float(log_probs[position, token])
            elif word_starts[token]:  # "given": the mass of every word-starting piece
                total += float(torch.logsumexp(log_probs[position, word_starts], dim=0))
            # a word's other pieces: 0
        scores.append(total / length_penalty(len(target), alpha))
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--src", required=True, help="The sentences parsed, one per line.")
    parser.add_argument("--gold", required=True, help="Their gold trees (a treebank file).")
    parser.add_argument("--parsed", required=True, help="attn parse's trees, one per line.")
    parser.add_argument("--alpha", type=float, default=PARSING.alpha)
    parser.add_argument("--edges", default="10,20,30,40")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    loaded.model.eval()
    sentences = Path(args.src).read_text(encoding="utf-8").splitlines()
    gold = list(read_treebank([args.gold]))
    parsed = Path(args.parsed).read_text(encoding="utf-8").splitlines()
    if not len(sentences) == len(gold) == len(parsed):
        raise SystemExit("--src, --gold and --parsed must hold as many sentences")
    buckets = length_buckets(tuple(int(edge) for edge in args.edges.split(",")))
    rows = {label: {"sentences": 0, "search_errors": 0, "model_errors": 0, "exact": 0,
                    "counts": BracketCounts()} for label, _, _ in buckets}
    for words, gold_tree, line in zip(sentences, gold, parsed):
        words = words.split()
        found = next(read_trees(line))
        gold_view = evalb_tree(gold_tree)
        label = next(label for label, low, high in buckets if low <= gold_view.length <= high)
        row = rows[label]
        row["sentences"] += 1
        row["counts"].add(evalb_sentence(gold_view, found))
        gold_sequence = linearize(clean(gold_tree), "words")
        found_sequence = linearize(clean(found), "words")
        if gold_sequence == found_sequence:
            row["exact"] += 1
            continue
        gold_score, found_score = search_scores(loaded, words, [gold_sequence, found_sequence],
                                                args.alpha)
        row["search_errors" if found_score < gold_score else "model_errors"] += 1
    report = {}
    print(f"{'bucket':>10} {'sents':>5} {'F1':>6} {'exact':>5} {'search err':>10} "
          f"{'model err':>9}", file=sys.stderr)
    for label, row in rows.items():
        counts = row.pop("counts")
        report[label] = {**row, "f1": round(counts.f1, 2)}
        print(f"{label:>10} {row['sentences']:>5} {counts.f1:>6.2f} {row['exact']:>5} "
              f"{row['search_errors']:>10} {row['model_errors']:>9}", file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
