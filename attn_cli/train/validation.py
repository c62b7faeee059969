"""Validation by the metric a run is judged on, and the best checkpoints by it.

At each save `attn train --valid-metric bleu|chrf|f1` decodes the validation sources with the
model being trained (greedy unless `--valid-beam`), and scores the output against the
references: sacreBLEU's corpus BLEU or chrF for translation, EVALB's F1 (COLLINS.prm, as
`attn score --trees`) for parsing. `loss` needs no decoding (the label-smoothed validation loss,
which training computes anyway). The references are the validation file's own target side,
detokenized, unless a file is given (`--valid-ref`: raw reference text, or gold trees).

Every process of a run takes its share of the work: of the loss's batches, and of the sources
to decode (the main process gathers the outputs and scores them). The scores go to
metrics.jsonl, where `checkpoints.scored_steps` reads them back for `--keep-best`, `--patience`
and `attn average --best`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..batching import collate, pad_sequences, source_budget, token_batches, token_budget_batches
from ..checkpoints import metric_key
from ..data import ParallelData
from ..devices import autocast, search_batch_tokens
from ..errors import AttnError
from ..files import display_name, read_raw_lines
from ..formats import PARSING, TRANSLATION, VALID_METRICS
from ..model import Transformer
from ..modelfile import unwrap
from ..parse.constraint import model_terminals, tree_constraint_for
from ..parse.evalb import EvalbMismatch, evalb_tree, trees_f1
from ..parse.trees import delinearize, read_treebank
from ..search import beam_search
from .distributed import Processes, all_reduce_sum, gather_to_main


@dataclass
class Validator:
    """The validation set made ready to decode and score: one per run."""

    metric: str
    beam: int
    sources: list[list[int]]  # token ids, EOS included
    words: list[list[str]]  # the source sentences' words (for trees)
    references: list  # reference texts, or gold trees (EvalbTree) for f1
    tgt_vocab: object
    batch_tokens: int | None  # None: devices.search_batch_tokens
    # Ids every target of the data starts with (an NLLB-200 or M2M-100 model's target language
    # code: `binarize --langs`), left out of the outputs' text: the model, trained to write
    # them first, is searched freely (forcing them is `attn decode`'s, a feature train does not
    # import)
    target_start: tuple[int, ...] = ()

    @classmethod
    def build(cls, metric: str, data: ParallelData, reference_path: str | None = None,
              beam: int = 1, batch_tokens: int | None = None) -> "Validator":
        if metric not in VALID_METRICS or metric == "loss":
            raise AttnError(f"no validation decoding for the metric {metric!r}")
        tgt_vocab = data.tgt_vocab or data.src_vocab
        src_ids = [data.pair(i)[0].tolist() for i in range(len(data))]
        sources = [ids + [data.special_ids.eos] for ids in src_ids]
        words = [text.split() for text in data.src_vocab.decode(src_ids)]
        if reference_path is None:
            texts = tgt_vocab.decode([data.pair(i)[1].tolist() for i in range(len(data))])
        else:
            texts = None
        references = (_gold_trees(texts, words, reference_path, len(data)) if metric == "f1"
                      else texts if texts is not None
                      else _reference_lines(reference_path, len(data)))
        start = data.metadata.get("target_tags", "").split()
        pieces = tgt_vocab.pieces or ()
        target_start = tuple(pieces.index(piece) for piece in start if piece in pieces)
        return cls(metric, beam, sources, words, references, tgt_vocab, batch_tokens,
                   target_start)

    def hypotheses(self, model: torch.nn.Module) -> list[str]:
        """The model's output for every validation source, detokenized, in order."""
        return self.texts(self.search(model))

    def search(self, model: torch.nn.Module, rank: int = 0,
               world_size: int = 1) -> dict[int, list[int]]:
        """The output tokens of process `rank`'s share of the validation sources (every
        world_size-th batch; all of them by default), by source index. Each batch is searched
        alone, so the shares put together are the output of one process."""
        settings = PARSING if self.metric == "f1" else TRANSLATION
        constraint_for = self._tree_constraint(model) if self.metric == "f1" else None
        device = next(model.parameters()).device
        learned = model.config.positions == "learned"
        output: dict[int, list[int]] = {}
        was_training = model.training
        model.eval()
        try:
            lengths = [len(ids) for ids in self.sources]
            budget = self.batch_tokens or shared_budget(lengths, world_size, device)
            batches = token_budget_batches(lengths, source_budget(budget, self.beam))
            for batch in batches[rank::world_size]:
                src = pad_sequences([self.sources[i] for i in batch],
                                    model.config.pad_id).to(device)
                constraint = constraint_for([" ".join(self.words[i]) for i in batch]) \
                    if constraint_for else None
                found = beam_search(model, src, beam=self.beam, alpha=settings.alpha,
                                    max_len_a=settings.max_len_a, max_len_b=settings.max_len_b,
                                    longest=model.config.max_positions - 1 if learned else None,
                                    constraint=constraint)
                for index, hypotheses in zip(batch, found):
                    output[index] = [token for token in hypotheses[0].tokens
                                     if token not in self.target_start]
        finally:
            model.train(was_training)
        return output

    def texts(self, output: dict[int, list[int]]) -> list[str]:
        """Every source's output (all the processes' shares), detokenized, in order."""
        return self.tgt_vocab.decode([output[index] for index in range(len(self.sources))])

    def _tree_constraint(self, model: torch.nn.Module):
        """Parsers are validated as the recipes parse, `attn parse --constrain`: well-formed
        trees over exactly the sentence's words. It also bounds each output by its words, where
        a half-trained parser's free search runs on to the length limit (|x| + 300)."""
        return tree_constraint_for(self.tgt_vocab, model.config.eos_id,
                                   model_terminals(self.tgt_vocab))

    def score(self, model: torch.nn.Module) -> float:
        return self.score_texts(self.hypotheses(model))

    def score_texts(self, texts: list[str]) -> float:
        if self.metric == "f1":
            return trees_f1(texts, self.words, self.references)
        import sacrebleu  # only when scoring: its import is slow

        scorer = sacrebleu.corpus_bleu if self.metric == "bleu" else sacrebleu.corpus_chrf
        return float(scorer(texts, [self.references]).score)


def shared_budget(lengths: list[int], world_size: int, device: torch.device) -> int:
    """The token budget of a validation search batch: the device's (decode's), or less where
    that would leave processes without a batch (64,000 tokens on a GPU hold all of a 3,000
    sentence set in 3 batches: 5 of 8 GPUs would decode nothing). Batches of at most
    1/world_size of the sources' tokens are at least world_size batches (unless a sentence
    alone is longer)."""
    device_budget = search_batch_tokens(device)
    if world_size == 1:
        return device_budget
    return max(1, min(device_budget, sum(lengths) // world_size))


def _reference_lines(path: str, expected: int) -> list[str]:
    lines = [raw.decode("utf-8", errors="strict").rstrip("\r\n") for raw in read_raw_lines(path)]
    if len(lines) != expected:
        raise AttnError(f"{display_name(path)} has {len(lines)} lines, the validation data "
                        f"{expected} pairs: --valid-ref must hold one reference per pair")
    return lines


def _gold_trees(sequences: list[str] | None, words: list[list[str]], path: str | None,
                expected: int) -> list:
    """Gold trees in EVALB's view: from a treebank file, or else the validation targets
    (linearized trees) rebuilt over the source words."""
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


# ------------------------------------------------------ at every save, on every process


@dataclass(frozen=True)
class Validation:
    """A run's validation at every save: the loss and perplexity on the validation data, and
    the score of the metric the run is judged by where that metric decodes."""

    data: ParallelData
    metric: str  # --valid-metric
    validator: Validator | None  # decodes and scores (None: the metric is the loss)
    max_tokens: int  # the loss's batches: the training micro-batches' budget
    label_smoothing: float

    @classmethod
    def build(cls, data: ParallelData, metric: str, reference_path: Path | None, beam: int,
              max_tokens: int, label_smoothing: float) -> "Validation":
        """On every process: each decodes its share of the validation set."""
        validator = None if metric == "loss" else Validator.build(
            metric, data, str(reference_path) if reference_path else None, beam)
        return cls(data, metric, validator, max_tokens, label_smoothing)

    def row(self, model: Transformer, processes: Processes, dtype: str) -> dict:
        """The validation fields of a metrics row: loss and perplexity, the metric's score,
        which metric, and the seconds it all took (apart from training time: the next row's
        tokens/s counts training steps only)."""
        started = time.monotonic()
        fields = evaluate(model, self.data, self.max_tokens, self.label_smoothing, processes,
                          dtype)
        if self.validator is not None:
            score = validation_score(self.validator, model, processes, dtype)
            if score is not None:
                fields[metric_key(self.metric)] = score
        fields["valid_metric"] = self.metric
        fields["valid_s"] = time.monotonic() - started
        return fields


# What a validation by decoding may raise without ending hours of training: said, and the run
# goes on without that score.
_VALIDATION_ERRORS = (AttnError, RecursionError, RuntimeError, ValueError)


def validation_score(validator: Validator, model: Transformer, processes: Processes,
                     dtype: str) -> float | None:
    """The validation metric's score (main process; None elsewhere, and where it failed): each
    process decodes every world_size-th batch, the main process gathers the outputs and scores
    them. On 8 GPUs each decodes about an eighth of the sentences (shared_budget leaves none
    without a batch), and no GPU waits for another; the outputs are those of one process (each
    batch is searched alone)."""
    try:
        with autocast(processes.device, dtype):
            share = {"output": validator.search(model, processes.rank, processes.world_size)}
    except _VALIDATION_ERRORS as error:
        share = {"error": f"{type(error).__name__}: {error}"}
    shares = gather_to_main(share, processes)
    if not processes.is_main:
        return None
    failed = next((share["error"] for share in shares if "error" in share), None)
    try:
        if failed is None:
            output = {index: tokens for share in shares for index, tokens in
                      share["output"].items()}
            return validator.score_texts(validator.texts(output))
    except _VALIDATION_ERRORS as error:
        failed = f"{type(error).__name__}: {error}"
    processes.log(f"validation by {validator.metric} failed, the run goes on without that "
                  f"score: {failed}")
    return None


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: ParallelData, max_tokens: int, epsilon: float,
             processes: Processes, dtype: str) -> dict[str, float]:
    """Validation loss (label-smoothed, like the training loss) and perplexity (exp of the
    per-token NLL, EOS included), each process scoring its share of the batches."""
    bare = unwrap(model)
    was_training = bare.training
    bare.eval()
    batches = token_batches(data.src_lengths, data.tgt_lengths, max_tokens, seed=0)
    totals = torch.zeros(2, dtype=torch.float64, device=processes.device)
    tokens = 0
    for indices in batches[processes.rank::processes.world_size]:
        batch = collate(data, indices)
        tokens += batch.target_count
        batch = batch.to(processes.device)
        with autocast(processes.device, dtype):
            loss, nll = bare(batch.src_tokens, batch.tgt_input,
                             output_positions=batch.target_positions, targets=batch.targets,
                             label_smoothing=epsilon)
        totals += torch.stack([loss, nll]).double()
    totals = torch.cat([totals, torch.tensor([tokens], dtype=torch.float64,
                                             device=processes.device)])
    loss_sum, nll_sum, tokens = all_reduce_sum(totals, processes)
    bare.train(was_training)
    return {"valid_loss": loss_sum / tokens, "valid_nll": nll_sum / tokens,
            "valid_ppl": math.exp(min(nll_sum / tokens, 700))}
