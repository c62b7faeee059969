"""`attn parse`: sentences in, one well-formed tree per line out (§6.3), and the training pairs
`attn parse linearize` makes from a treebank. No torch here (the constrained search is in
constraint.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..files import atomic_output
from .trees import (
    ROOT,
    Tree,
    clean,
    delinearize,
    is_terminal,
    linearize,
    merge_unary_repeats,
    read_treebank,
)

if TYPE_CHECKING:  # torch stays out of `attn parse linearize`
    from ..search import Hypothesis


def tree_line(translator, line: str, hypotheses: list[Hypothesis]) -> str:
    """The best hypothesis as a tree over the input's words, repaired if need be, with repeated
    unary brackets merged. An empty (or blank) line gets an empty line, as in `decode`."""
    words = line.split()
    if not words:
        return ""
    sequence = translator.detokenize(hypotheses[:1])[0]
    return str(merge_unary_repeats(delinearize(sequence, words)))


def write_training_pairs(treebank_files: list[str], prefix: str,
                         terminals: str = "placeholders",
                         subtrees: bool = False) -> tuple[int, int, int]:
    """PREFIX.src (words), PREFIX.tgt (linearized trees) and PREFIX.symbols (the bracket tokens,
    and the placeholder if there is one, for `attn vocab --symbols`) from treebank files.
    `subtrees`: after each tree, every constituent of two words or more below its top one, as a
    pair of its own (once per distinct pair). Returns (trees written, trees left empty by the
    clean-up, constituent pairs written)."""
    written = skipped = extra = 0
    symbols: set[str] = set()
    seen: set[tuple[str, str]] = set()
    src_path, tgt_path = Path(f"{prefix}.src"), Path(f"{prefix}.tgt")
    with atomic_output(src_path, "w") as src, atomic_output(tgt_path, "w") as tgt:
        for tree in read_treebank(treebank_files):
            cleaned = clean(tree)
            if cleaned is None or not cleaned.children:
                skipped += 1
                continue
            sequence = linearize(cleaned, terminals)
            symbols.update(token for token in sequence.split()
                           if terminals == "placeholders" or not is_terminal(token))
            src.write(" ".join(cleaned.words()) + "\n")
            tgt.write(sequence + "\n")
            written += 1
            for constituent in _constituents(cleaned) if subtrees else ():
                words = constituent.words()
                pair = (" ".join(words), linearize(constituent, terminals))
                if len(words) > 1 and pair not in seen:
                    seen.add(pair)
                    src.write(pair[0] + "\n")
                    tgt.write(pair[1] + "\n")
                    extra += 1
    with atomic_output(f"{prefix}.symbols", "w") as listing:
        listing.writelines(f"{symbol}\n" for symbol in sorted(symbols))
    return written, skipped, extra


def _constituents(tree: Tree):
    """Every phrase below the top one of a cleaned tree (TOP → S → these), depth first."""
    tops = tree.children if tree.label == ROOT else [tree]
    for top in tops:
        stack = [child for child in reversed(top.children) if isinstance(child, Tree)]
        while stack:
            node = stack.pop()
            if not node.is_preterminal:
                yield node
                stack.extend(child for child in reversed(node.children)
                             if isinstance(child, Tree))
