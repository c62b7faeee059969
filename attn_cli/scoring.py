"""`attn score`: corpus metrics through sacrebleu, and force-decoding with a model.

Text metrics import sacrebleu only (no torch): scoring a file is instant. Force-decoding reports,
per line, the log-probability the model gives the target (natural log, EOS included) and its
token count; the corpus perplexity exp(-Σ log p / Σ tokens) is the number training validation
reports (padding excluded, EOS included, no label smoothing).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from .files import AttnError, display_name, read_lines

METRICS = ("bleu", "chrf", "ter")
TOKENIZERS = ("13a", "intl", "none", "zh", "ja-mecab", "ko-mecab", "char", "flores101",
              "flores200")


def read_parallel(first: str, second: str) -> tuple[list[str], list[str]]:
    """Two files that must have the same number of lines."""
    a, b = list(read_lines(first)), list(read_lines(second))
    if len(a) != len(b):
        raise AttnError(f"line counts differ: {display_name(first)} has {len(a)} lines, "
                        f"{display_name(second)} has {len(b)}")
    return a, b


def corpus_scores(hypotheses: list[str], references: list[str], metrics: list[str],
                  tokenize: str, lowercase: bool = False) -> list[str]:
    """One line per metric, sacrebleu's way: `SIGNATURE = SCORE ...`."""
    from sacrebleu.metrics import BLEU, CHRF, TER

    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise AttnError(f"unknown metric {unknown[0]!r}; choose from {', '.join(METRICS)}")
    if tokenize not in TOKENIZERS:
        raise AttnError(f"unknown tokenizer {tokenize!r}; choose from {', '.join(TOKENIZERS)}")
    lines = []
    for name in metrics:
        if name == "bleu":
            metric = BLEU(tokenize=tokenize, lowercase=lowercase)
        elif name == "chrf":
            metric = CHRF(lowercase=lowercase)
        else:
            metric = TER(case_sensitive=not lowercase)
        score = metric.corpus_score(hypotheses, [references])
        lines.append(f"{score.name}|{metric.get_signature()} = {_score_text(score)}")
    return lines


def _score_text(score) -> str:
    """sacrebleu's formatted score without its leading `NAME = `."""
    text = score.format()
    return text.split(" = ", 1)[1] if " = " in text else text


def sentence_scores(hypotheses: list[str], references: list[str], metric_name: str,
                    tokenize: str) -> Iterator[str]:
    """One score per line (for sorting, filtering, significance tests)."""
    from sacrebleu.metrics import BLEU, CHRF, TER

    if metric_name == "bleu":
        metric = BLEU(tokenize=tokenize, effective_order=True)
    elif metric_name == "chrf":
        metric = CHRF()
    elif metric_name == "ter":
        metric = TER()
    else:
        raise AttnError(f"unknown metric {metric_name!r}; choose from {', '.join(METRICS)}")
    for hypothesis, reference in zip(hypotheses, references):
        yield f"{metric.sentence_score(hypothesis, [reference]).score:.4f}"


@dataclass
class ForcedScore:
    log_prob: float  # natural log, EOS included
    tokens: int  # target subwords + EOS


def force_decode(loaded, sources: list[str], targets: list[str], device, dtype: str,
                 batch_tokens: int = 8000) -> list[ForcedScore]:
    """Teacher-forced log-probabilities of each target given its source, in input order."""
    import torch

    from .devices import autocast
    from .translate import pad_sequences, token_budget_batches

    config = loaded.config
    src_ids = [ids + [config.eos_id] for ids in loaded.src_vocab.encode(sources)]
    tgt_ids = loaded.tgt_vocab.encode(targets)
    results: list[ForcedScore | None] = [None] * len(sources)
    lengths = [max(len(s), len(t) + 1) for s, t in zip(src_ids, tgt_ids)]
    model = loaded.model.to(device).eval()
    with torch.no_grad():
        for batch in token_budget_batches(lengths, batch_tokens):
            src = pad_sequences([src_ids[i] for i in batch], config.pad_id).to(device)
            tgt_in = pad_sequences([[config.bos_id] + tgt_ids[i] for i in batch], config.pad_id)
            tgt_out = pad_sequences([tgt_ids[i] + [config.eos_id] for i in batch], config.pad_id)
            tgt_in, tgt_out = tgt_in.to(device), tgt_out.to(device)
            with autocast(device, dtype):
                logits = model(src, tgt_in)
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            picked = log_probs.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1)
            keep = tgt_out != config.pad_id
            sums = (picked * keep).sum(dim=1).tolist()
            counts = keep.sum(dim=1).tolist()
            for index, total, count in zip(batch, sums, counts):
                results[index] = ForcedScore(total, int(count))
    return results


def perplexity(scores: list[ForcedScore]) -> float:
    tokens = sum(s.tokens for s in scores)
    return math.exp(-sum(s.log_prob for s in scores) / tokens) if tokens else float("nan")


def tree_scores(gold_path: str, test_path: str, sentence_level: bool = False) -> Iterator[str]:
    """EVALB over a gold treebank and one test tree per line; a corpus line, or one line per
    tree (`precision recall f1`)."""
    from .trees import BracketCounts, clean, evalb_sentence, read_treebank, read_trees

    gold = [clean(tree) for tree in read_treebank([gold_path])]
    test_lines = list(read_lines(test_path))
    if len(gold) != len(test_lines):
        raise AttnError(f"tree counts differ: {display_name(gold_path)} has {len(gold)} trees, "
                        f"{display_name(test_path)} has {len(test_lines)} lines")
    total, short = BracketCounts(), BracketCounts()
    for number, (gold_tree, line) in enumerate(zip(gold, test_lines), start=1):
        parsed = list(read_trees(line, f"{display_name(test_path)}:{number}"))
        if len(parsed) != 1:
            raise AttnError(f"{display_name(test_path)}:{number}: expected one tree, found "
                            f"{len(parsed)}")
        counts = evalb_sentence(gold_tree, parsed[0], number)
        total.add(counts)
        if len(gold_tree.words()) <= 40:
            short.add(counts)
        if sentence_level:
            one = counts
            yield f"{one.precision:.2f}\t{one.recall:.2f}\t{one.f1:.2f}"
    if not sentence_level:
        for name, counts in (("all", total), ("len<=40", short)):
            yield (f"EVALB|COLLINS.prm|{name}|sentences:{counts.sentences} = F1 {counts.f1:.2f} "
                   f"P {counts.precision:.2f} R {counts.recall:.2f} "
                   f"EX {100 * counts.exact / max(counts.sentences, 1):.2f}")
