"""NLLB-200 and M2M-100 (Fan et al. 2020; NLLB Team 2022) through `attn import hf`: both are
`M2M100ForConditionalGeneration` in `transformers`, the paper's Transformer with fairseq's
switches, each of which attn has as an option:
- pre-norm, with a LayerNorm after the last encoder layer and after the last decoder layer
  (`ModelConfig.norm` "pre");
- fairseq's sinusoidal positions, counted from the padding id + 1 (`positions` "fairseq",
  model.fairseq_positions);
- biases on every attention projection (`attention_bias`), LayerNorm epsilon 1e-5, ReLU;
- embeddings scaled by sqrt(d_model) and one matrix for source, target and the output
  projection, as §3.4.

Languages are tokens of the vocabulary (NLLB's `fra_Latn`, M2M-100's `__fr__`): the source's
code starts the source, and the target's is forced as the first output token, after the
decoder's start (EOS); `generate(forced_bos_token_id=...)` does the same. The model file says
which spelling it uses (metadata `lang_codes`: "nllb" or "m2m100"), and `attn decode
--source-lang/--target-lang` and `attn serve -m en-fr,en-de=nllb.st` take either the model's
own codes or ISO 639-1 ones (tags.forced_language_code).

The vocabulary: the tokenizer's SentencePiece model (`sentencepiece.bpe.model`, which both
ship) cuts the text, and the tokenizer's own ids (fairseq's: <s> 0, <pad> 1, </s> 2, <unk> 3,
SentencePiece's pieces one further on, the language codes after them) name the pieces
(`Vocabulary.with_pieces`). The weights are read from the directory's safetensors files
without building the `transformers` model (NLLB-200's 600M parameters are read once).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ..config import ModelConfig
from ..errors import AttnError
from ..formats import SHARED_EMBEDDING, SOURCE_EMBEDDING
from ..vocab import Vocabulary

M2M_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which M2M100's layers use
SPM_FILE = "sentencepiece.bpe.model"
UNUSED = "<unused-"  # the piece of an id the tokenizer does not name: <unused-256204>

# Each layer's modules, attn's beside M2M100's (the layer's prefix left off): attn fuses the
# projections M2M100 keeps apart (several names: the attn matrix is theirs stacked by rows).
SELF_ATTENTION = [("self_attn.qkv_proj", [f"self_attn.{x}_proj" for x in "qkv"]),
                  ("self_attn.out_proj", ["self_attn.out_proj"])]
ENCODER_LAYER = [*SELF_ATTENTION, ("sub.norms.0", ["self_attn_layer_norm"]),
                 ("ffn.inner", ["fc1"]), ("ffn.outer", ["fc2"]),
                 ("sub.norms.1", ["final_layer_norm"])]
DECODER_LAYER = [*SELF_ATTENTION, ("sub.norms.0", ["self_attn_layer_norm"]),
                 ("cross_attn.q_proj", ["encoder_attn.q_proj"]),
                 ("cross_attn.kv_proj", ["encoder_attn.k_proj", "encoder_attn.v_proj"]),
                 ("cross_attn.out_proj", ["encoder_attn.out_proj"]),
                 ("sub.norms.1", ["encoder_attn_layer_norm"]),
                 ("ffn.inner", ["fc1"]), ("ffn.outer", ["fc2"]),
                 ("sub.norms.2", ["final_layer_norm"])]


def mapping(config: ModelConfig) -> list[tuple[str, list[str]]]:
    """Every attn tensor with the M2M100 tensors it is made of (stacked by rows)."""
    rows = [(SHARED_EMBEDDING, ["model.shared.weight"]),
            ("encoder_norm.weight", ["model.encoder.layer_norm.weight"]),
            ("encoder_norm.bias", ["model.encoder.layer_norm.bias"]),
            ("decoder_norm.weight", ["model.decoder.layer_norm.weight"]),
            ("decoder_norm.bias", ["model.decoder.layer_norm.bias"])]
    layers = [(f"encoder_layers.{i}", f"model.encoder.layers.{i}", ENCODER_LAYER)
              for i in range(config.encoder_layers)] + \
        [(f"decoder_layers.{i}", f"model.decoder.layers.{i}", DECODER_LAYER)
         for i in range(config.decoder_layers)]
    for ours, theirs, layer in layers:
        for module, names in layer:
            for kind in ("weight", "bias"):
                rows.append((f"{ours}.{module}.{kind}", [f"{theirs}.{n}.{kind}" for n in names]))
    return rows


# Tensors of the same matrix that checkpoints also hold (tied to model.shared)
TIED = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
        "lm_head.weight")


def is_m2m(directory: Path) -> bool:
    """Whether a Hugging Face model directory holds an M2M100 model (NLLB-200's too)."""
    try:
        return json.loads((directory / "config.json").read_text()).get("model_type") == "m2m_100"
    except (OSError, ValueError):
        return False


def read_weights(directory: Path) -> dict[str, Tensor]:
    """The checkpoint's tensors by name: from its safetensors file(s) (sharded or not), else
    through `transformers` (a pytorch_model.bin, loaded by torch's weights-only reader)."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {name: tensor for shard in shards
                for name, tensor in load_file(directory / shard).items()}
    if (directory / "model.safetensors").is_file():
        return load_file(directory / "model.safetensors")
    from .hf import _transformers

    try:
        model = _transformers().M2M100ForConditionalGeneration.from_pretrained(
            directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        raise AttnError(f"{directory}: cannot load it as an M2M100 model: {detail}") from None
    return dict(model.state_dict())


def attn_config(fields: dict, vocabulary_size: int) -> ModelConfig:
    """The attn config of an M2M100 config.json, or one line naming what attn cannot express."""
    problems = [f"{name} is {fields.get(name)!r}" for name, allowed in (
        ("scale_embedding", (True,)), ("tie_word_embeddings", (None, True)),
        ("activation_function", ("relu", "swish", "silu")))
        if fields.get(name, allowed[0]) not in allowed]
    for name in ("ffn_dim", "attention_heads"):
        if fields[f"encoder_{name}"] != fields[f"decoder_{name}"]:
            problems.append(f"encoder_{name} {fields[f'encoder_{name}']} differs from "
                            f"decoder_{name} {fields[f'decoder_{name}']}")
    d_model, heads = fields["d_model"], fields["encoder_attention_heads"]
    if d_model % heads:
        problems.append(f"d_model {d_model} is not a multiple of the {heads} heads")
    if problems:
        raise AttnError(f"attn cannot express this M2M100 model: {'; '.join(problems)}")
    start = fields.get("decoder_start_token_id")
    return ModelConfig(
        encoder_layers=fields["encoder_layers"], decoder_layers=fields["decoder_layers"],
        d_model=d_model, d_ff=fields["encoder_ffn_dim"], heads=heads, d_k=d_model // heads,
        d_v=d_model // heads, dropout=fields.get("dropout", 0.1),
        attention_dropout=fields.get("attention_dropout", 0.0), positions="fairseq",
        norm="pre", src_vocab_size=vocabulary_size, tgt_vocab_size=vocabulary_size,
        max_positions=fields.get("max_position_embeddings", 1024), share_embeddings=True,
        pad_id=fields.get("pad_token_id", 1), unk_id=3, eos_id=fields.get("eos_token_id", 2),
        bos_id=fields.get("eos_token_id", 2) if start is None else start,
        layer_norm_eps=M2M_LAYER_NORM_EPS,
        activation="relu" if fields.get("activation_function", "relu") == "relu" else "swish",
        attention_bias=True, output_bias=False)


def attn_weights(state: dict[str, Tensor], config: ModelConfig,
                 directory: Path) -> dict[str, Tensor]:
    """An attn Transformer's weights from an M2M100 checkpoint's (`mapping`). The tied copies
    of the embedding must be it: an untied output projection is one attn cannot hold."""
    shared = state.get("model.shared.weight")
    if shared is None:  # some checkpoints keep the tied matrix under another of its names
        shared = next((state[name] for name in TIED if name in state), None)
        if shared is None:
            raise AttnError(f"{directory}: no embedding matrix (model.shared.weight)")
        state = {**state, "model.shared.weight": shared}
    for name in TIED:
        if name in state and not torch.equal(state[name], shared):
            raise AttnError(f"{directory}: {name} differs from model.shared.weight (attn ties "
                            "the embeddings and the output projection, as §3.4)")
    weights = {}
    for ours, theirs in mapping(config):
        missing = [name for name in theirs if name not in state]
        if missing:
            raise AttnError(f"{directory}: the checkpoint has no {missing[0]}")
        parts = [state[name].float() for name in theirs]
        weights[ours] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return weights


def tokenizer_vocabulary(directory: Path, size: int) -> tuple[Vocabulary, str]:
    """The vocabulary of the model's tokenizer (its SentencePiece model, its ids) and how its
    language codes are spelled ("nllb": fra_Latn; "m2m100": __fr__). Ids the embedding has and
    the tokenizer does not name (NLLB-200's last two) get pieces no text is ever cut into."""
    from ..tags import lang_code_style

    spm = directory / SPM_FILE
    if not spm.is_file():
        raise AttnError(f"{spm}: missing (the tokenizer's SentencePiece model is needed: NLLB-200 "
                        "and M2M-100 ship it)")
    from .hf import _transformers

    try:
        tokenizer = _transformers().AutoTokenizer.from_pretrained(directory,
                                                                  local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        raise AttnError(f"{directory}: cannot load its tokenizer: {detail}") from None
    # M2M100Tokenizer keeps its language tokens (__fr__) out of get_vocab()
    ids = {**tokenizer.get_vocab(), **getattr(tokenizer, "lang_token_to_id", {})}
    if max(ids.values()) >= size:
        raise AttnError(f"{directory}: the tokenizer has ids up to {max(ids.values())}, the "
                        f"model {size} embeddings")
    pieces: list[str | None] = [None] * size
    for piece, index in ids.items():
        pieces[index] = piece
    pieces = [piece if piece is not None else f"{UNUSED}{index}>"
              for index, piece in enumerate(pieces)]
    if pieces[3] != "<unk>" or pieces[2] != "</s>" or pieces[1] != "<pad>":
        raise AttnError(f"{directory}: the tokenizer's ids 1, 2, 3 are {pieces[1:4]}, not "
                        "fairseq's <pad>, </s>, <unk>")
    vocabulary = Vocabulary.with_pieces(spm.read_bytes(), pieces)
    try:
        vocabulary.processor  # noqa: B018 - validate now, naming the file
    except AttnError as error:
        raise AttnError(f"{spm}: {error}") from None
    style = lang_code_style(pieces)
    if style is None:
        raise AttnError(f"{directory}: the tokenizer has no language codes (NLLB's fra_Latn or "
                        "M2M-100's __fr__)")
    return vocabulary, style


def import_m2m(directory: Path, output: str | Path) -> Path:
    """Write an attn model file from a local M2M100 directory (NLLB-200 or M2M-100: config.json,
    the weights, the tokenizer with its sentencepiece.bpe.model); no network."""
    from ..model import Transformer
    from ..modelfile import save_model

    fields = json.loads((directory / "config.json").read_text())
    state = read_weights(directory)
    size = fields["vocab_size"]
    vocabulary, style = tokenizer_vocabulary(directory, size)
    config = attn_config(fields, size)
    weights = attn_weights(state, config, directory)
    del state
    with torch.device("meta"):
        model = Transformer(config)
    weights[SOURCE_EMBEDDING] = weights[SHARED_EMBEDDING]  # one matrix, both names
    model.load_state_dict(weights, strict=True, assign=True)
    save_model(output, model, vocabulary, imported_from=directory.name, lang_codes=style)
    return Path(output)


# ------------------------------------------------------------------------------------- export

TOKENIZER_CLASSES = {"nllb": "NllbTokenizer", "m2m100": "M2M100Tokenizer"}


def check_m2m_can_hold(config: ModelConfig) -> None:
    """An M2M100 model holds an attn model with NLLB's switches (`attn_config`) only: one line
    naming what differs."""
    problems = [f"{name} is {getattr(config, name)!r} (M2M100's: {wanted!r})"
                for name, wanted in (("norm", "pre"), ("positions", "fairseq"),
                                     ("share_embeddings", True), ("attention_bias", True),
                                     ("output_bias", False),
                                     ("layer_norm_eps", M2M_LAYER_NORM_EPS))
                if getattr(config, name) != wanted]
    if config.d_k != config.d_v or config.heads * config.d_k != config.d_model:
        problems.append(f"d_k {config.d_k}, d_v {config.d_v} with {config.heads} heads of "
                        f"d_model {config.d_model} (M2M100 needs d_k = d_v = d_model / heads)")
    if problems:
        raise AttnError(f"an M2M100 model cannot hold this model: {'; '.join(problems)}")


def m2m_fields(config: ModelConfig, bos: int) -> dict:
    """M2M100Config's fields for an attn model (`attn_config` read backwards); `bos`: the id
    of <s>, which the tokenizer names and no output starts with."""
    from .hf import bart_fields

    return dict(bart_fields(config), vocab_size=config.tgt_vocab_size,
                max_position_embeddings=config.max_positions, bos_token_id=bos,
                architectures=["M2M100ForConditionalGeneration"])


def m2m_weights(model, config: ModelConfig) -> dict[str, Tensor]:
    """An M2M100 checkpoint's tensors of an attn Transformer (`mapping` read backwards: a fused
    projection split into M2M100's by rows). The tied copies of the embedding and the sinusoids
    are left out, as save_pretrained leaves them: from_pretrained ties and makes them."""
    state = model.state_dict()
    weights = {}
    for ours, theirs in mapping(config):
        parts = state[ours].detach().float().chunk(len(theirs))
        for name, part in zip(theirs, parts):
            weights[name] = part.clone() if len(parts) > 1 else part.contiguous()
    return weights


def write_m2m_tokenizer(directory: Path, vocabulary: Vocabulary, style: str) -> None:
    """The tokenizer's files (NllbTokenizer's or M2M100Tokenizer's) of an imported or fine-tuned
    model's vocabulary, made by `transformers` from its SentencePiece model and its language
    codes, then read back and held to the model's ids: a tokenizer giving any piece another id
    than the model's is refused in one line (the export would not be exact)."""
    from ..tags import forced_language_codes
    from .hf import _transformers

    transformers = _transformers()
    pieces = [vocabulary.piece(index) for index in range(len(vocabulary))]
    codes = forced_language_codes(vocabulary, style)
    (directory / SPM_FILE).write_bytes(vocabulary.spm_bytes)
    if style == "nllb":
        (directory / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": TOKENIZER_CLASSES[style]}))
        tokenizer = transformers.NllbTokenizer.from_pretrained(
            directory, additional_special_tokens=sorted(codes, key=codes.get))
    else:  # M2M100Tokenizer's vocab.json: every piece but its language tokens (it adds them)
        language_ids = set(codes.values())
        (directory / "vocab.json").write_text(json.dumps(
            {piece: index for index, piece in enumerate(pieces)
             if index not in language_ids and not piece.startswith(UNUSED)},
            ensure_ascii=False, indent=0))
        tokenizer = transformers.M2M100Tokenizer(directory / "vocab.json", directory / SPM_FILE)
    tokenizer.save_pretrained(directory)
    read_back = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = {**read_back.get_vocab(), **getattr(read_back, "lang_token_to_id", {})}
    named = {index: piece for piece, index in ids.items()}
    wrong = next((index for index, piece in enumerate(pieces)
                  if named.get(index, piece if piece.startswith(UNUSED) else None) != piece),
                 None)
    if wrong is None and max(named) >= len(pieces):  # an id past the model's embeddings
        wrong = max(named)
    if wrong is not None:
        raise AttnError(f"{TOKENIZER_CLASSES[style]} made of this model's SentencePiece model "
                        f"and language codes names id {wrong} {named.get(wrong)!r}, the model "
                        f"{pieces[wrong] if wrong < len(pieces) else None!r}: export hf cannot "
                        "write its vocabulary back exactly")


def m2m_model_card(loaded, model_path, style: str) -> str:
    """README.md of an exported NLLB-200 or M2M-100 model: what loads it, how to pick the
    target language, and what is known of its training."""
    config, metadata = loaded.config, loaded.metadata
    target = "fra_Latn" if style == "nllb" else "__fr__"
    known = [f"- {name}: {metadata[key]}" for name, key in (
        ("imported from", "imported_from"), ("fine-tuning data", "train_data"),
        ("steps", "step"), ("averaged from", "averaged_from"), ("languages", "langs"),
        ("validation", "validation")) if metadata.get(key)]
    return "\n".join([
        "---", "library_name: transformers", "tags: [translation, m2m_100, attn]", "---", "",
        f"# {Path(model_path).stem}", "",
        f"An {'NLLB-200' if style == 'nllb' else 'M2M-100'} model written by `attn export hf`: "
        "`M2M100ForConditionalGeneration` and its tokenizer load it.", "",
        "```python",
        "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
        "tokenizer = AutoTokenizer.from_pretrained(DIR)",
        "model = AutoModelForSeq2SeqLM.from_pretrained(DIR)",
        'batch = tokenizer(["A man is riding a bike."], return_tensors="pt")',
        "found = model.generate(**batch, forced_bos_token_id="
        f'tokenizer.convert_tokens_to_ids("{target}"))',
        "print(tokenizer.batch_decode(found, skip_special_tokens=True))",
        "```", "",
        "| | |", "|---|---|",
        f"| layers (encoder, decoder) | {config.encoder_layers}, {config.decoder_layers} |",
        f"| d_model, d_ff, heads | {config.d_model}, {config.d_ff}, {config.heads} |",
        f"| vocabulary | {config.tgt_vocab_size} |", "",
        *(["## Training", "", *known, ""] if known else []),
    ])


def export_m2m(model_path: str | Path, output_dir: str | Path, force: bool = False) -> Path:
    """Write an imported or fine-tuned NLLB-200 or M2M-100 model (metadata `lang_codes`) as the
    M2M100 directory `import_m2m` reads: model.safetensors, config.json,
    generation_config.json, the tokenizer's files and a model card, atomically. Refuses an
    existing non-empty directory unless `force`."""
    from ..files import check_output_directory, staged_directory
    from ..modelfile import load_model
    from .hf import _transformers

    _transformers()  # without attn[hf], one line before anything is read
    output_dir = check_output_directory(output_dir, force)
    loaded = load_model(model_path)
    config, style = loaded.config, loaded.metadata["lang_codes"]
    check_m2m_can_hold(config)
    with staged_directory(output_dir) as staging:
        write_m2m_directory(loaded, model_path, staging, style)
    return output_dir


def write_m2m_directory(loaded, model_path, staging: Path, style: str) -> None:
    """`export_m2m`'s files, into `staging`."""
    from safetensors.torch import save_file

    from ..formats import TRANSLATION
    from .hf import _transformers

    transformers, config = _transformers(), loaded.config
    write_m2m_tokenizer(staging, loaded.tgt_vocab, style)
    bos = loaded.tgt_vocab.pieces.index("<s>") if "<s>" in loaded.tgt_vocab.pieces else 0
    transformers.M2M100Config(**m2m_fields(config, bos)).save_pretrained(staging)
    transformers.GenerationConfig(
        bos_token_id=bos, decoder_start_token_id=config.bos_id, eos_token_id=config.eos_id,
        pad_token_id=config.pad_id, forced_eos_token_id=config.eos_id,
        max_length=config.max_positions, num_beams=TRANSLATION.beam).save_pretrained(staging)
    save_file(m2m_weights(loaded.model, config), staging / "model.safetensors",
              metadata={"format": "pt"})
    (staging / "README.md").write_text(m2m_model_card(loaded, model_path, style))
