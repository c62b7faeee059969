"""`attn decode --attention` and `attn plot`: attention maps by the paper's formula, figures."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from attn_cli.attention_maps import read_attention
from attn_cli.modelfile import load_model

from .conftest import assert_clean_error, run_attn

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def maps_file(trained, tmp_path_factory):
    model, _ = trained
    path = tmp_path_factory.mktemp("maps") / "maps.st"
    stdin = "A man is riding a bike.\n\nTwo dogs play in the snow.\n"
    result = run_attn("decode", "-m", model, "--max-len-b", "6", "--dtype", "fp32",
                      "--attention", path, stdin=stdin)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 3  # stdout unchanged: the maps go to the file
    return path, result.stdout.splitlines()


def test_attention_maps_are_the_papers_softmax(trained, maps_file):
    """Layer 1's encoder self-attention is softmax(Q K^T / sqrt(d_k)) of the embedded source,
    each row a distribution; the decoder's is causal; every line's pieces label the axes."""
    path, outputs = maps_file
    loaded = load_model(trained[0])
    model, config = loaded.model.eval(), loaded.config
    maps, pieces = read_attention(path, 1)
    source = loaded.src_vocab.encode(["A man is riding a bike."])[0] + [config.eos_id]
    assert pieces["source"] == [loaded.src_vocab.processor.id_to_piece(i) for i in source]
    assert loaded.tgt_vocab.processor.decode_pieces(pieces["output"][:-1]) == outputs[0]
    layers, heads = config.encoder_layers, config.heads
    s, t = len(source), len(pieces["output"])
    assert maps["encoder"].shape == (layers, heads, s, s)
    assert maps["decoder"].shape == (config.decoder_layers, heads, t, t)
    assert maps["cross"].shape == (config.decoder_layers, heads, t, s)
    with torch.no_grad():
        x = model.embed(model.src_embed, torch.tensor([source]))
        qkv = x @ model.encoder_layers[0].self_attn.qkv_proj.weight.T
        q, k = (part.view(1, s, heads, config.d_k).transpose(1, 2)
                for part in qkv.split(heads * config.d_k, dim=-1)[:2])
        expected = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(config.d_k), dim=-1)[0]
    torch.testing.assert_close(maps["encoder"][0], expected, atol=2e-3, rtol=0)  # float16
    for kind in ("encoder", "decoder", "cross"):
        torch.testing.assert_close(maps[kind].sum(-1), torch.ones(maps[kind].shape[:-1]),
                                   atol=5e-3, rtol=0)
    assert torch.all(maps["decoder"].triu(1) == 0)  # a position never sees its future


def test_empty_lines_have_no_maps_and_lines_keep_their_numbers(maps_file):
    path, _ = maps_file
    assert read_attention(path, 3)[1]["source"][0] == "▁Two"
    with pytest.raises(Exception, match="line 2"):
        read_attention(path, 2)


def test_plot_attention_draws_the_heads(maps_file, tmp_path):
    pytest.importorskip("matplotlib", reason="pip install 'attn[plot]'")
    path, _ = maps_file
    result = run_attn("plot", "attention", path, "--line", "1", "-o", tmp_path / "a.png")
    assert result.returncode == 0, result.stderr
    assert "heads 1, 2" in result.stderr
    assert (tmp_path / "a.png").read_bytes().startswith(PNG)
    one = run_attn("plot", "attention", path, "--line", "3", "--kind", "cross", "--layer", "1",
                   "--head", "2", "-o", tmp_path / "b.svg")
    assert one.returncode == 0, one.stderr
    assert b"<svg" in (tmp_path / "b.svg").read_bytes()[:500]
    assert_clean_error(run_attn("plot", "attention", path, "-o", tmp_path / "c.png"), "--line")
    assert_clean_error(run_attn("plot", "attention", path, "--line", "2", "-o",
                                tmp_path / "c.png"), "line 2")
    assert_clean_error(run_attn("plot", "attention", path, "--line", "1", "--layer", "9", "-o",
                                tmp_path / "c.png"), "--layer 9")
    assert not (tmp_path / "c.png").exists()


def test_plot_curves_of_runs(trained, data_files, tmp_path):
    pytest.importorskip("matplotlib", reason="pip install 'attn[plot]'")
    run_dir = trained[0].parent
    result = run_attn("plot", run_dir, run_dir, "-o", tmp_path / "curves.png")
    assert result.returncode == 0, result.stderr
    assert "perplexity" in result.stderr and "2 run(s)" in result.stderr
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG)
    steps = run_attn("plot", run_dir, "--x", "step", "-o", tmp_path / "steps.pdf")
    assert steps.returncode == 0, steps.stderr
    assert (tmp_path / "steps.pdf").read_bytes().startswith(b"%PDF")
    assert_clean_error(run_attn("plot", tmp_path, "-o", tmp_path / "x.png"), "metrics.jsonl")
    assert_clean_error(run_attn("plot", "attention", trained[0], "--line", "1", "-o",
                                tmp_path / "x.png"), "model file")


def test_plot_without_matplotlib_names_the_extra(trained, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert_clean_error(run_attn("plot", trained[0].parent, "-o", tmp_path / "x.png"),
                       "attn[plot]")
