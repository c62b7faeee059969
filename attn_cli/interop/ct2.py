"""`attn export ct2`: an attn model as a CTranslate2 model directory, weight for weight.

CTranslate2 (`pip install 'attn[ct2]'`) is the inference engine many deployments use. The export
covers every model attn trains (post- or pre-norm, sinusoidal or learned positions, shared or
separate embeddings) and writes beside CTranslate2's files the SentencePiece models
(`source.spm`, `target.spm`), so the directory is all a deployment needs:

    import ctranslate2, sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file="DIR/source.spm")
    translator = ctranslate2.Translator("DIR")
    result = translator.translate_batch([sp.encode("A man is riding a bike.", out_type=str)])

The source EOS is added by CTranslate2 (`add_source_eos`), as `attn decode` adds it. Greedy
search gives `attn decode --beam 1`'s output; beam search differs in two settings attn cannot
store in the model: CTranslate2 normalises by |Y|^α, not GNMT's ((5 + |Y|) / 6)^α, and at a
length penalty other than 0 stops a sentence once beam-many hypotheses have ended (`attn decode
--stop patience`; at 0 once the best beam ends, `--stop best-ends`).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import AttnError
from ..files import check_output_directory, staged_directory
from ..formats import (
    BOS_ID,
    EOS_ID,
    MAX_SOURCE_TOKENS,
    PAD_ID,
    SHARED_EMBEDDING,
    SOURCE_EMBEDDING,
    TRANSLATION,
    UNK_ID,
)


def _ctranslate2():
    try:
        import ctranslate2  # noqa: F401
        from ctranslate2.converters.converter import Converter
        from ctranslate2.specs import transformer_spec
    except ImportError:
        raise AttnError("export ct2 needs CTranslate2: pip install 'attn[ct2]'") from None
    return Converter, transformer_spec


def transformer_spec_of(loaded, add_source_eos: bool = True):
    """The CTranslate2 `TransformerSpec` holding a loaded attn model's weights and vocabularies."""
    _, transformer_spec = _ctranslate2()
    config, model = loaded.config, loaded.model
    if config.d_k != config.d_v or config.heads * config.d_k != config.d_model:
        # TransformerSpec.from_config derives head_dim = d_model / heads.
        raise AttnError(f"CTranslate2 needs d_k = d_v = d_model / heads; this model has d_k "
                        f"{config.d_k}, d_v {config.d_v}, d_model {config.d_model}, "
                        f"{config.heads} heads")
    options = [f"{name} {getattr(config, name)!r}"
               for name, paper in config.IMPORTED_OPTIONS.items()
               if getattr(config, name) != paper] + (
        [] if (config.pad_id, config.unk_id, config.bos_id, config.eos_id)
        == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
        else ["special ids other than <pad> 0, <unk> 1, <s> 2, </s> 3"])
    if options:  # an imported model's options: `export hf` writes them back
        raise AttnError(f"export ct2 writes the paper's architecture; this model has "
                        f"{', '.join(options)} (try `attn export hf`)")
    weights = {name: tensor.detach().float().numpy() for name, tensor in
               model.state_dict().items()}
    pre = config.norm == "pre"
    spec = transformer_spec.TransformerSpec.from_config(
        (config.encoder_layers, config.decoder_layers), config.heads, pre_norm=pre)
    spec.config.layer_norm_epsilon = config.layer_norm_eps
    spec.config.add_source_eos = add_source_eos
    # Our interleaved sin/cos table (CTranslate2's default concatenates them), or the learned
    # one; long enough for the longest source and output attn allows.
    length = config.max_positions if config.positions == "learned" else \
        MAX_SOURCE_TOKENS + 1 + TRANSLATION.max_len_b
    positions = model.positions(0, length).detach().float().numpy()
    # With pre_norm the spec's sub-layer norms come before each sub-layer and a final norm ends
    # each stack; without, they follow each residual add: both are ours.
    spec.encoder.embeddings[0].weight = weights[SOURCE_EMBEDDING if SOURCE_EMBEDDING in weights
                                                else SHARED_EMBEDDING]
    spec.encoder.position_encodings.encodings = positions
    for i, layer in enumerate(spec.encoder.layer):
        _self_attention(layer.self_attention, weights, f"encoder_layers.{i}")
        _feed_forward(layer.ffn, weights, f"encoder_layers.{i}", 1)
    spec.decoder.embeddings.weight = weights[SHARED_EMBEDDING]
    spec.decoder.position_encodings.encodings = positions
    spec.decoder.projection.weight = weights[SHARED_EMBEDDING]  # tied, no bias
    for i, layer in enumerate(spec.decoder.layer):
        prefix = f"decoder_layers.{i}"
        _self_attention(layer.self_attention, weights, prefix)
        cross = layer.attention  # linear[0]: q; linear[1]: fused k, v; linear[2]: out
        _norm(cross.layer_norm, weights, f"{prefix}.sub.norms.1")
        _linear(cross.linear[0], weights, f"{prefix}.cross_attn.q_proj")
        _linear(cross.linear[1], weights, f"{prefix}.cross_attn.kv_proj")
        _linear(cross.linear[2], weights, f"{prefix}.cross_attn.out_proj")
        _feed_forward(layer.ffn, weights, prefix, 2)
    if pre:
        _norm(spec.encoder.layer_norm, weights, "encoder_norm")
        _norm(spec.decoder.layer_norm, weights, "decoder_norm")
    # Pieces in id order: attn's <pad> <unk> <s> </s> (ids 0-3) are CT2's default specials.
    for vocab, register in ((loaded.src_vocab, spec.register_source_vocabulary),
                            (loaded.tgt_vocab, spec.register_target_vocabulary)):
        register([vocab.piece(i) for i in range(len(vocab))])
    return spec


def _linear(layer_spec, weights: dict, name: str, bias: bool = False) -> None:
    layer_spec.weight = weights[f"{name}.weight"]  # torch's (out, in) layout, as CT2's
    if bias:
        layer_spec.bias = weights[f"{name}.bias"]  # attention projections have none


def _norm(layer_spec, weights: dict, name: str) -> None:
    layer_spec.gamma, layer_spec.beta = weights[f"{name}.weight"], weights[f"{name}.bias"]


def _feed_forward(ffn_spec, weights: dict, prefix: str, index: int) -> None:
    _norm(ffn_spec.layer_norm, weights, f"{prefix}.sub.norms.{index}")
    _linear(ffn_spec.linear_0, weights, f"{prefix}.ffn.inner", bias=True)
    _linear(ffn_spec.linear_1, weights, f"{prefix}.ffn.outer", bias=True)


def _self_attention(attention, weights: dict, prefix: str) -> None:
    """linear[0]: the fused q, k, v projection; linear[1]: the output projection."""
    _norm(attention.layer_norm, weights, f"{prefix}.sub.norms.0")
    _linear(attention.linear[0], weights, f"{prefix}.self_attn.qkv_proj")
    _linear(attention.linear[1], weights, f"{prefix}.self_attn.out_proj")


def export_ct2(model_path: str | Path, output_dir: str | Path, quantization: str = "float32",
               add_source_eos: bool = True, force: bool = False) -> Path:
    """Write the CTranslate2 model of an attn model file to `output_dir` (weights in
    `quantization`), with source.spm and target.spm beside it. Refuses an existing non-empty
    directory unless `force`."""
    from ..modelfile import load_model

    Converter, _ = _ctranslate2()
    output_dir = check_output_directory(output_dir, force)
    loaded = load_model(model_path)

    class AttnConverter(Converter):
        def _load(self):
            return transformer_spec_of(loaded, add_source_eos)

    with staged_directory(output_dir) as staging:
        AttnConverter().convert(str(staging), quantization=quantization, force=True)
        for name, vocab in (("source", loaded.src_vocab), ("target", loaded.tgt_vocab)):
            (staging / f"{name}.spm").write_bytes(vocab.spm_bytes)
    return output_dir
