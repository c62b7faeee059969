"""Hugging Face both ways: `attn export hf` writes an attn model as a `transformers` Marian model
directory, `attn import hf` reads one (an OPUS-MT model, say) into an attn model file.

Marian in `transformers` (`MarianMTModel`) is the paper's Transformer with a few switches:
post-norm, sinusoidal positions from 0, embeddings scaled by sqrt(d_model), the output projection
tied to the target embeddings. Two differences are re-parametrised away, exactly:
- Marian's position table puts the sines in the first half of d_model and the cosines in the
  second; §3.5 (and attn) interleave them. Permuting the d_model axis of every tensor that reads or
  writes the residual stream maps one onto the other: LayerNorm, the residual adds and the tied
  logits (h·E^T) are blind to the order of that axis.
- Marian's attention projections have biases and its logits a `final_logits_bias`: attn writes
  zeros, and an imported model that has them keeps them (`ModelConfig.attention_bias`,
  `output_bias`), as it keeps OPUS-MT's swish (`activation`).
OPUS-MT's ids are a vocab.json's, not its SentencePiece models': an imported vocabulary carries
its piece list (`Vocabulary.with_pieces`). Marian's LayerNorm epsilon is fixed at 1e-5 (attn's
default is 1e-6): an exported model records attn's in its config.json (`attn_layer_norm_eps`,
which `transformers` ignores and `attn import hf` reads back), so the round trip is exact and
`transformers` differs from attn by that epsilon alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ..config import ModelConfig
from ..errors import AttnError
from ..files import check_output_directory, staged_directory
from ..formats import MAX_SOURCE_TOKENS, SHARED_EMBEDDING, SOURCE_EMBEDDING, TRANSLATION
from ..vocab import Vocabulary

MARIAN_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which MarianMTModel's layers use


def _transformers():
    try:
        import transformers
    except ImportError:
        raise AttnError("Hugging Face models need transformers: pip install 'attn[hf]'") from None
    transformers.utils.logging.disable_progress_bar()
    return transformers


# ------------------------------------------------------------------------------------ mapping

# Each layer's Linear and LayerNorm modules, attn's beside Marian's (the layer's prefix left
# off), with how each meets the residual stream and whether attn may lack its bias. A module
# "reads" the stream (its matrix's columns are d_model, its bias is not) or "writes" it (its
# matrix's rows and its bias are d_model; a LayerNorm's weight and bias alike). attn fuses the
# projections Marian keeps apart: several Marian modules are one attn matrix's rows, in order.
SELF_ATTENTION = [("self_attn.qkv_proj", [f"self_attn.{x}_proj" for x in "qkv"], "reads", True),
                  ("self_attn.out_proj", ["self_attn.out_proj"], "writes", True)]
CROSS_ATTENTION = [("cross_attn.q_proj", ["encoder_attn.q_proj"], "reads", True),
                   ("cross_attn.kv_proj", [f"encoder_attn.{x}_proj" for x in "kv"], "reads", True),
                   ("cross_attn.out_proj", ["encoder_attn.out_proj"], "writes", True)]
FEED_FORWARD = [("ffn.inner", ["fc1"], "reads", False), ("ffn.outer", ["fc2"], "writes", False)]
ENCODER_LAYER = [*SELF_ATTENTION, ("sub.norms.0", ["self_attn_layer_norm"], "writes", False),
                 *FEED_FORWARD, ("sub.norms.1", ["final_layer_norm"], "writes", False)]
DECODER_LAYER = [*SELF_ATTENTION, ("sub.norms.0", ["self_attn_layer_norm"], "writes", False),
                 *CROSS_ATTENTION, ("sub.norms.1", ["encoder_attn_layer_norm"], "writes", False),
                 *FEED_FORWARD, ("sub.norms.2", ["final_layer_norm"], "writes", False)]


def marian_order(d_model: int) -> Tensor:
    """(D,) for each of Marian's d_model positions, attn's: Marian's first half holds the sines
    (attn's even positions), its second half the cosines (attn's odd ones)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def mapping(config: ModelConfig) -> list[tuple]:
    """Every attn tensor as a row (attn name, Marian names, (to Marian, to attn), zeros), read
    forwards by `marian_state_dict` and backwards by `attn_state_dict`.
    - The transform is a function and its inverse: d_model permuted into Marian's order and
      back (the module docstring), along the axis where the tensor meets the residual stream.
    - Several Marian names: the attn tensor is theirs stacked by rows.
    - One attn name in several rows: Marian's tied copies of it; the first row is read back.
    - zeros: a bias this attn model lacks (the paper's projections have none): Marian's are
      that many zeros, and nothing is read back."""
    order = marian_order(config.d_model)
    back = torch.argsort(order)
    same = (lambda t: t, lambda t: t)
    reads = (lambda t: t[:, order], lambda t: t[:, back])  # d_model is the columns
    writes = (lambda t: t[order], lambda t: t[back])  # d_model is the rows, or the vector
    batched = (lambda t: t[None], lambda t: t[0])  # Marian's logits bias is (1, V)
    transforms = {"reads": (reads, same), "writes": (writes, writes)}  # (weight's, bias's)
    rows = [(SHARED_EMBEDDING, ["model.decoder.embed_tokens.weight"], reads, None),
            (SHARED_EMBEDDING, ["lm_head.weight"], reads, None),
            (SOURCE_EMBEDDING, ["model.encoder.embed_tokens.weight"], reads, None)]
    if config.share_embeddings:  # Marian has `model.shared` only when source and target share
        rows.append((SOURCE_EMBEDDING, ["model.shared.weight"], reads, None))
    rows.append(("output_bias", ["final_logits_bias"], batched,
                 None if config.output_bias else config.tgt_vocab_size))
    layers = [(f"encoder_layers.{i}", f"model.encoder.layers.{i}", ENCODER_LAYER)
              for i in range(config.encoder_layers)] + \
        [(f"decoder_layers.{i}", f"model.decoder.layers.{i}", DECODER_LAYER)
         for i in range(config.decoder_layers)]
    for ours, theirs, layer in layers:
        for module, marian_modules, meets, optional_bias in layer:
            weight, bias = transforms[meets]
            marian = [f"{theirs}.{name}" for name in marian_modules]
            lacks_bias = optional_bias and not config.attention_bias
            zeros = len(marian) * config.d_model if lacks_bias else None  # d_model per projection
            rows.append((f"{ours}.{module}.weight", [f"{m}.weight" for m in marian], weight, None))
            rows.append((f"{ours}.{module}.bias", [f"{m}.bias" for m in marian], bias, zeros))
    return rows


def marian_state_dict(model: torch.nn.Module, config: ModelConfig) -> dict[str, Tensor]:
    """MarianMTModel's weights (all but the position tables) from an attn Transformer's."""
    weights = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    state: dict[str, Tensor] = {}
    for ours, theirs, (to_marian, _), zeros in mapping(config):
        tensor = to_marian(weights[ours] if zeros is None else torch.zeros(zeros))
        state.update(zip(theirs, tensor.chunk(len(theirs))))
    return state


def attn_state_dict(marian, config: ModelConfig) -> dict[str, Tensor]:
    """An attn Transformer's weights from a MarianMTModel's: `mapping` read backwards."""
    state = {name: tensor.detach().float() for name, tensor in marian.state_dict().items()}
    weights: dict[str, Tensor] = {}
    for ours, theirs, (_, to_attn), zeros in mapping(config):
        if zeros is None and ours not in weights:  # attn has it, and this is its first row
            weights[ours] = torch.cat([to_attn(state[name]) for name in theirs])
    return weights


# ------------------------------------------------------------------------------------- export


def export_hf(model_path: str | Path, output_dir: str | Path, force: bool = False) -> Path:
    """Write the Marian model directory of an attn model file: model.safetensors, config.json,
    generation_config.json, the tokenizer's files (source.spm, target.spm, vocab.json,
    tokenizer_config.json) and a model card, atomically. Refuses an existing non-empty
    directory unless `force`. (An NLLB-200 or M2M-100 model: `m2m.export_m2m`.)"""
    from ..modelfile import load_model

    transformers = _transformers()
    output_dir = check_output_directory(output_dir, force)
    loaded = load_model(model_path)
    config = loaded.config
    _check_marian_can_hold(config)
    marian_config = transformers.MarianConfig(**marian_fields(config))
    # what Marian cannot hold, for `import_hf` to read back (transformers ignores them)
    marian_config.attn_layer_norm_eps = config.layer_norm_eps
    marian_config.attn_max_positions = config.max_positions
    marian = transformers.MarianMTModel(marian_config)
    state = marian_state_dict(loaded.model, config)
    positions = {name: tensor for name, tensor in marian.state_dict().items()
                 if name.endswith("embed_positions.weight")}  # Marian's own table, kept
    marian.load_state_dict({**state, **positions}, strict=True)
    marian.generation_config = transformers.GenerationConfig(**generation_fields(config))
    with staged_directory(output_dir) as staging:
        marian.save_pretrained(staging)
        _write_tokenizer(staging, loaded)
        (staging / "README.md").write_text(model_card(loaded, model_path))
    return output_dir


def _check_marian_can_hold(config: ModelConfig) -> None:
    problems = []
    if config.norm != "post":
        problems.append("norm is 'pre' (Marian is post-norm)")
    if config.positions != "sinusoidal":
        problems.append(f"positions are {config.positions} (Marian's are §3.5's sinusoids)")
    if config.d_k != config.d_v or config.heads * config.d_k != config.d_model:
        problems.append(f"d_k {config.d_k}, d_v {config.d_v} with {config.heads} heads of "
                        f"d_model {config.d_model} (Marian needs d_k = d_v = d_model / heads)")
    if problems:
        raise AttnError(f"a Marian model cannot hold this model: {'; '.join(problems)}")


def bart_fields(config: ModelConfig) -> dict:
    """The fields MarianConfig and M2M100Config (both BART's in transformers) take alike from
    an attn model: its sizes, dropout, scaled embeddings and special ids."""
    return dict(
        d_model=config.d_model, encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers, encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff, encoder_attention_heads=config.heads,
        decoder_attention_heads=config.heads, activation_function=config.activation,
        dropout=config.dropout, attention_dropout=config.attention_dropout,
        activation_dropout=0.0, scale_embedding=True, pad_token_id=config.pad_id,
        eos_token_id=config.eos_id, decoder_start_token_id=config.bos_id,
        forced_eos_token_id=config.eos_id, tie_word_embeddings=True)


def marian_fields(config: ModelConfig) -> dict:
    """MarianConfig's fields for an attn model."""
    return dict(
        bart_fields(config), vocab_size=config.src_vocab_size,
        decoder_vocab_size=config.tgt_vocab_size,
        # the longest source attn reads, EOS included, and the longest output it writes
        max_position_embeddings=MAX_SOURCE_TOKENS + 1 + TRANSLATION.max_len_b,
        share_encoder_decoder_embeddings=config.share_embeddings,
        architectures=["MarianMTModel"])


def generation_fields(config: ModelConfig) -> dict:
    """generate()'s defaults: the paper's beam of 4 (transformers normalises scores by |Y|^α,
    not GNMT's ((5 + |Y|) / 6)^α), padding and BOS never chosen, as in `attn decode`."""
    return dict(decoder_start_token_id=config.bos_id, eos_token_id=config.eos_id,
                pad_token_id=config.pad_id, forced_eos_token_id=config.eos_id,
                bad_words_ids=[[config.pad_id]] + ([[config.bos_id]]
                                                   if config.bos_id != config.pad_id else []),
                num_beams=TRANSLATION.beam, length_penalty=TRANSLATION.alpha,
                max_length=MAX_SOURCE_TOKENS + 1 + TRANSLATION.max_len_b)


def _pieces(vocabulary: Vocabulary) -> list[str]:
    return [vocabulary.piece(i) for i in range(len(vocabulary))]


def _write_tokenizer(directory: Path, loaded) -> None:
    """MarianTokenizer's files: the two SentencePiece models and the piece → id maps."""
    separate = loaded.src_vocab.checksum != loaded.tgt_vocab.checksum and \
        _pieces(loaded.src_vocab) != _pieces(loaded.tgt_vocab)
    (directory / "source.spm").write_bytes(loaded.src_vocab.spm_bytes)
    (directory / "target.spm").write_bytes(loaded.tgt_vocab.spm_bytes)
    maps = [("vocab.json", loaded.src_vocab)] + (
        [("target_vocab.json", loaded.tgt_vocab)] if separate else [])
    for name, vocabulary in maps:
        ids = {piece: index for index, piece in enumerate(_pieces(vocabulary))}
        (directory / name).write_text(json.dumps(ids, ensure_ascii=False, indent=0))
    config = loaded.config
    langs = loaded.metadata.get("langs", "")
    source_lang, _, target_lang = langs.partition("-")
    settings = {"tokenizer_class": "MarianTokenizer", "separate_vocabs": separate,
                "unk_token": _pieces(loaded.src_vocab)[config.unk_id],
                "eos_token": _pieces(loaded.tgt_vocab)[config.eos_id],
                "pad_token": _pieces(loaded.tgt_vocab)[config.pad_id],
                "model_max_length": MAX_SOURCE_TOKENS + 1,
                "source_lang": source_lang or None, "target_lang": target_lang or None}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


def model_card(loaded, model_path) -> str:
    """README.md: what the model is, how to use it, and what is known of its training."""
    config, metadata = loaded.config, loaded.metadata
    rows = [f"| {name} | {value} |" for name, value in (
        ("layers (encoder, decoder)", f"{config.encoder_layers}, {config.decoder_layers}"),
        ("d_model, d_ff, heads", f"{config.d_model}, {config.d_ff}, {config.heads}"),
        ("vocabulary", f"{config.src_vocab_size}"
         + ("" if config.share_embeddings else f" / {config.tgt_vocab_size}")),
        ("feed-forward activation", config.activation),
        ("attn LayerNorm epsilon", config.layer_norm_eps))]
    known = [f"- {name}: {metadata[key]}" for name, key in (
        ("preset", "preset"), ("training data", "train_data"), ("steps", "step"),
        ("averaged from", "averaged_from"), ("languages", "langs"),
        ("validation", "validation"), ("imported from", "imported_from")) if metadata.get(key)]
    return "\n".join([
        "---", "library_name: transformers", "tags: [translation, marian, attn]", "---", "",
        f"# {Path(model_path).stem}", "",
        "A Transformer (Vaswani et al., 2017) trained with attn and exported by "
        "`attn export hf` as a Marian model: `MarianMTModel` and `MarianTokenizer` load it.", "",
        "```python",
        "from transformers import MarianMTModel, MarianTokenizer",
        "tokenizer = MarianTokenizer.from_pretrained(DIR)",
        "model = MarianMTModel.from_pretrained(DIR)",
        'batch = tokenizer(["A man is riding a bike."], return_tensors="pt")',
        "print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))",
        "```", "",
        "Greedy search (`num_beams=1`) gives `attn decode --beam 1`'s output. Beam search "
        "differs in its length normalisation (transformers: |Y|^α; attn: GNMT's "
        "((5 + |Y|) / 6)^α). Marian's LayerNorm epsilon is 1e-5"
        + ("" if config.layer_norm_eps == MARIAN_LAYER_NORM_EPS else
           f"; this model was trained with {config.layer_norm_eps:g}, which config.json "
           "records as `attn_layer_norm_eps` (`attn import hf` reads it back)") + ".", "",
        "| | |", "|---|---|", *rows, "",
        *(["## Training", "", *known, ""] if known else []),
    ])


# ------------------------------------------------------------------------------------- import


def import_hf(directory: str | Path, output: str | Path) -> Path:
    """Write an attn model file from a local MarianMTModel directory (what save_pretrained
    writes, with MarianTokenizer's files beside it); no network."""
    from ..modelfile import save_model

    transformers = _transformers()
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise AttnError(f"{directory}: no config.json (not a Hugging Face model directory)")
    try:
        marian = transformers.MarianMTModel.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        raise AttnError(f"{directory}: cannot load it as a MarianMTModel: {detail}") from None
    src_vocab, tgt_vocab = _read_vocabularies(directory, marian.config)
    config = attn_config(marian, src_vocab, tgt_vocab)
    from ..model import Transformer

    model = Transformer(config)
    model.load_state_dict(attn_state_dict(marian, config), strict=True)
    tokenizer = _json(directory / "tokenizer_config.json", required=False)
    langs = "-".join(filter(None, (tokenizer.get("source_lang"), tokenizer.get("target_lang"))))
    provenance = {"imported_from": directory.name}
    if "-" in langs:
        provenance["langs"] = langs
    save_model(output, model, src_vocab, tgt_vocab if tgt_vocab is not src_vocab else None,
               **provenance)
    return Path(output)


def _json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise AttnError(f"{path}: missing (MarianTokenizer's files are needed)")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise AttnError(f"{path}: not valid JSON ({error})") from None


def _piece_list(path: Path, size: int) -> list[str]:
    ids = _json(path)
    pieces = [None] * size
    for piece, index in ids.items():
        if not isinstance(index, int) or not 0 <= index < size:
            raise AttnError(f"{path}: id {index!r} of {piece!r} is outside the model's "
                            f"{size} embeddings")
        pieces[index] = piece
    missing = [index for index, piece in enumerate(pieces) if piece is None]
    if missing:
        raise AttnError(f"{path}: no piece for id {missing[0]} ({len(missing)} ids unnamed)")
    return pieces


def _vocabulary(spm_path: Path, pieces: list[str]) -> Vocabulary:
    """The plain SentencePiece vocabulary when its ids are the piece list's (a model attn
    exported), else the SentencePiece model with the piece list."""
    if not spm_path.is_file():
        raise AttnError(f"{spm_path}: missing (MarianTokenizer's files are needed)")
    plain = Vocabulary(spm_path.read_bytes())
    try:
        if len(plain) == len(pieces) and all(plain.piece(i) == piece
                                             for i, piece in enumerate(pieces)):
            return plain
    except AttnError:  # not attn's special ids: the piece list decides
        pass
    mapped = Vocabulary.with_pieces(spm_path.read_bytes(), pieces)
    try:
        mapped.processor  # noqa: B018 - validate now, naming the file
    except AttnError as error:
        raise AttnError(f"{spm_path}: {error}") from None
    return mapped


def _read_vocabularies(directory: Path, marian_config) -> tuple[Vocabulary, Vocabulary]:
    settings = _json(directory / "tokenizer_config.json", required=False)
    source_size = marian_config.vocab_size
    target_size = marian_config.decoder_vocab_size or source_size
    source_pieces = _piece_list(directory / "vocab.json", source_size)
    target_pieces = _piece_list(directory / "target_vocab.json", target_size) \
        if settings.get("separate_vocabs") else source_pieces
    src_vocab = _vocabulary(directory / "source.spm", source_pieces)
    tgt_vocab = _vocabulary(directory / "target.spm", target_pieces)
    return src_vocab, (src_vocab if tgt_vocab.model_bytes == src_vocab.model_bytes
                       else tgt_vocab)


def attn_config(marian, src_vocab: Vocabulary, tgt_vocab: Vocabulary) -> ModelConfig:
    """The attn config of a MarianMTModel, or one line naming what attn cannot express."""
    config = marian.config
    problems = [f"{name} is {getattr(config, name)!r}" for name, allowed in (
        ("normalize_before", (None, False)), ("add_layernorm_embedding", (None, False)),
        ("scale_embedding", (True,)), ("static_position_embeddings", (None, True)),
        ("tie_word_embeddings", (True,)), ("learned_positions", (None, False)))
        if getattr(config, name, None) not in allowed]
    activation = {"relu": "relu", "swish": "swish", "silu": "swish"}.get(
        config.activation_function)
    if activation is None:
        problems.append(f"activation_function is {config.activation_function!r}")
    for name in ("ffn_dim", "attention_heads"):
        if getattr(config, f"encoder_{name}") != getattr(config, f"decoder_{name}"):
            problems.append(f"encoder_{name} {getattr(config, f'encoder_{name}')} differs "
                            f"from decoder_{name} {getattr(config, f'decoder_{name}')}")
    if config.d_model % config.encoder_attention_heads:
        problems.append(f"d_model {config.d_model} is not a multiple of the heads")
    if problems:
        raise AttnError(f"attn cannot express this Marian model: {'; '.join(problems)}")
    state = marian.state_dict()
    biases = [tensor for name, tensor in state.items()
              if "attn." in name and name.endswith("_proj.bias")]
    heads = config.encoder_attention_heads
    eps = getattr(config, "attn_layer_norm_eps", None) or \
        marian.model.encoder.layers[0].self_attn_layer_norm.eps
    start = config.decoder_start_token_id
    return ModelConfig(
        encoder_layers=config.encoder_layers, decoder_layers=config.decoder_layers,
        d_model=config.d_model, d_ff=config.encoder_ffn_dim, heads=heads,
        d_k=config.d_model // heads, d_v=config.d_model // heads, dropout=config.dropout,
        attention_dropout=config.attention_dropout, positions="sinusoidal", norm="post",
        src_vocab_size=len(src_vocab), tgt_vocab_size=len(tgt_vocab),
        max_positions=getattr(config, "attn_max_positions", None)
        or config.max_position_embeddings,
        share_embeddings=bool(config.share_encoder_decoder_embeddings),
        pad_id=config.pad_token_id, unk_id=_unk_id(tgt_vocab), eos_id=config.eos_token_id,
        bos_id=config.pad_token_id if start is None else start, layer_norm_eps=eps,
        activation=activation, attention_bias=any(bool(b.any()) for b in biases),
        output_bias=bool(state["final_logits_bias"].any()))


def _unk_id(vocabulary: Vocabulary) -> int:
    pieces = vocabulary.pieces
    return pieces.index("<unk>") if pieces is not None else vocabulary.processor.unk_id()
