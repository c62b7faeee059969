"""How `attn decode`, `attn parse` and `attn serve` search: every setting with its range, checked
as the settings are made (`DecodeOptions`), and what a decode reports (`DecodeStats`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..batching import source_budget
from ..config import ALPHA_HIGHEST, MAX_LEN_A_HIGHEST, TEMPERATURE_RANGE
from ..errors import AttnError
from ..formats import BUFFER_SIZE, TRANSLATION, Stop

# Each numeric setting's range: (lowest, highest, whether the lowest itself is allowed); None: no
# bound. The one check of them, for every caller: the library, `attn serve`'s requests (whose
# fields have these names) and the commands (whose options Typer bounds
# first, where it can: not a float's finiteness, nor a lowest value excluded). The highest
# alpha, max_len_a and temperature keep the search finite (config.py says why each).
RANGES = {"beam": (1, None, True), "nbest": (1, None, True),
          "alpha": (0.0, ALPHA_HIGHEST, True), "max_len_a": (0.0, MAX_LEN_A_HIGHEST, True),
          "max_len_b": (0, None, True), "topk": (0, None, True), "topp": (0, 1, False),
          "temperature": (*TEMPERATURE_RANGE, True),
          "batch_tokens": (1, None, True), "buffer_size": (1, None, True),
          "workers": (1, None, True), "worker_threads": (1, None, True)}


class OutOfRange(AttnError):
    """A search setting outside its range, named as the command line spells it (`--max-len-a
    must be a finite number`); `field` and `rule` let the server name its JSON field instead."""

    def __init__(self, field: str, rule: str):
        super().__init__(f"--{field.replace('_', '-')} {rule}")
        self.field, self.rule = field, rule


def check_range(name: str, value) -> None:
    """`value` within RANGES[name] (a float also finite), or OutOfRange."""
    if value is None:  # batch_tokens: chosen for the device later
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise OutOfRange(name, "must be a finite number")
    lowest, highest, lowest_allowed = RANGES[name]
    if lowest is not None and (value < lowest or (value == lowest and not lowest_allowed)):
        raise OutOfRange(name, f"must be {'at least' if lowest_allowed else 'above'} {lowest}")
    if highest is not None and value > highest:
        raise OutOfRange(name, f"must be at most {highest}")


CONSTRAINT_SEARCHES = ("misses", "all")


@dataclass(frozen=True)
class DecodeOptions:
    """How `attn decode` and `attn parse` search (or sample), checked as they are made: each
    setting's range (RANGES), then the settings that go together."""

    beam: int = TRANSLATION.beam
    alpha: float = TRANSLATION.alpha
    max_len_a: float = TRANSLATION.max_len_a
    max_len_b: int = TRANSLATION.max_len_b
    nbest: int = 1
    stop: Stop = Stop.bound
    # Sampling instead of search (`search.sample`): for back-translation.
    sample: bool = False
    topk: int = 0  # 0: every token
    topp: float = 1.0
    temperature: float = 1.0
    seed: int = 1
    # source tokens × beam held by one search batch; None: devices.search_batch_tokens
    batch_tokens: int | None = None
    buffer_size: int = BUFFER_SIZE
    raw: bool = False
    # Which sentences with phrases to hold are searched with them (`Translator.search_controlled`):
    # "misses", those whose free output misses one; "all".
    constraint_search: str = "misses"
    workers: int = 1  # batches searched at once, each by its own thread
    worker_threads: int = 1  # torch threads of each of those
    # Ids put before every source line: a target language's tag (`--target-lang`, tags.py).
    source_tags: tuple[int, ...] = ()
    # Ids every output starts with, forced and then taken off it: the target language's code
    # of a model whose languages are tokens (NLLB-200, M2M-100: `Translator.with_target`).
    target_start: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in RANGES:
            check_range(name, getattr(self, name))
        if self.sample and self.nbest > 1:
            raise AttnError("--nbest needs beam search, not --sample (sample again with "
                            "another --seed for more outputs)")
        if (self.topk or self.topp < 1.0 or self.temperature != 1.0) and not self.sample:
            raise AttnError("--topk, --topp and --temperature apply to --sample only")
        if self.constraint_search not in CONSTRAINT_SEARCHES:
            raise AttnError(f"--constraint-search is one of {', '.join(CONSTRAINT_SEARCHES)}, "
                            f"not {self.constraint_search!r}")

    @property
    def source_budget(self) -> int:
        """Source tokens of one search batch, padding included (batching's one rule)."""
        return source_budget(self.batch_tokens, 1 if self.sample else self.beam)


@dataclass
class DecodeStats:
    sentences: int = 0
    output_tokens: int = 0  # EOS included
    seconds: float = 0.0
    truncated: int = 0
    replaced: int = 0  # lines whose invalid UTF-8 was replaced by U+FFFD
    # --split-sentences: the non-empty lines the sentences were cut from (None: not split, each
    # non-empty line searched as one sentence)
    split_lines: int | None = None
    # --shortlist: batches searched, and the target pieces they could write, summed
    shortlist_batches: int = 0
    shortlist_pieces: int = 0

    @property
    def shortlist_mean(self) -> float | None:
        """The target pieces a batch could write, on average (None: no shortlist)."""
        return self.shortlist_pieces / self.shortlist_batches if self.shortlist_batches else None

    def record(self) -> dict:
        """The summary as one JSON object (`--stats-json`)."""
        split = {} if self.split_lines is None else {"split_lines": self.split_lines}
        shortlist = {} if self.shortlist_mean is None else \
            {"shortlist_pieces_per_batch": self.shortlist_mean}
        return {"sentences": self.sentences, **split, "output_tokens": self.output_tokens,
                "seconds": self.seconds,
                "sentences_per_s": self.sentences / max(self.seconds, 1e-9),
                "tokens_per_s": self.output_tokens / self.seconds if self.seconds else 0.0,
                "truncated": self.truncated, "replaced": self.replaced, **shortlist}

    def summary(self) -> str:
        rate = self.output_tokens / self.seconds if self.seconds else 0.0
        notes = [f"{self.truncated} truncated"] if self.truncated else []
        notes += [f"{self.replaced} with invalid UTF-8 replaced"] if self.replaced else []
        if self.shortlist_mean is not None:
            notes += [f"shortlist: {self.shortlist_mean:.0f} target pieces a batch"]
        split = "" if self.split_lines is None else f" cut from {self.split_lines} lines"
        return (f"{self.sentences} sentences{split}, {self.output_tokens} output tokens (EOS "
                f"included) in {self.seconds:.2f}s: {self.sentences / max(self.seconds, 1e-9):.1f}"
                f" sentences/s, {rate:.0f} tokens/s"
                + (f" ({', '.join(notes)})" if notes else ""))
