"""`attn parse`: sentences in, one well-formed tree per line out (§6.3), and the training pairs
`attn parse linearize` makes from a treebank."""

from __future__ import annotations

from pathlib import Path

from .files import atomic_output
from .search import Hypothesis
from .trees import ROOT, Tree, clean, delinearize, linearize, read_treebank


def tree_line(translator, line: str, hypotheses: list[Hypothesis]) -> str:
    """The best hypothesis as a tree over the input's words, repaired if need be."""
    words = line.split()
    if not words:
        return str(Tree(ROOT, []))
    sequence = translator.detokenize(hypotheses[:1])[0]
    return str(delinearize(sequence, words))


def write_training_pairs(treebank_files: list[str], prefix: str) -> tuple[int, int]:
    """PREFIX.src (words) and PREFIX.tgt (linearized trees) from treebank files. Returns
    (trees written, trees left empty by the clean-up)."""
    written = skipped = 0
    src_path, tgt_path = Path(f"{prefix}.src"), Path(f"{prefix}.tgt")
    with atomic_output(src_path, "w") as src, atomic_output(tgt_path, "w") as tgt:
        for tree in read_treebank(treebank_files):
            cleaned = clean(tree)
            if cleaned is None or not cleaned.children:
                skipped += 1
                continue
            src.write(" ".join(cleaned.words()) + "\n")
            tgt.write(linearize(cleaned) + "\n")
            written += 1
    return written, skipped
