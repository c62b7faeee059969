"""What attn's files, commands, library and benchmarks agree on, named once: the file formats and
their versions, the tensor names inside them, the fixed special ids, and the paper's search
settings that `decode`, `parse` and the Python API default to. Pure Python (no torch, no numpy),
so that anything may import it, `benchmarks/` included.

A file format changes only with its version: a reader refuses a version it does not know rather
than guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# ------------------------------------------------------- file formats (safetensors metadata)

MODEL_FORMAT = "attn-model"  # checkpoint-STEP.st, averaged model.st
MODEL_FORMAT_VERSION = "1"
DATA_FORMAT = "attn-data"  # `attn binarize`
DATA_FORMAT_VERSION = "1"
STATE_FORMAT = "attn-train-state"  # checkpoint-STEP.state.st
STATE_FORMAT_VERSION = "2"  # 2: schedule_offset, batch_plan and earlier_budgets always present
CONFIG_FORMAT_VERSION = 1  # the model config's JSON, inside every model file

ATTENTION_FORMAT = "attn-attention"  # `attn decode --attention`
ATTENTION_FORMAT_VERSION = "1"

FORMAT_DESCRIPTIONS = {
    MODEL_FORMAT: "an attn model file",
    DATA_FORMAT: "a data file from `attn binarize`",
    STATE_FORMAT: "an attn training state",
    ATTENTION_FORMAT: "attention maps from `attn decode --attention`",
}
FORMAT_VERSIONS = {MODEL_FORMAT: MODEL_FORMAT_VERSION, DATA_FORMAT: DATA_FORMAT_VERSION,
                   STATE_FORMAT: STATE_FORMAT_VERSION, ATTENTION_FORMAT: ATTENTION_FORMAT_VERSION}

# ------------------------------------------------------------------------------ tensor names

SIDES = ("src", "tgt")


def vocab_tensor(side: str) -> str:
    """The SentencePiece model bytes (uint8) of a side; model and data files carry `vocab.src`,
    and `vocab.tgt` only when the target vocabulary is separate."""
    return f"vocab.{side}"


VOCAB_TENSORS = tuple(vocab_tensor(side) for side in SIDES)


def ids_tensor(side: str) -> str:
    """Data files: a side's token ids end to end (int32, no BOS/EOS)."""
    return f"{side}.ids"


def offsets_tensor(side: str) -> str:
    """Data files: n+1 offsets (int64); sentence i is ids[offsets[i]:offsets[i+1]]."""
    return f"{side}.offsets"


# Data files made with `attn binarize --alignments`: pair i's word alignment as (source piece,
# target piece) rows, pairs[offsets[i]:offsets[i+1]] (offsets int64, n+1; pairs (m, 2) int16, or
# int32 where --max-len is 32,768 or more).
ALIGNMENT_OFFSETS = "align.offsets"
ALIGNMENT_PAIRS = "align.pairs"


# Model files store a shared embedding (source, target, pre-softmax: §3.4) once, under this name.
SHARED_EMBEDDING = "tgt_embed.weight"
SOURCE_EMBEDDING = "src_embed.weight"


def adam_tensor(moment: str, parameter: str) -> str:
    """State files: Adam's `exp_avg`, `exp_avg_sq` and `step` of a parameter, by its name."""
    return f"{moment}.{parameter}"


ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")

# `attn score --tokenize compound-split`: the paper's tokenized BLEU, hyphenated compounds split
# (compound_bleu.py), offered beside sacreBLEU's tokenizers.
COMPOUND_SPLIT = "compound-split"
# sacreBLEU's tokenizers (`attn score --tokenize`)
TOKENIZERS = ("13a", "intl", "none", "zh", "ja-mecab", "ko-mecab", "char", "flores101",
              "flores200")
# What a parse tree's leaves are in a model's output (parse/trees.py)
TERMINALS = ("placeholders", "words")

# ------------------------------------------------------------------------------- run directory

METRICS_FILE = "metrics.jsonl"
# What `attn train --valid-metric` scores a run by (train/validation.py), and which way is better.
VALID_METRICS = {"loss": "lower", "bleu": "higher", "chrf": "higher", "f1": "higher"}
# `train --grad-sync`: the precision of the gradients' all-reduce (train/distributed.py)
GRAD_SYNC = ("auto", "fp32", "bf16")
# `train --cudnn-attention`: whether attention may run on cuDNN's kernels (off, the default of
# every command: never; auto: torch decides; devices.choose_cudnn_attention says why)
CUDNN_ATTENTION = ("off", "auto")
# `train --compile`: each layer through torch's compiler (train/compiled.py)
TRAIN_COMPILE = ("auto", "on", "off")

# ------------------------------------------------------------------ vocabulary: fixed special ids

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPECIAL_PIECES = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}

# -------------------------------------------------------------------------------- search settings


@dataclass(frozen=True)
class SearchDefaults:
    """Beam size, length penalty α and output limit a·|x| + b, as the paper gives them."""

    beam: int
    alpha: float
    max_len_a: float
    max_len_b: int


TRANSLATION = SearchDefaults(beam=4, alpha=0.6, max_len_a=1.0, max_len_b=50)  # §6.1
PARSING = SearchDefaults(beam=21, alpha=0.3, max_len_a=1.0, max_len_b=300)  # §6.3


class Stop(str, Enum):
    """When a sentence's beam search ends (`beam_search`'s `stop`).

    bound: once no live hypothesis can beat the n-th best finished one (`can_stop`), as
        tensor2tensor, the paper's code, does: exact, the answer of a search run to the
        length limit. The default.
    patience: once K hypotheses have ended (K the beam; every EOS among a step's first K
        candidates counts, whatever its score), as fairseq does and CTranslate2 does at a
        length penalty α ≠ 0 (its `patience` 1): 10% fewer decoder rows at beam 4 on the
        Multi30k demo. Inexact: a longer hypothesis that would have scored better can be
        missed.
    best-ends: once the step's best candidate ends and n hypotheses are finished, as
        OpenNMT-py does and CTranslate2 only at α = 0: 21% fewer decoder rows on the demo;
        inexact as patience is, more often.
    limit: every sentence runs to its length limit (what `bound` must equal; slow).
    Greedy search (beam 1) ends at the first EOS under each."""

    bound = "bound"
    patience = "patience"
    best_ends = "best-ends"
    limit = "limit"


# `attn parse --constrain --score-words`: how a parse with word terminals scores the input's
# words (tree_search.TreeConstraint).
WORD_SCORES = ("given", "joint")

# `decode --compile`: the search steps through `compiled.StepDecoder`, compiled ("on"), or
# the model's own eager step ("off"; "auto" is "off": on the CPUs measured the compiled step
# was no faster, and compiling it takes 6-30 s a run; benchmarks/README.md).
COMPILE_MODES = ("off", "on", "auto")
# `--step`: what runs a decoder step on a CPU: auto (the C++ step where it covers the model and
# builds, else the eager one; float32 models with the fused kernels), native (the same, saying
# so where it cannot), aten (the C++ step calling torch's ops, the eager step's logits bit for
# bit), eager (torch's ops from Python, model.Transformer.decode_step).
STEP_MODES = ("auto", "native", "aten", "eager")

BATCH_TOKENS = 8000  # source tokens × beam held by one search batch (score -m: tokens per batch)
# ... on a GPU: a search step is a few small kernels per layer, so a batch must hold many
# sentences to keep it busy (8000 at beam 4 is ~65 sentences; 64000, ~500: a few GB of keys and
# values for `big`). `score -m` keeps BATCH_TOKENS: it holds every position's logits at once.
GPU_BATCH_TOKENS = 64000
BUFFER_SIZE = 2000  # lines read ahead and sorted by length
# Longest source a model with sinusoidal positions takes, EOS not counted (learned positions:
# the table's size less one).
MAX_SOURCE_TOKENS = 1023
