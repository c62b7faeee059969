"""Model configuration, the named presets (paper §3, §5, Table 3, §6.3) and the options of a
training run.

Pure Python, no torch: `attn --help`, shell completion and `--dry-run` planning import this freely.
A `ModelConfig` is the only argument of the model's constructor and is serialised, as JSON, into
every model file. A `Preset` adds the training recipe (dropout, label smoothing, schedule, batch)
to an architecture; presets are immutable and a changed recipe gets a new name. `TrainOptions` are
`attn train`'s options, each declared once with what a resumed run may do with it; `Recipe` is
the preset with the run's overrides.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .errors import AttnError
from .formats import BOS_ID, CONFIG_FORMAT_VERSION, EOS_ID, PAD_ID, UNK_ID

POSITIONS = ("sinusoidal", "learned", "fairseq")


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """The sizes and choices Table 3 varies (defaults: the base model)."""

    encoder_layers: int = 6
    decoder_layers: int = 6
    d_model: int = 512
    d_ff: int = 2048
    heads: int = 8
    d_k: int = 64
    d_v: int = 64
    dropout: float = 0.1  # P_drop: sub-layer outputs and embeddings+positions (§5.4)
    attention_dropout: float = 0.0  # not in the paper's base recipe; an option
    # or "learned" (Table 3 row E); "fairseq" is fairseq's sinusoids (models imported from
    # NLLB-200 and M2M-100: model.fairseq_positions)
    positions: str = "sinusoidal"
    norm: str = "post"  # "post" as published: LayerNorm(x + Dropout(Sublayer(x))); "pre" an option


@dataclass(frozen=True, kw_only=True)
class ModelConfig(Architecture):
    """Everything needed to rebuild the network, and nothing about how it was trained."""

    src_vocab_size: int
    tgt_vocab_size: int
    max_positions: int = 1024  # table size for learned positions; sinusoids extend past it
    share_embeddings: bool = True  # one matrix for source, target and pre-softmax (§3.4)
    pad_id: int = PAD_ID
    unk_id: int = UNK_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    layer_norm_eps: float = 1e-6
    # Options for models made elsewhere (`attn import hf`: OPUS-MT's Marian models); the
    # defaults are the paper's. §3.3's ReLU or "swish" (x·sigmoid(x)) in the feed-forward
    # blocks; biases on the attention projections (the paper's are matrices only); a bias
    # added to the output logits.
    activation: str = "relu"
    attention_bias: bool = False
    output_bias: bool = False
    # Guided alignment (not in the paper: Garg et al. 2019, `attn train --guided-alignment`): the
    # decoder layer (from 0) and the head of it whose encoder-decoder attention was trained to
    # follow word alignments; `attn decode --alignment` reads that head. None: no head was.
    alignment_layer: int | None = None
    alignment_head: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.activation not in ("relu", "swish"):
            problems.append(f"activation must be 'relu' or 'swish', not {self.activation!r}")
        if self.positions not in POSITIONS:
            problems.append(f"positions must be one of {', '.join(POSITIONS)}, not "
                            f"{self.positions!r}")
        if self.norm not in ("post", "pre"):
            problems.append(f"norm must be 'post' or 'pre', not {self.norm!r}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            problems.append("shared embeddings need one vocabulary for source and target")
        if self.d_model % 2:
            problems.append("d_model must be even (sinusoidal positions pair sin and cos)")
        for name in ("encoder_layers", "decoder_layers", "d_model", "d_ff", "heads", "d_k", "d_v"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be positive")
        if (self.alignment_layer is None) != (self.alignment_head is None):
            problems.append("alignment_layer and alignment_head go together")
        elif self.alignment_layer is not None and not (
                0 <= self.alignment_layer < self.decoder_layers
                and 0 <= self.alignment_head < self.heads):
            problems.append(f"alignment_layer {self.alignment_layer} and alignment_head "
                            f"{self.alignment_head} must name one of the {self.decoder_layers} "
                            f"decoder layers (from 0) and one of its {self.heads} heads")
        if problems:
            raise ValueError("; ".join(problems))

    # Written only when not the paper's: a paper model's file stays as earlier attn wrote it
    # (and read it).
    IMPORTED_OPTIONS: ClassVar[dict] = {"activation": "relu", "attention_bias": False,
                                        "output_bias": False}
    # Written only when set: a model trained without guidance is the file it always was.
    GUIDED_FIELDS: ClassVar[dict] = {"alignment_layer": None, "alignment_head": None}

    def to_json(self) -> str:
        left_out = {**self.IMPORTED_OPTIONS, **self.GUIDED_FIELDS}
        fields = {name: value for name, value in dataclasses.asdict(self).items()
                  if name not in left_out or value != left_out[name]}
        return json.dumps({"version": CONFIG_FORMAT_VERSION, **fields}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        fields = json.loads(text)
        version = fields.pop("version", None)
        if version != CONFIG_FORMAT_VERSION:
            raise ValueError(f"model config format version {version!r} is not supported "
                             f"(this attn reads version {CONFIG_FORMAT_VERSION})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown model config fields: {', '.join(unknown)}")
        return cls(**fields)


@dataclass(frozen=True, kw_only=True)
class Preset(Architecture):
    """A named architecture plus the training recipe that goes with it."""

    name: str
    description: str
    label_smoothing: float = 0.1
    warmup_steps: int = 4000
    lr_scale: float = 1.0  # multiplies d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)
    batch_tokens: int = 25000  # per side, per optimizer step, over all processes (§5.1)
    max_steps: int = 100_000
    save_every: str = "10m"
    average_last: int = 5  # checkpoints averaged for inference (§6.1)
    paper_params_millions: float | None = None  # Table 3's count, for --dry-run

    def model_config(self, src_vocab_size: int, tgt_vocab_size: int | None = None,
                     **overrides) -> ModelConfig:
        """The network for a vocabulary; `tgt_vocab_size` only for a separate target vocab."""
        architecture = {field.name: getattr(self, field.name)
                        for field in dataclasses.fields(Architecture)}
        architecture.update(overrides)
        shared = tgt_vocab_size is None
        return ModelConfig(src_vocab_size=src_vocab_size,
                           tgt_vocab_size=src_vocab_size if shared else tgt_vocab_size,
                           share_embeddings=shared, **architecture)


def _layers(n: int) -> dict:
    return {"encoder_layers": n, "decoder_layers": n}


BASE = Preset(name="base", description="Transformer base, Table 3 first row (65M params)",
              paper_params_millions=65)

# Table 3: every row varies the base model; empty cells equal base. Rows (A) keep the computation
# constant (d_k = d_v = d_model / h); row (B) changes d_k only. The last field is Table 3's
# parameter count (blank cells equal base's 65M).
_TABLE3_ROWS = {
    "base-A1": ("(A) h=1, d_k=d_v=512", dict(heads=1, d_k=512, d_v=512), 65),
    "base-A2": ("(A) h=4, d_k=d_v=128", dict(heads=4, d_k=128, d_v=128), 65),
    "base-A3": ("(A) h=16, d_k=d_v=32", dict(heads=16, d_k=32, d_v=32), 65),
    "base-A4": ("(A) h=32, d_k=d_v=16", dict(heads=32, d_k=16, d_v=16), 65),
    "base-B1": ("(B) d_k=16", dict(d_k=16), 58),
    "base-B2": ("(B) d_k=32", dict(d_k=32), 60),
    "base-C1": ("(C) N=2", _layers(2), 36),
    "base-C2": ("(C) N=4", _layers(4), 50),
    "base-C3": ("(C) N=8", _layers(8), 80),
    "base-C4": ("(C) d_model=256, d_k=d_v=32", dict(d_model=256, d_k=32, d_v=32), 28),
    "base-C5": ("(C) d_model=1024, d_k=d_v=128", dict(d_model=1024, d_k=128, d_v=128), 168),
    "base-C6": ("(C) d_ff=1024", dict(d_ff=1024), 53),
    "base-C7": ("(C) d_ff=4096", dict(d_ff=4096), 90),
    "base-D1": ("(D) P_drop=0.0", dict(dropout=0.0), 65),
    "base-D2": ("(D) P_drop=0.2", dict(dropout=0.2), 65),
    "base-D3": ("(D) eps_ls=0.0", dict(label_smoothing=0.0), 65),
    "base-D4": ("(D) eps_ls=0.2", dict(label_smoothing=0.2), 65),
    "base-E": ("(E) learned positional embedding instead of sinusoids",
               dict(positions="learned"), 65),
}

PRESETS: dict[str, Preset] = {"base": BASE}
for _name, (_what, _changes, _params) in _TABLE3_ROWS.items():
    PRESETS[_name] = dataclasses.replace(
        BASE, name=_name, description=f"Table 3 row {_what}",
        paper_params_millions=_params, **_changes)

PRESETS["big"] = dataclasses.replace(
    BASE, name="big", description="Transformer big, Table 3 last row (213M params)",
    d_model=1024, d_ff=4096, heads=16, dropout=0.3, max_steps=300_000, average_last=20,
    paper_params_millions=213)
PRESETS["big-enfr"] = dataclasses.replace(
    PRESETS["big"], name="big-enfr",
    description="Transformer big for WMT14 en-fr (P_drop 0.1, §5.4)",
    dropout=0.1, paper_params_millions=None)

# §6.3: 4 layers, d_model 1024, "the rest as the en-de base model". We keep d_k = 64 (16 heads)
# and d_ff = 4 · d_model as base does; dropout (residual and attention) is what the paper tuned on
# section 22, and 0.2 is our starting point for WSJ-only training.
PRESETS["parse-wsj"] = dataclasses.replace(
    BASE, name="parse-wsj", description="Constituency parsing, §6.3 (4 layers, d_model 1024)",
    encoder_layers=4, decoder_layers=4, d_model=1024, d_ff=4096, heads=16, dropout=0.2,
    attention_dropout=0.2, paper_params_millions=None)

# CPU presets: the paper's recipe at a size a laptop trains in minutes. Their warmup and learning
# rate suit their much smaller batches (with warmup 4000 a 20-minute CPU run never leaves warmup).
PRESETS["small"] = dataclasses.replace(
    BASE, name="small", description="CPU demo/benchmark model: 3+3 layers, d_model 256, 4 heads",
    encoder_layers=3, decoder_layers=3, d_model=256, d_ff=1024, heads=4, d_k=64, d_v=64,
    dropout=0.1, warmup_steps=400, lr_scale=0.7, batch_tokens=3000, max_steps=20_000,
    save_every="2m", paper_params_millions=None)
# Parsing on a CPU: the `small` architecture, with more dropout for a small treebank.
PRESETS["parse-small"] = dataclasses.replace(
    PRESETS["small"], name="parse-small",
    description="CPU parsing model: 3+3 layers, d_model 256, dropout 0.3 (small treebanks)",
    dropout=0.3, attention_dropout=0.1)
PRESETS["tiny"] = dataclasses.replace(
    BASE, name="tiny", description="Test-sized model: 2+2 layers, d_model 64, 4 heads",
    encoder_layers=2, decoder_layers=2, d_model=64, d_ff=256, heads=4, d_k=16, d_v=16,
    dropout=0.1, warmup_steps=200, lr_scale=0.5, batch_tokens=2000, max_steps=2000,
    save_every="1m", paper_params_millions=None)


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; choose from: {', '.join(PRESETS)}") from None


# ------------------------------------------------------------------------ a training run's options

# What a resumed run may do with an option; every field of TrainOptions names one.
RECIPE = "recipe"  # it changes what is learned: a resume that changes it says so
FREE = "free"  # it does not (when to stop or save, where to write, the precision, ...)
PER_NODE = "per node"  # a path, which may differ from node to node (free on resume too): the
#                        processes compare the file's contents, not the path


def _option(default=dataclasses.MISSING, *, on_resume: str = RECIPE):
    return dataclasses.field(default=default, metadata={"on_resume": on_resume})


@dataclass(frozen=True)
class TrainOptions:
    """`attn train`'s options under their command-line names (--dist-timeout is
    dist_timeout_minutes), with the CLI's defaults. A new option is a field here, with what a
    resumed run may do with it, and a parameter of the `train` command (a test holds the two
    together); resuming, the processes' agreement and --dry-run read it from here."""

    data: Path | None = _option(on_resume=PER_NODE)
    output: Path | None = _option(on_resume=PER_NODE)
    # Several corpora: the data files after the first, each drawn from by its --weights (one a
    # file, "1,1,4"; None: by size, the corpora concatenated) (batching.CorpusMix).
    more_data: tuple[Path, ...] | None = _option(None, on_resume=PER_NODE)
    weights: str | None = _option(None)
    preset: str = _option("base")
    # fine-tuning: the model file a new run starts from (weights and architecture; the preset
    # then gives the recipe only); a resumed run goes on from its checkpoint instead
    init: Path | None = _option(None, on_resume=PER_NODE)
    valid: Path | None = _option(None, on_resume=PER_NODE)
    valid_metric: str = _option("loss", on_resume=FREE)  # formats.VALID_METRICS
    valid_beam: int = _option(1, on_resume=FREE)
    # references (text or gold trees); None: valid's targets
    valid_ref: Path | None = _option(None, on_resume=PER_NODE)
    batch_tokens: int | None = _option(None)  # None: the preset's
    max_tokens: int | None = _option(None, on_resume=FREE)
    max_steps: int | None = _option(None, on_resume=FREE)
    max_time: str | None = _option(None, on_resume=FREE)
    save_every: str | None = _option(None, on_resume=FREE)
    keep: int = _option(20, on_resume=FREE)
    keep_best: int = _option(0, on_resume=FREE)  # also kept: this many best by valid_metric
    # stop after this many validations in a row without a new best by valid_metric; 0: never
    patience: int = _option(0, on_resume=FREE)
    keep_state: int = _option(1, on_resume=FREE)  # training states kept: the newest N
    seed: int = _option(1)
    device: str = _option("auto", on_resume=FREE)
    dtype: str = _option("auto", on_resume=FREE)
    lr_scale: float | None = _option(None)
    warmup: int | None = _option(None)
    label_smoothing: float | None = _option(None)
    dropout: float | None = _option(None)
    log_every: int = _option(100, on_resume=FREE)
    resume: bool = _option(False, on_resume=FREE)
    reset_optimizer: bool = _option(False, on_resume=FREE)
    reset_schedule: bool = _option(False, on_resume=FREE)
    dist_timeout_minutes: float = _option(30.0, on_resume=FREE)
    # the process group's start and first collective, bounded (distributed.start_watchdog)
    start_timeout_minutes: float = _option(5.0, on_resume=FREE)
    # the gradients' precision in DDP's all-reduce: auto is bf16 between nodes on GPUs, fp32 else
    grad_sync: str = _option("auto", on_resume=FREE)  # distributed.GRAD_SYNC
    # off: attention never on cuDNN's kernels (CUDA; devices.choose_cudnn_attention says why)
    cudnn_attention: str = _option("off", on_resume=FREE)
    # each encoder and decoder layer through torch.compile: on, off, auto (on a GPU when a
    # forward pass holds >= 12,500 tokens; train/compiled.py says why)
    compile: str = _option("auto", on_resume=FREE)  # formats.TRAIN_COMPILE
    # The network over the preset's (None: the preset's): `architecture()` checks them and
    # derives d_k = d_v = d_model / heads where d_model or heads changed; a resume with other
    # values is refused (start.check_resume), and the model file names them ("small +
    # decoder_layers=1").
    encoder_layers: int | None = _option(None)
    decoder_layers: int | None = _option(None)
    d_model: int | None = _option(None)
    d_ff: int | None = _option(None)
    heads: int | None = _option(None)
    d_k: int | None = _option(None)
    d_v: int | None = _option(None)
    norm: str | None = _option(None)  # "post" (the paper's) or "pre"
    positions: str | None = _option(None)  # "sinusoidal" (the paper's) or "learned"
    # Guided alignment (Garg et al. 2019; not in the paper): the data file's word alignments
    # (`attn binarize --alignments`) supervise one encoder-decoder attention head, adding
    # alignment_lambda × its cross-entropy with them to the loss (train/guided.py).
    guided_alignment: bool = _option(False)
    alignment_lambda: float = _option(0.05)
    alignment_layer: int = _option(-2)  # a Python index over the decoder layers: penultimate
    alignment_head: int = _option(0)

    def __post_init__(self):
        if self.more_data is not None:  # the command line's list; none is None
            object.__setattr__(self, "more_data", tuple(map(Path, self.more_data)) or None)

    @property
    def data_files(self) -> list[Path]:
        """Every training data file, in the order given."""
        return [path for path in (self.data, *(self.more_data or ())) if path is not None]

    def recipe(self) -> "Recipe":
        """The preset with this run's overrides: what the run actually uses."""
        return Recipe.from_preset(get_preset(self.preset), **{
            name: getattr(self, name) for name in Recipe.PRESET_FIELDS})

    def architecture(self) -> dict:
        """The architecture options given, over the preset's network: {field: value}, with d_k
        and d_v derived as d_model / heads where d_model or heads was given and they were
        not. AttnError, in one line, where they do not make a network."""
        given = {name: getattr(self, name) for name in ARCHITECTURE_OPTIONS
                 if getattr(self, name) is not None}
        if not given:
            return {}
        preset = get_preset(self.preset)
        for name, value in given.items():
            if name in ("norm", "positions"):
                allowed = ARCHITECTURE_CHOICES[name]
                if value not in allowed:
                    raise AttnError(f"--{name} must be one of {', '.join(allowed)}, not "
                                    f"{value!r}")
            elif not isinstance(value, int) or value < 1:
                raise AttnError(f"--{name.replace('_', '-')} must be a whole number of at "
                                f"least 1, not {value!r}")
        d_model = given.get("d_model", preset.d_model)
        heads = given.get("heads", preset.heads)
        if "d_model" in given or "heads" in given:
            missing = [name for name in ("d_k", "d_v") if name not in given]
            if missing and d_model % heads:
                raise AttnError(f"--d-model {d_model} is not divisible by --heads {heads}: "
                                "each head gets d_model / heads dimensions; choose a d_model "
                                "that heads divide, or give --d-k and --d-v")
            given.update({name: d_model // heads for name in missing})
        return given

    def architecture_name(self) -> str:
        """The preset's name and what changed of its network: "small + decoder_layers=1"."""
        changed = self.architecture()
        return self.preset + "".join(f" + {name}={value}" for name, value in changed.items())

    def record(self) -> dict:
        """Every option, the recipe's filled in, as JSON values: what a checkpoint keeps to tell
        a resumed run what it changes."""
        filled = {**dataclasses.asdict(self), **dataclasses.asdict(self.recipe())}
        return {key: str(value) if isinstance(value, Path) else
                [str(path) for path in value] if isinstance(value, tuple) else value
                for key, value in filled.items()}


# `attn train`'s options over a preset's network (TrainOptions.architecture)
ARCHITECTURE_OPTIONS = ("encoder_layers", "decoder_layers", "d_model", "d_ff", "heads", "d_k",
                        "d_v", "norm", "positions")
ARCHITECTURE_CHOICES = {"norm": ("post", "pre"), "positions": ("sinusoidal", "learned")}


def train_options_where(on_resume: str) -> frozenset[str]:
    """The names of the options a resumed run may treat as `on_resume` says."""
    return frozenset(field.name for field in dataclasses.fields(TrainOptions)
                     if field.metadata["on_resume"] == on_resume)


# A resumed run may change these without a --reset flag (they do not alter what was learned).
FREELY_CHANGED = train_options_where(FREE) | train_options_where(PER_NODE)
# Left out of what every process must share with rank 0 (the files' contents are compared).
PER_NODE_OPTIONS = train_options_where(PER_NODE)
TRAIN_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TrainOptions)}


@dataclass(frozen=True)
class Recipe:
    """§5's numbers for a run: the preset's, where an option does not override them. The field
    names are the option names."""

    batch_tokens: int  # per side, per step, over all processes
    max_steps: int
    save_every: str  # a time (10m) or steps (5000)
    lr_scale: float
    warmup: int
    label_smoothing: float
    dropout: float

    # option (field) name → the preset's field
    PRESET_FIELDS: ClassVar[dict[str, str]] = {
        "batch_tokens": "batch_tokens", "max_steps": "max_steps", "save_every": "save_every",
        "lr_scale": "lr_scale", "warmup": "warmup_steps", "label_smoothing": "label_smoothing",
        "dropout": "dropout"}

    @classmethod
    def from_preset(cls, preset: Preset, **overrides) -> "Recipe":
        """The preset's recipe, with the overrides that are not None."""
        return cls(**{name: getattr(preset, field) if overrides.get(name) is None
                      else overrides[name] for name, field in cls.PRESET_FIELDS.items()})


def parse_interval(text: str) -> tuple[float, str]:
    """'10m', '90s', '2h' → (seconds, 'time'); '5000' or '5000u' → (steps, 'steps')."""
    text = text.strip().lower()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]], "time"
        return float(int(text.rstrip("u"))), "steps"
    except ValueError:
        raise AttnError(f"cannot read the interval {text!r}: use steps (5000) or a time "
                        "(30s, 10m, 12h)") from None


# ---------------------------------------------------------------------- search settings' bounds
# The highest values of the search settings that nothing else bounds, for every caller
# (decode/options.py's RANGES checks them; the commands' options name them): each keeps the
# search's arithmetic finite and its work bounded. Here, not in decode/options.py, so that the
# commands read them without importing torch.

# Outputs of up to 10 × the source's tokens (+ b): a target written in much smaller pieces than
# its source needs 2-4 ×; the most steps a search can then take is 10 × 1023 + b.
MAX_LEN_A_HIGHEST = 10.0
# The length penalty ((5 + |Y|) / 6)^α, at most (14,331 / 6)^10 ≈ 6e33 for the longest output a
# server allows (10 × 1023 + 4096 tokens), stays finite in float32 (3.4e38); GNMT tuned α within
# 0.2-1, the paper's parsing 0.3.
ALPHA_HIGHEST = 10.0
# log p / T, in float32: at T 1e-3 the most probable token's (at least -log V, about -10) is
# still finite, as the softmax needs (and sampling is greedy to float precision already); above
# 1e3 the distribution is uniform to float precision. 5e-324 is 0 in float32 and 1e308 infinite:
# every token's score was -inf or NaN.
TEMPERATURE_RANGE = (1e-3, 1e3)

# ------------------------------------------------------------------------------- attn serve

MAX_LEN_B = 4096  # the longest outputs a server searches for (each step costs)


@dataclass(frozen=True)
class ServeOptions:
    """What `attn serve` takes besides the models and their search settings; its defaults are
    the command's."""

    host: str = "127.0.0.1"
    port: int = 8080
    name: str | None = None  # the model's id in requests and /v1/models (default: file stems)
    langs: tuple[str, str] | None = None  # (source, target) codes
    api_key: str | None = None
    # a file of API keys, each with its own request rate and character limit (serve/keys.py)
    api_keys: Path | None = None
    max_body: int = 1 << 20  # bytes
    max_lines: int = 1000  # lines (split: sentences) searched for one request
    max_line_chars: int = 10_000
    # LibreTranslate's --char-limit: the characters of all the texts of one /translate or
    # /detect request (-1: no limit); /frontend/settings tells web pages as `charLimit`.
    char_limit: int = 10_000
    queue_lines: int = 10_000  # lines waiting for a search worker, all requests together
    max_beam: int = 32
    gather_ms: float = 3.0
    # Connections (serve/http.py): past max_connections open, the one idle, or without a
    # complete request, the longest is closed to make room (503 to the latter); those being
    # answered are kept, and a burst may pass the cap for a moment (503 past twice it).
    # A request's line and headers must arrive within header_timeout seconds of their first
    # byte and be at most max_header_bytes (431), its body within body_timeout of the headers
    # (408 past either, in all, not between reads); a connection that sends nothing for
    # idle_timeout, new or between requests, is closed.
    max_connections: int = 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 5.0
    max_header_bytes: int = 16_384
    # What one request's search may cost (Translator.search_work: hypothesis steps, every beam
    # counted, each position weighed by the cache it reads): max_request_tokens where given,
    # else what one search worker does in max_request_seconds on this machine and model,
    # measured when the model loads (the demo model on one Zen 4 thread: ~4,500 a second,
    # so 5 s is ~22,600: a request of --char-limit's 10,000 characters at beam 4 passes, one
    # line at beam 32 to 4,096 positions, 1.3 million, is refused at once).
    max_request_tokens: int = 0
    max_request_seconds: float = 5.0
    # Seconds a request may wait and be searched once its body is read (504 past them): far
    # above a request of --max-lines at the defaults (the demo model decodes 1,000 lines at
    # beam 4 in 4-5 s on 2 cores: benchmarks/README.md).
    request_timeout: float = 60.0
    # serve/operations.py: lines whose outputs are kept (0: no cache); requests a minute per
    # client, the API key it sends or its address (0: no limit; LibreTranslate's --req-limit);
    # the Bearer token GET /metrics needs (None: /metrics is open, outside --api-key).
    cache_lines: int = 10_000
    req_limit: int = 0
    metrics_auth_token: str | None = None

    def __post_init__(self) -> None:
        if self.queue_lines < self.max_lines:
            raise AttnError(f"--queue-lines ({self.queue_lines}) must hold a request of "
                            f"--max-lines ({self.max_lines})")
        for option, seconds in (("--header-timeout", self.header_timeout),
                                ("--body-timeout", self.body_timeout),
                                ("--idle-timeout", self.idle_timeout)):
            if not 0 < seconds < math.inf:  # NaN too
                raise AttnError(f"{option} must be a finite number of seconds above 0, not "
                                f"{seconds}")
        if not 0 < self.max_request_seconds < math.inf:  # NaN too
            raise AttnError(f"--max-request-seconds must be a finite number of seconds above "
                            f"0, not {self.max_request_seconds}")
        if not 0 < self.request_timeout < math.inf:  # NaN too
            raise AttnError(f"--request-timeout must be a finite number of seconds above 0, "
                            f"not {self.request_timeout}")
        if self.char_limit == 0 or self.char_limit < -1:
            raise AttnError(f"--char-limit must be at least 1, or -1 for no limit, not "
                            f"{self.char_limit}")

    def check_defaults(self, beam: int, max_len_b: int) -> None:
        """The server's own search settings (--beam, --max-len-b) within what it lets a request
        ask for. Plain numbers, not a DecodeOptions: `attn serve` checks them before torch is
        imported (see serve/server.py's `serve`)."""
        if beam > self.max_beam:
            raise AttnError(f"--beam ({beam}) is above --max-beam ({self.max_beam}): raise "
                            "--max-beam or lower --beam")
        if max_len_b > MAX_LEN_B:
            raise AttnError(f"--max-len-b must be at most {MAX_LEN_B}")


SERVE_DEFAULTS = {option.name: option.default for option in dataclasses.fields(ServeOptions)}


def parse_langs(value: str | None) -> tuple[str, str] | None:
    """'en-de' → ('en', 'de')."""
    if value is None:
        return None
    source, _, target = value.partition("-")
    if not source or not target or "-" in target:
        raise AttnError(f"--langs takes SOURCE-TARGET language codes, e.g. en-de, not {value!r}")
    return source, target
