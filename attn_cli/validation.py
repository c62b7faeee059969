"""Validation by the metric a run is judged on, and the best checkpoints by it.

At each save `attn train --valid-metric bleu|chrf|f1` decodes the validation sources with the
model being trained (greedy unless `--valid-beam`), and scores the output against the
references: sacreBLEU's corpus BLEU or chrF for translation, EVALB's F1 (COLLINS.prm, as
`attn score --trees`) for parsing. `loss` needs no decoding (the label-smoothed validation loss,
which training computes anyway). The references are the validation file's own target side,
detokenized, unless a file is given (`--valid-ref`: raw reference text, or gold trees).

`best_checkpoints` reads the scores back from metrics.jsonl: for `--keep-best` and
`attn average --best`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .data import ParallelData
from .files import AttnError, display_name
from .formats import METRICS_FILE, PARSING, TRANSLATION, VALID_METRICS


def metric_key(metric: str) -> str:
    """The metrics.jsonl field holding the metric's validation score."""
    return f"valid_{metric}"


@dataclass
class Validator:
    """The validation set made ready to decode and score: one per run."""

    metric: str
    beam: int
    sources: list[list[int]]  # token ids, EOS included
    words: list[list[str]]  # the source sentences' words (for trees)
    references: list  # reference texts, or gold trees (EvalbTree) for f1
    tgt_vocab: object
    batch_tokens: int

    @classmethod
    def build(cls, metric: str, data: ParallelData, reference_path: str | None = None,
              beam: int = 1, batch_tokens: int = 8000) -> "Validator":
        from .formats import EOS_ID

        if metric not in VALID_METRICS or metric == "loss":
            raise AttnError(f"no validation decoding for the metric {metric!r}")
        tgt_vocab = data.tgt_vocab or data.src_vocab
        src_ids = [data.pair(i)[0].tolist() for i in range(len(data))]
        sources = [ids + [EOS_ID] for ids in src_ids]
        words = [text.split() for text in data.src_vocab.decode(src_ids)]
        if reference_path is None:
            texts = tgt_vocab.decode([data.pair(i)[1].tolist() for i in range(len(data))])
        else:
            texts = None
        references = (_gold_trees(texts, words, reference_path, len(data)) if metric == "f1"
                      else texts if texts is not None
                      else _reference_lines(reference_path, len(data)))
        return cls(metric, beam, sources, words, references, tgt_vocab, batch_tokens)

    def hypotheses(self, model: torch.nn.Module) -> list[str]:
        """The model's output for every validation source, detokenized, in order."""
        from .search import beam_search
        from .translate import pad_sequences, token_budget_batches

        settings = PARSING if self.metric == "f1" else TRANSLATION
        constraint_for = self._tree_constraint(model) if self.metric == "f1" else None
        device = next(model.parameters()).device
        learned = model.config.positions == "learned"
        output: list[list[int]] = [[] for _ in self.sources]
        was_training = model.training
        model.eval()
        try:
            lengths = [len(ids) for ids in self.sources]
            for batch in token_budget_batches(lengths, max(1, self.batch_tokens // self.beam)):
                src = pad_sequences([self.sources[i] for i in batch],
                                    model.config.pad_id).to(device)
                constraint = constraint_for([" ".join(self.words[i]) for i in batch]) \
                    if constraint_for else None
                found = beam_search(model, src, beam=self.beam, alpha=settings.alpha,
                                    max_len_a=settings.max_len_a, max_len_b=settings.max_len_b,
                                    longest=model.config.max_positions - 1 if learned else None,
                                    constraint=constraint)
                for index, hypotheses in zip(batch, found):
                    output[index] = hypotheses[0].tokens
        finally:
            model.train(was_training)
        return self.tgt_vocab.decode(output)

    def _tree_constraint(self, model: torch.nn.Module):
        """Parsers are validated as the recipes parse, `attn parse --constrain`: well-formed
        trees over exactly the sentence's words. It also bounds each output by its words, where
        a half-trained parser's free search runs on to the length limit (|x| + 300)."""
        from .tree_search import model_terminals, tree_constraint_for

        return tree_constraint_for(self.tgt_vocab, model.config.eos_id,
                                   model_terminals(self.tgt_vocab))

    def score(self, model: torch.nn.Module) -> float:
        return self.score_texts(self.hypotheses(model))

    def score_texts(self, texts: list[str]) -> float:
        if self.metric == "f1":
            return trees_f1(texts, self.words, self.references)
        import sacrebleu

        scorer = sacrebleu.corpus_bleu if self.metric == "bleu" else sacrebleu.corpus_chrf
        return float(scorer(texts, [self.references]).score)


def trees_f1(sequences: list[str], words: list[list[str]], gold: list) -> float:
    """EVALB's labelled-bracket F1 over linearized trees (repaired into trees over the words,
    as `attn parse` does) against gold trees."""
    from .trees import BracketCounts, delinearize, evalb_sentence, merge_unary_repeats

    total = BracketCounts()
    for sequence, sentence, gold_tree in zip(sequences, words, gold):
        total.add(evalb_sentence(gold_tree, merge_unary_repeats(delinearize(sequence, sentence))))
    return total.f1


def _reference_lines(path: str, expected: int) -> list[str]:
    from .scoring import read_raw_lines

    lines = [raw.decode("utf-8", errors="strict").rstrip("\r\n") for raw in read_raw_lines(path)]
    if len(lines) != expected:
        raise AttnError(f"{display_name(path)} has {len(lines)} lines, the validation data "
                        f"{expected} pairs: --valid-ref must hold one reference per pair")
    return lines


def _gold_trees(sequences: list[str] | None, words: list[list[str]], path: str | None,
                expected: int) -> list:
    """Gold trees in EVALB's view: from a treebank file, or else the validation targets
    (linearized trees) rebuilt over the source words."""
    from .trees import EvalbMismatch, delinearize, evalb_tree, read_treebank

    if path is None:
        trees = [delinearize(sequence, sentence) for sequence, sentence in zip(sequences, words)]
    else:
        trees = list(read_treebank([path]))
        if len(trees) != expected:
            raise AttnError(f"{display_name(path)} has {len(trees)} trees, the validation data "
                            f"{expected} pairs: --valid-ref must hold one gold tree per pair")
    try:
        return [evalb_tree(tree) for tree in trees]
    except EvalbMismatch as error:
        raise AttnError(f"{display_name(path or 'the validation targets')}: {error}") from None


# ---------------------------------------------------------------------- the best checkpoints


def scored_steps(run_dir: str | Path, metric: str | None = None) -> tuple[str, dict[int, float]]:
    """(metric, {step: validation score}) from a run's metrics.jsonl: the metric asked for, or
    the one the run was validated by (its last validation row's `valid_metric`, else loss)."""
    path = Path(run_dir) / METRICS_FILE
    rows = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rows.append(json.loads(line))
    if metric is None:
        named = [row["valid_metric"] for row in rows if "valid_metric" in row]
        metric = named[-1] if named else "loss"
    key = metric_key(metric)
    scores = {int(row["step"]): float(row[key]) for row in rows
              if key in row and math.isfinite(float(row[key]))}
    return metric, scores


def best_steps(scores: dict[int, float], metric: str, count: int) -> list[int]:
    """The `count` best steps by score, best first (the later step first on a tie)."""
    sign = -1.0 if VALID_METRICS[metric] == "higher" else 1.0
    ranked = sorted(scores, key=lambda step: (sign * scores[step], -step))
    return ranked[:count]
