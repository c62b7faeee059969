"""`attn parse`: sentences in, one well-formed tree per line out (§6.3), and the training pairs
`attn parse linearize` makes from a treebank."""

from __future__ import annotations

from pathlib import Path

from .files import atomic_output
from .search import Hypothesis
from .trees import (
    PLACEHOLDER,
    ROOT,
    Tree,
    clean,
    delinearize,
    is_terminal,
    linearize,
    merge_unary_repeats,
    read_treebank,
    terminal_word,
)


def tree_line(translator, line: str, hypotheses: list[Hypothesis]) -> str:
    """The best hypothesis as a tree over the input's words, repaired if need be, with repeated
    unary brackets merged. An empty (or blank) line gets an empty line, as in `decode`."""
    words = line.split()
    if not words:
        return ""
    sequence = translator.detokenize(hypotheses[:1])[0]
    return str(merge_unary_repeats(delinearize(sequence, words)))


def model_terminals(loaded) -> str:
    """How the parser's training trees spelled their terminals: a model trained on placeholders
    has the placeholder as one piece of its vocabulary (a bracket symbol of `attn vocab
    --symbols`); one trained on words does not."""
    processor = loaded.tgt_vocab.processor
    placeholder = processor.piece_to_id("\u2581" + PLACEHOLDER)
    return "placeholders" if placeholder != processor.unk_id() else "words"


def tree_constraint_for(loaded, terminals: str, score_words: str = "given"):
    """A function making the search constraint of `attn parse --constrain` for a batch: with
    placeholder terminals, as many placeholders as words; with word terminals, exactly the
    input's pieces, in order, scored as `score_words` says (see `TreeConstraint`)."""
    from .search import TreeConstraint

    processor = loaded.tgt_vocab.processor
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    placeholder = PLACEHOLDER if terminals == "placeholders" else None
    template = TreeConstraint.for_pieces(pieces, loaded.config.eos_id, [],
                                         placeholder=placeholder, score_words=score_words)

    def make(lines: list[str]) -> TreeConstraint:
        if placeholder is not None:
            return template.for_batch([len(line.split()) for line in lines])
        spelled = [" ".join(terminal_word(word) for word in line.split()) for line in lines]
        required = loaded.tgt_vocab.encode(spelled)
        return template.for_batch([len(ids) for ids in required], required)
    return make


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
