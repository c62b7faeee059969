"""Attention maps like the paper's Figures 3-5: what every head of every layer attends to.

`attn decode --attention FILE.st` writes, for each non-empty input line, the attention weights
of the output it printed, from one teacher-forced pass of the model over the source and that
output (the same weights the search computed as it went, without its beam bookkeeping):

    LINE.encoder  (layers, heads, S, S)  encoder self-attention over the source pieces
    LINE.decoder  (layers, heads, T, T)  decoder self-attention: row t is the position that
                                         output piece t came from; it sees <s> and pieces < t
    LINE.cross    (layers, heads, T, S)  encoder-decoder attention: output piece t → source

as float16 in a safetensors file, LINE the input line number (from 1); S counts the source
pieces and its </s>, T the output pieces and their </s>. The metadata's `pieces` (JSON) gives
each line's `source` and `output` pieces, the axis labels. `attn plot attention FILE.st --line N`
draws them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .batching import collate_pairs
from .errors import AttnError
from .files import atomic_path
from .formats import ATTENTION_FORMAT, ATTENTION_FORMAT_VERSION
from .model import AttentionWeights

KINDS = ("encoder", "decoder", "cross")


@torch.inference_mode()
def attention_maps(model, sources: list[list[int]], outputs: list[list[int]],
                   sentences_per_pass: int = 32) -> list[dict[str, torch.Tensor]]:
    """Each sentence's {kind: (layers, heads, rows, columns)} maps (see the module's doc):
    `sources` the source ids and `outputs` the output ids, neither with BOS or EOS."""
    config = model.config
    found = []
    for start in range(0, len(sources), sentences_per_pass):
        pairs = list(zip(sources[start:start + sentences_per_pass],
                         outputs[start:start + sentences_per_pass]))
        device = next(model.parameters()).device
        batch = collate_pairs(pairs, config.bos_id, config.eos_id, config.pad_id).to(device)
        src, tgt_in = batch.src_tokens, batch.tgt_input
        weights = AttentionWeights()
        memory, src_mask = model.encode(src, weights)
        model.decode(tgt_in, memory, src_mask, weights)
        stacked = {kind: torch.stack(getattr(weights, kind), dim=1)
                   for kind in KINDS}  # (B, layers, heads, Lq, Lk)
        for row, (src_row, out_row) in enumerate(pairs):
            s, t = len(src_row) + 1, len(out_row) + 1
            found.append({"encoder": stacked["encoder"][row, :, :, :s, :s],
                          "decoder": stacked["decoder"][row, :, :, :t, :t],
                          "cross": stacked["cross"][row, :, :, :t, :s]})
    return found


def recording_render(translator, writer: "AttentionWriter"):
    """A render for `decode.pipe.run` (`attn decode --attention`): the lines decode prints, and
    the attention maps of each line's best output added to `writer`."""
    from .ensemble import Ensemble

    model = translator.model.models[0] if isinstance(translator.model, Ensemble) \
        else translator.model
    src_vocab, tgt_vocab = translator.src_vocab, translator.tgt_vocab
    eos, tags = translator.config.eos_id, translator.options.source_tags

    def render(index, line, hypotheses):
        if line.strip():
            # as the search saw it: after --target-lang's tag, cut to the model's limit
            source = [*tags, *src_vocab.encode([line])[0]][:translator.max_source]
            output = hypotheses[0].tokens
            maps = attention_maps(model, [source], [output])[0]
            pieces = [src_vocab.piece(i) for i in source + [eos]]
            out_pieces = [tgt_vocab.piece(i) for i in output + [eos]]
            writer.add(index + 1, maps, pieces, out_pieces)
        return translator.format(index, hypotheses)

    return render


class AttentionWriter:
    """Collects the maps of decoded lines, then writes them in one safetensors file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors: dict[str, torch.Tensor] = {}
        self.pieces: dict[str, dict[str, list[str]]] = {}

    def add(self, line: int, maps: dict[str, torch.Tensor], source: list[str],
            output: list[str]) -> None:
        for kind in KINDS:
            self.tensors[f"{line}.{kind}"] = maps[kind].to(torch.float16).cpu().contiguous()
        self.pieces[str(line)] = {"source": source, "output": output}

    def write(self) -> None:
        from safetensors.torch import save_file

        metadata = {"format": ATTENTION_FORMAT, "format_version": ATTENTION_FORMAT_VERSION,
                    "pieces": json.dumps(self.pieces, ensure_ascii=False)}
        with atomic_path(self.path) as temp:
            save_file(self.tensors, str(temp), metadata=metadata)


def read_attention(path: str | Path, line: int) -> tuple[dict[str, torch.Tensor],
                                                         dict[str, list[str]]]:
    """The maps ({kind: (layers, heads, rows, columns)} float32) and pieces of one line."""
    from safetensors import safe_open

    from . import stfile

    header = stfile.read_attn_header(path, ATTENTION_FORMAT, "attention file")
    pieces = json.loads(header.metadata.get("pieces", "{}"))
    if str(line) not in pieces:
        lines = sorted(map(int, pieces))
        span = f"lines {lines[0]}-{lines[-1]}" if lines else "no lines"
        raise AttnError(f"{path} has no maps for line {line} ({span}; empty lines have none)")
    with safe_open(str(path), framework="pt") as handle:
        maps = {kind: handle.get_tensor(f"{line}.{kind}").float() for kind in KINDS}
    return maps, pieces[str(line)]
