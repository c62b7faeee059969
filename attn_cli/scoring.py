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

from .files import STRICT, AttnError, Utf8Policy, display_name, open_binary
from .trees import MAX_ERRORS

METRICS = ("bleu", "chrf", "ter")
TOKENIZERS = ("13a", "intl", "none", "zh", "ja-mecab", "ko-mecab", "char", "flores101",
              "flores200")


def read_raw_lines(path: str) -> list[bytes]:
    with open_binary(path) as handle:
        return list(handle)


def read_parallel(first: str, second: str, policy: Utf8Policy = STRICT
                  ) -> tuple[list[str], list[str], AttnError | None]:
    """Two files that must have the same number of lines, decoded as `policy` says. With a
    strict policy and an invalid line: the pairs before it, and the error to raise once their
    per-line results are written."""
    raw_a, raw_b = read_raw_lines(first), read_raw_lines(second)
    if len(raw_a) != len(raw_b):
        raise AttnError(f"line counts differ: {display_name(first)} has {len(raw_a)} lines, "
                        f"{display_name(second)} has {len(raw_b)}")
    a, b = [], []
    try:
        for number, (line_a, line_b) in enumerate(zip(raw_a, raw_b), start=1):
            decoded_a = policy.decode(line_a, first, number)
            b.append(policy.decode(line_b, second, number))
            a.append(decoded_a)
    except AttnError as error:
        return a, b, error
    finally:
        policy.finish()
    return a, b, None


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


def tree_scores(gold_path: str, test_path: str, sentence_level: bool = False,
                max_errors: int = MAX_ERRORS, policy: Utf8Policy = STRICT,
                warn=None) -> Iterator[str]:
    """EVALB (COLLINS.prm) over a gold treebank and one test tree per line: two summary lines
    (all sentences, and those of ≤ 40 words), or one `precision recall f1` line per tree (nan
    for an error or skip sentence). Error sentences are reported through `warn`; more than
    `max_errors` of them is an error (EVALB's MAX_ERROR, which EVALB itself checks against its
    count of error messages, stopping one sentence later)."""
    from .trees import CUTOFF_LENGTH, BracketCounts, EvalbMismatch, evalb_length, read_treebank

    warn = warn or (lambda message: None)
    gold = list(read_treebank([gold_path]))
    raw_lines = read_raw_lines(test_path)
    name = display_name(test_path)
    if len(gold) != len(raw_lines):
        raise AttnError(f"tree counts differ: {display_name(gold_path)} has {len(gold)} trees, "
                        f"{name} has {len(raw_lines)} lines")
    total, short = BracketCounts(), BracketCounts()
    error_lines: list[int] = []
    try:
        for number, (gold_tree, raw) in enumerate(zip(gold, raw_lines), start=1):
            line = policy.decode(raw, test_path, number)
            try:
                gold_length = evalb_length(gold_tree)
            except EvalbMismatch as error:
                raise AttnError(f"{display_name(gold_path)}: tree {number}: {error}") from None
            counts, reason = score_tree_line(gold_tree, line, f"{name}:{number}")
            if reason is not None:
                error_lines.append(number)
                if len(error_lines) > max_errors:
                    raise AttnError(f"{name}:{number}: {reason}; that is {len(error_lines)} "
                                    f"error sentences, more than --max-errors {max_errors}"
                                    ) from None
                warn(f"score: {name}:{number}: error sentence, not scored: {reason}")
            total.add(counts)
            if gold_length <= CUTOFF_LENGTH:
                short.add(counts)
            if sentence_level:
                yield (f"{counts.precision:.2f}\t{counts.recall:.2f}\t{counts.f1:.2f}"
                       if counts.valid else "nan\tnan\tnan")
    finally:
        policy.finish()
    if total.errors or total.skipped:
        warn(f"score: {total.errors} error and {total.skipped} skip sentence(s) not scored "
             f"(as EVALB counts them){': errors at lines ' if error_lines else ''}"
             f"{', '.join(map(str, error_lines))}")
    if not sentence_level:
        for label, counts in (("all", total), (f"len<={CUTOFF_LENGTH}", short)):
            yield (f"EVALB|COLLINS.prm|{label}|sentences:{counts.sentences}|valid:{counts.valid}"
                   f"|errors:{counts.errors}|skipped:{counts.skipped} = F1 {counts.f1:.2f} "
                   f"P {counts.precision:.2f} R {counts.recall:.2f} "
                   f"EX {counts.exact_match:.2f} CB {counts.average_crossing:.2f}")


def score_tree_line(gold, line: str, where: str):
    """(counts, None) for one test line against its gold tree, or (an error sentence's counts,
    why) when the line is not one tree over the gold's words."""
    from .trees import BracketCounts, EvalbMismatch, evalb_sentence, read_trees

    try:
        trees = list(read_trees(line, where))
        if len(trees) > 1:
            raise EvalbMismatch(f"{len(trees)} trees on one line")
        return evalb_sentence(gold, trees[0] if trees else None), None
    except (AttnError, EvalbMismatch) as error:
        return BracketCounts(sentences=1, errors=1), str(error).removeprefix(f"{where}: ")
