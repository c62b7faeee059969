"""`attn score`: corpus metrics through sacrebleu (and the paper's tokenized BLEU), and
force-decoding with a model.

Text metrics import sacrebleu only (no torch): scoring a file is instant. Force-decoding reports,
per line, the log-probability the model gives the target (natural log, EOS included) and its
token count; the corpus perplexity exp(-Σ log p / Σ tokens) is the number training validation
reports (padding excluded, EOS included, no label smoothing). Trees are scored by parse/evalb.py.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from . import compound_bleu
from .errors import AttnError, batch_must_fit
from .files import STRICT, Utf8Policy, display_name, read_raw_lines
from .formats import BATCH_TOKENS, COMPOUND_SPLIT, TOKENIZERS

METRICS = ("bleu", "chrf", "ter")


def read_parallel(first: str, second: str, policy: Utf8Policy = STRICT
                  ) -> tuple[list[str], list[str], AttnError | None]:
    """Two files that must have the same number of lines, decoded as `policy` says. With a
    strict policy and an invalid line: the pairs before it, and the error to raise once their
    per-line results are written."""
    first_raw, second_raw = read_raw_lines(first), read_raw_lines(second)
    if len(first_raw) != len(second_raw):
        raise AttnError(f"line counts differ: {display_name(first)} has {len(first_raw)} "
                        f"lines, {display_name(second)} has {len(second_raw)}")
    first_lines, second_lines = [], []
    try:
        for number, (first_line, second_line) in enumerate(zip(first_raw, second_raw), start=1):
            decoded = policy.decode(first_line, first, number)
            second_lines.append(policy.decode(second_line, second, number))
            first_lines.append(decoded)
    except AttnError as error:
        return first_lines, second_lines, error
    finally:
        policy.finish()
    return first_lines, second_lines, None


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
    """Corpus BLEU, chrF and TER (any of them, in the order asked) through sacrebleu. With
    `tokenize` compound-split, BLEU is the paper's tokenized BLEU (compound_bleu.py; chrF and
    TER take no tokenizer)."""
    scorers = [_metric(name, _sacrebleu_tokenizer(tokenize), lowercase) for name in metrics]
    results = []
    for name, metric in zip(metrics, scorers):
        if name == "bleu" and tokenize == COMPOUND_SPLIT:
            paper = compound_bleu.bleu_metric(lowercase)
            results.append(_corpus_score(paper, [compound_bleu.paper_words(line)
                                                 for line in hypotheses],
                                         [compound_bleu.paper_words(line)
                                          for line in references],
                                         compound_bleu.signature))
        else:
            results.append(_corpus_score(metric, hypotheses, references))
    return results


def _corpus_score(metric, hypotheses: list[str], references: list[str],
                  signature=lambda metric: metric.get_signature().format()) -> MetricScore:
    """A sacrebleu metric's corpus score; `signature(metric)` once it has scored (it names the
    references' count)."""
    score = metric.corpus_score(hypotheses, [references])
    text = score.format()
    return MetricScore(score.name, signature(metric), score.score,
                       text.split(" = ", 1)[1] if " = " in text else text)


def sentence_scores(hypotheses: list[str], references: list[str], metric_name: str,
                    tokenize: str = "13a", lowercase: bool = False) -> list[float]:
    """One score per line (for sorting, filtering, significance tests)."""
    metric = _metric(metric_name, _sacrebleu_tokenizer(tokenize), lowercase, sentence=True)
    if metric_name == "bleu" and tokenize == COMPOUND_SPLIT:
        return compound_bleu.sentence_bleu(hypotheses, references, lowercase)
    return [metric.sentence_score(hypothesis, [reference]).score
            for hypothesis, reference in zip(hypotheses, references)]


def _sacrebleu_tokenizer(tokenize: str) -> str:
    """compound-split tokenizes BLEU only, and by itself; sacrebleu's metrics keep 13a."""
    return "13a" if tokenize == COMPOUND_SPLIT else tokenize


def text_score_lines(hypotheses_path: str, references_path: str, metrics: list[str],
                     tokenize: str = "13a", lowercase: bool = False,
                     sentence_level: bool = False, policy: Utf8Policy = STRICT,
                     as_json: bool = False) -> Iterator[str]:
    """`attn score --ref`'s output: with `sentence_level`, a line per line (the first metric's
    score), else a line per metric (sacrebleu's, with its signature), as text or JSON. A line
    `policy` refuses ends the output with its error: after the lines of the lines before it,
    and with no corpus score (it would be the score of part of the corpus)."""
    hypotheses, references, bad_line = read_parallel(hypotheses_path, references_path, policy)
    if sentence_level:
        name = metrics[0]
        scores = sentence_scores(hypotheses, references, name, tokenize, lowercase)
        for number, value in enumerate(scores, start=1):
            yield _json_line({"line": number, name: round(value, 4)}) if as_json \
                else f"{value:.4f}"
    elif bad_line is None:
        results = text_scores(hypotheses, references, metrics, tokenize, lowercase)
        if as_json:
            yield _json_line({result.name: {"score": round(result.score, 4),
                                            "signature": result.signature,
                                            "text": result.text} for result in results})
        else:
            yield from (result.line() for result in results)
    if bad_line is not None:
        raise bad_line


def _json_line(value) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass
class ForcedScore:
    log_prob: float  # natural log, EOS included
    tokens: int  # target subwords + EOS


@dataclass
class ForcedScores:
    """What `attn score -m` reports: each pair's score, in order, and the summary."""

    scores: list[ForcedScore]
    seconds: float  # loading the models and scoring
    # The line strict UTF-8 refused, which ended the reading: the pairs before it are scored.
    bad_line: AttnError | None = None

    def lines(self, as_json: bool = False) -> Iterator[str]:
        """A line per pair, log-prob and token count, as text or JSON; then a bad line's
        error."""
        for number, score in enumerate(self.scores, start=1):
            yield _json_line({"line": number, "log_prob": round(score.log_prob, 4),
                              "tokens": score.tokens}) if as_json \
                else f"{score.log_prob:.4f}\t{score.tokens}"
        if self.bad_line is not None:
            raise self.bad_line

    def summary(self) -> str:
        """The line for stderr: pairs, target tokens, the corpus perplexity, the time."""
        tokens = sum(score.tokens for score in self.scores)
        return (f"score: {len(self.scores)} pairs, {tokens} target tokens (EOS included), "
                f"perplexity {perplexity(self.scores):.4f} in {self.seconds:.1f}s")


def score_files_with_model(model_paths: list, sources_path: str, targets_path: str,
                           device: str = "auto", dtype: str = "auto",
                           batch_tokens: int = BATCH_TOKENS, threads: int = 0,
                           policy: Utf8Policy = STRICT, target_lang: str | None = None,
                           warn=None) -> ForcedScores:
    """`attn score -m MODEL SRC TGT`: the pairs of two files read (`read_parallel`) and
    scored by `score_with_model`."""
    sources, targets, bad_line = read_parallel(sources_path, targets_path, policy)
    started = time.perf_counter()
    scores = score_with_model(model_paths, sources, targets, device, dtype, batch_tokens,
                              threads, target_lang, warn)
    return ForcedScores(scores, time.perf_counter() - started, bad_line)


def score_with_model(model_paths: list, sources: list[str], targets: list[str],
                     device: str = "auto", dtype: str = "auto",
                     batch_tokens: int = BATCH_TOKENS, threads: int = 0,
                     target_lang: str | None = None, warn=None) -> list[ForcedScore]:
    """`attn score -m`: model files loaded (several: an ensemble) and `force_decode`d; with
    `target_lang`, each source after that language's tag, as `attn decode --target-lang`
    translates (`warn` says when a model of several target languages is given none)."""
    from .devices import resolve_dtype
    from .ensemble import load_models
    from .tags import target_tags, untagged_note

    models, chosen, _ = load_models(model_paths, device, threads)
    tags = target_tags(models[0].src_vocab, target_lang, f"model file {model_paths[0]}")
    note = None if target_lang else untagged_note(models[0].src_vocab, str(model_paths[0]))
    if note and warn:
        warn(f"score: warning: {note}")
    return force_decode(models, sources, targets, chosen, resolve_dtype(dtype, chosen),
                        batch_tokens, tags)


def force_decode(models: list, sources: list[str], targets: list[str], device, dtype: str,
                 batch_tokens: int = BATCH_TOKENS,
                 source_tags: tuple[int, ...] = ()) -> list[ForcedScore]:
    """Teacher-forced log-probabilities of each target given its source, in input order, by
    the loaded `models`; several are an ensemble, scored by the distribution `attn decode -m A
    -m B` searches (the models' log-probabilities averaged at each position, renormalised).
    `source_tags`: the ids each non-empty source starts with (a target language's tag)."""
    import torch

    from .batching import collate_pairs, token_budget_batches
    from .devices import autocast, inference_model
    from .ensemble import Ensemble

    first = models[0]
    config = first.config
    src_ids = [[*source_tags, *ids] if ids else ids for ids in first.src_vocab.encode(sources)]
    tgt_ids = first.tgt_vocab.encode(targets)
    results: list[ForcedScore | None] = [None] * len(sources)
    lengths = [max(len(s) + 1, len(t) + 1) for s, t in zip(src_ids, tgt_ids)]  # + EOS, BOS
    # float32 weights, autocast running `dtype`: the models' own tensors (nothing copied when
    # they are float32 on `device` already, as load_models gives them), the models unchanged
    ensemble = Ensemble([inference_model(member.model, device) for member in models])
    with torch.no_grad(), batch_must_fit(f"batches of {batch_tokens} tokens",
                                         f"lower --batch-tokens ({batch_tokens})"):
        for batch in token_budget_batches(lengths, batch_tokens):
            collated = collate_pairs([(src_ids[i], tgt_ids[i]) for i in batch], config.bos_id,
                                     config.eos_id, config.pad_id).to(device)
            tgt_out = collated.tgt_output
            with autocast(device, dtype):
                picked = ensemble.gold_log_probs(collated.src_tokens, collated.tgt_input,
                                                 tgt_out)
            keep = tgt_out != config.pad_id
            sums = (picked * keep).sum(dim=1).tolist()
            counts = keep.sum(dim=1).tolist()
            for index, total, count in zip(batch, sums, counts):
                results[index] = ForcedScore(total, int(count))
    return results


def perplexity(scores: list[ForcedScore]) -> float:
    tokens = sum(s.tokens for s in scores)
    return math.exp(-sum(s.log_prob for s in scores) / tokens) if tokens else float("nan")
