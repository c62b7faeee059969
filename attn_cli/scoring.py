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
from .formats import BATCH_TOKENS
from .trees import CUTOFF_LENGTH, MAX_ERRORS, BracketCounts

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


@dataclass(frozen=True)
class MetricScore:
    """One corpus metric as sacrebleu reports it."""

    name: str  # BLEU, chrF2, TER
    signature: str  # sacrebleu's: what makes the score reproducible
    score: float
    text: str  # sacrebleu's formatted score, e.g. "35.20 68.0/42.7/29.5/20.3 (BP = 0.905 ...)"

    def line(self) -> str:
        return f"{self.name}|{self.signature} = {self.text}"


def _metric(name: str, tokenize: str, lowercase: bool = False, sentence: bool = False):
    from sacrebleu.metrics import BLEU, CHRF, TER

    if name not in METRICS:
        raise AttnError(f"unknown metric {name!r}; choose from {', '.join(METRICS)}")
    if tokenize not in TOKENIZERS:
        raise AttnError(f"unknown tokenizer {tokenize!r}; choose from {', '.join(TOKENIZERS)}")
    if name == "bleu":
        return BLEU(tokenize=tokenize, lowercase=lowercase, effective_order=sentence)
    if name == "chrf":
        return CHRF(lowercase=lowercase)
    return TER(case_sensitive=not lowercase)


def text_scores(hypotheses: list[str], references: list[str], metrics: list[str],
                tokenize: str = "13a", lowercase: bool = False) -> list[MetricScore]:
    """Corpus BLEU, chrF and TER (any of them, in the order asked) through sacrebleu."""
    scorers = [_metric(name, tokenize, lowercase) for name in metrics]
    results = []
    for metric in scorers:
        score = metric.corpus_score(hypotheses, [references])
        text = score.format()
        results.append(MetricScore(score.name, metric.get_signature().format(), score.score,
                                   text.split(" = ", 1)[1] if " = " in text else text))
    return results


def sentence_scores(hypotheses: list[str], references: list[str], metric_name: str,
                    tokenize: str = "13a", lowercase: bool = False) -> list[float]:
    """One score per line (for sorting, filtering, significance tests)."""
    metric = _metric(metric_name, tokenize, lowercase, sentence=True)
    return [metric.sentence_score(hypothesis, [reference]).score
            for hypothesis, reference in zip(hypotheses, references)]


@dataclass
class ForcedScore:
    log_prob: float  # natural log, EOS included
    tokens: int  # target subwords + EOS


def force_decode(loaded, sources: list[str], targets: list[str], device, dtype: str,
                 batch_tokens: int = BATCH_TOKENS, ensemble=()) -> list[ForcedScore]:
    """Teacher-forced log-probabilities of each target given its source, in input order. With
    an `ensemble` (more loaded models), of the distribution `attn decode -m A -m B` searches:
    the models' log-probabilities averaged at each position, renormalised."""
    import torch

    from .devices import autocast
    from .translate import pad_sequences, token_budget_batches

    config = loaded.config
    src_ids = [ids + [config.eos_id] for ids in loaded.src_vocab.encode(sources)]
    tgt_ids = loaded.tgt_vocab.encode(targets)
    results: list[ForcedScore | None] = [None] * len(sources)
    lengths = [max(len(s), len(t) + 1) for s, t in zip(src_ids, tgt_ids)]
    models = [member.model.to(device).eval() for member in (loaded, *ensemble)]
    with torch.no_grad():
        for batch in token_budget_batches(lengths, batch_tokens):
            src = pad_sequences([src_ids[i] for i in batch], config.pad_id).to(device)
            tgt_in = pad_sequences([[config.bos_id] + tgt_ids[i] for i in batch], config.pad_id)
            tgt_out = pad_sequences([tgt_ids[i] + [config.eos_id] for i in batch], config.pad_id)
            tgt_in, tgt_out = tgt_in.to(device), tgt_out.to(device)
            with autocast(device, dtype):
                each = [torch.log_softmax(model(src, tgt_in).float(), dim=-1)
                        for model in models]
            log_probs = each[0] if len(each) == 1 else \
                torch.log_softmax(torch.stack(each).mean(dim=0), dim=-1)
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


@dataclass(frozen=True)
class TreeSentence:
    """One test line scored against its gold tree."""

    number: int  # the line, from 1
    counts: BracketCounts  # an error or skip sentence counts as such, with no brackets
    gold_length: int  # words for the length cut-off (traces not counted)
    error: str | None = None  # why it is an error sentence

    @property
    def status(self) -> str:
        return "error" if self.counts.errors else "skip" if self.counts.skipped else "valid"


def tree_scores(gold_path: str, test_path: str, max_errors: int = MAX_ERRORS,
                policy: Utf8Policy = STRICT, warn=None) -> Iterator[TreeSentence]:
    """EVALB (COLLINS.prm) over a gold treebank and one test tree per line, line by line (sum
    them with `tree_totals`). Error sentences are reported through `warn`; more than
    `max_errors` of them is an error (EVALB's MAX_ERROR, which EVALB itself checks against its
    count of error messages, stopping one sentence later)."""
    from .trees import EvalbMismatch, evalb_tree, read_treebank

    warn = warn or (lambda message: None)
    gold = list(read_treebank([gold_path]))
    raw_lines = read_raw_lines(test_path)
    name = display_name(test_path)
    if len(gold) != len(raw_lines):
        raise AttnError(f"tree counts differ: {display_name(gold_path)} has {len(gold)} trees, "
                        f"{name} has {len(raw_lines)} lines")
    skipped = 0
    error_lines: list[int] = []
    try:
        for number, (gold_tree, raw) in enumerate(zip(gold, raw_lines), start=1):
            line = policy.decode(raw, test_path, number)
            try:
                gold_view = evalb_tree(gold_tree)  # once per gold tree
            except EvalbMismatch as error:
                raise AttnError(f"{display_name(gold_path)}: tree {number}: {error}") from None
            counts, reason = score_tree_line(gold_view, line, f"{name}:{number}")
            if reason is not None:
                error_lines.append(number)
                if len(error_lines) > max_errors:
                    raise AttnError(f"{name}:{number}: {reason}; that is {len(error_lines)} "
                                    f"error sentences, more than --max-errors {max_errors}"
                                    ) from None
                warn(f"score: {name}:{number}: error sentence, not scored: {reason}")
            skipped += counts.skipped
            yield TreeSentence(number, counts, gold_view.length, reason)
    finally:
        policy.finish()
    if error_lines or skipped:
        warn(f"score: {len(error_lines)} error and {skipped} skip sentence(s) not scored (as "
             f"EVALB counts them){': errors at lines ' if error_lines else ''}"
             f"{', '.join(map(str, error_lines))}")


def tree_totals(sentences: list[TreeSentence],
                length_edges: tuple[int, ...] = ()) -> dict[str, BracketCounts]:
    """EVALB's two summaries: every sentence, and those of at most 40 words; then, for
    `length_edges` (10, 20, 40, say), one per length bucket: len1-10, len11-20, len21-40 and
    len>40 (gold words, traces not counted, as EVALB's cut-off counts them)."""
    totals = {"all": BracketCounts(), f"len<={CUTOFF_LENGTH}": BracketCounts()}
    buckets = length_buckets(length_edges)
    totals.update((label, BracketCounts()) for label, _, _ in buckets)
    for sentence in sentences:
        totals["all"].add(sentence.counts)
        if sentence.gold_length <= CUTOFF_LENGTH:
            totals[f"len<={CUTOFF_LENGTH}"].add(sentence.counts)
        for label, low, high in buckets:
            if low <= sentence.gold_length <= high:
                totals[label].add(sentence.counts)
    return totals


def length_buckets(edges: tuple[int, ...]) -> list[tuple[str, int, float]]:
    """(label, fewest words, most words) of the buckets that `edges` (ascending upper bounds)
    cut sentence lengths into, the last one open: (10, 20) → len1-10, len11-20, len>20."""
    if not edges:
        return []
    if any(edge < 1 for edge in edges) or list(edges) != sorted(set(edges)):
        raise AttnError(f"length buckets need ascending positive edges, not "
                        f"{','.join(map(str, edges))}")
    buckets, low = [], 0
    for edge in edges:
        buckets.append((f"len{low + 1}-{edge}", low + 1, edge))
        low = edge
    buckets.append((f"len>{low}", low + 1, math.inf))
    return buckets


def score_tree_line(gold, line: str, where: str):
    """(counts, None) for one test line against its gold tree (a Tree or its EvalbTree), or (an
    error sentence's counts, why) when the line is not one tree over the gold's words."""
    from .trees import EvalbMismatch, evalb_sentence, read_trees

    try:
        trees = list(read_trees(line, where))
        if len(trees) > 1:
            raise EvalbMismatch(f"{len(trees)} trees on one line")
        return evalb_sentence(gold, trees[0] if trees else None), None
    except (AttnError, EvalbMismatch) as error:
        return BracketCounts(sentences=1, errors=1), str(error).removeprefix(f"{where}: ")


# ------------------------------------------------------------------------------ output formats


def tree_summary_line(label: str, counts: BracketCounts) -> str:
    return (f"EVALB|COLLINS.prm|{label}|sentences:{counts.sentences}|valid:{counts.valid}"
            f"|errors:{counts.errors}|skipped:{counts.skipped} = F1 {counts.f1:.2f} "
            f"P {counts.precision:.2f} R {counts.recall:.2f} "
            f"EX {counts.exact_match:.2f} CB {counts.average_crossing:.2f}")


def tree_sentence_line(sentence: TreeSentence) -> str:
    counts = sentence.counts
    if counts.valid:
        return f"{counts.precision:.2f}\t{counts.recall:.2f}\t{counts.f1:.2f}"
    return "nan\tnan\tnan"


def tree_counts_json(counts: BracketCounts) -> dict:
    return {"sentences": counts.sentences, "valid": counts.valid, "errors": counts.errors,
            "skipped": counts.skipped, "f1": round(counts.f1, 4),
            "precision": round(counts.precision, 4), "recall": round(counts.recall, 4),
            "exact_match": round(counts.exact_match, 4),
            "average_crossing": round(counts.average_crossing, 4), "matched": counts.matched,
            "gold_brackets": counts.gold, "test_brackets": counts.test}


def tree_sentence_json(sentence: TreeSentence) -> dict:
    valid = sentence.counts.valid > 0
    return {"line": sentence.number, "status": sentence.status,
            **{key: (round(getattr(sentence.counts, key), 4) if valid else None)
               for key in ("precision", "recall", "f1")},
            **({"error": sentence.error} if sentence.error else {})}
