"""Guided alignment (Garg et al. 2019; not in the paper): `attn binarize --alignments` keeps a
Pharaoh word alignment per pair in pieces, `attn train --guided-alignment` trains one
encoder-decoder head to follow it, the model file names that head and alignment.py reads it.

On the reversal task the true alignment is known (target word j translates source word n-1-j):
a tiny model trained with it aligns on the anti-diagonal, the same training without it does not.
"""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attn_cli.alignment import layer_index, piece_pairs, piece_words, read_pharaoh
from attn_cli.batching import MicroBatchStream, collate_pairs, process_share
from attn_cli.config import PRESETS, ModelConfig
from attn_cli.data import ParallelData
from attn_cli.decode.alignment import align, alignment_attention, chosen_heads, default_layer
from attn_cli.errors import AttnError
from attn_cli.loss import alignment_loss
from attn_cli.model import Transformer
from attn_cli.modelfile import load_model, save_model
from attn_cli.train import loop as training
from attn_cli.train.distributed import Processes
from attn_cli.train.guided import alignment_targets

from ..conftest import assert_clean_error, assert_same_weights, final_weights, run_attn
from ..toys import HostReads, reversal_pairs

LENGTH = 6  # every sequence: the anti-diagonal is then a matter of positions, learned fast
STEPS = 150


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_training():
    """One torch thread for the trainings here, as tests/train/conftest.py explains: the bounds
    below were measured so, and two threads beside another process are far slower."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


def anti_diagonal(line: str) -> str:
    count = len(line.split())
    return " ".join(f"{i}-{count - 1 - i}" for i in range(count))


@pytest.fixture(scope="module")
def reversal(tmp_path_factory) -> SimpleNamespace:
    """1000 reversal pairs, their anti-diagonal alignments, a vocabulary of the letters, and the
    pairs binarized with the alignments."""
    directory = tmp_path_factory.mktemp("guided")
    sources, targets = reversal_pairs(1000, seed=0, shortest=LENGTH, longest=LENGTH)
    files = SimpleNamespace(dir=directory, src=directory / "src.txt", tgt=directory / "tgt.txt",
                            align=directory / "align.txt", vocab=directory / "v.model",
                            data=directory / "train.st")
    files.src.write_text("\n".join(sources) + "\n")
    files.tgt.write_text("\n".join(targets) + "\n")
    files.align.write_text("\n".join(map(anti_diagonal, sources)) + "\n")
    assert run_attn("vocab", files.src, "-o", files.vocab, "--size", "24",
                    "--type", "unigram").returncode == 0
    result = run_attn("binarize", "--vocab", files.vocab, files.src, files.tgt,
                      "--alignments", files.align, "-o", files.data)
    assert result.returncode == 0, result.stderr
    return files


def train(files, run_dir, *extra):
    result = run_attn("train", files.data, "-o", run_dir, "--preset", "tiny", "--dropout", "0",
                      "--batch-tokens", "500", "--warmup", "50", "--lr-scale", "0.5",
                      "--device", "cpu", *map(str, extra))
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def trained(reversal) -> dict:
    """The same tiny training with and without --guided-alignment (λ 1: a tiny run's margin)."""
    runs = {}
    for name, guidance in (("guided", ["--guided-alignment", "--alignment-lambda", 1]),
                           ("plain", [])):
        run_dir = reversal.dir / name
        train(reversal, run_dir, "--max-steps", STEPS, "--save-every", STEPS, "--log-every",
              STEPS // 3, *guidance)
        runs[name] = run_dir
    return runs


def anti_diagonal_share(model, vocabulary, **heads) -> float:
    """Of the target words of held-out reversals, the share aligned (teacher-forced on the
    reference, alignment.align) with source word n-1-j."""
    sources, targets = reversal_pairs(100, seed=99, shortest=LENGTH, longest=LENGTH)
    src_ids, tgt_ids = vocabulary.encode(sources), vocabulary.encode(targets)
    words = [[piece_words([vocabulary.piece(token) for token in ids]) for ids in side]
             for side in (src_ids, tgt_ids)]
    found = align(model, src_ids, tgt_ids, *words, **heads)
    hits = sum(len(set(pairs) & {(LENGTH - 1 - j, j) for j in range(LENGTH)})
               for pairs in found)
    return hits / (LENGTH * len(sources))


def test_the_supervised_head_aligns_on_the_anti_diagonal_and_without_guidance_it_does_not(
        trained):
    """Measured over seeds 1-5 at these settings: guided 0.96-1.00, unguided 0.06-0.57 (the
    same head, decoder layer 0 of the tiny preset's 2, head 0)."""
    guided = load_model(trained["guided"] / f"checkpoint-{STEPS}.st")
    plain = load_model(trained["plain"] / f"checkpoint-{STEPS}.st")
    assert (guided.config.alignment_layer, guided.config.alignment_head) == (0, 0)
    assert plain.config.alignment_layer is None
    # the guided model's own head by default (alignment.chosen_heads), the same head asked of
    # the plain one
    guided_share = anti_diagonal_share(guided.model, guided.src_vocab)
    plain_share = anti_diagonal_share(plain.model, plain.src_vocab, layer=0, heads=[0])
    assert guided_share >= 0.9, (guided_share, plain_share)
    assert plain_share < 0.75, (guided_share, plain_share)
    # the metrics say how far the head is from the reference: per aligned target piece, from
    # near log 7 (uniform over 6 pieces and </s>) down
    rows = {name: [json.loads(line) for line in
                   (trained[name] / "metrics.jsonl").read_text().splitlines()]
            for name in trained}
    losses = [row["alignment_loss"] for row in rows["guided"]]
    assert losses[-1] < losses[0] < math.log(LENGTH + 1) + 0.5, losses
    assert not any("alignment_loss" in row for row in rows["plain"])


def test_a_guided_run_resumes_exactly(reversal, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    guided = ["--guided-alignment", "--save-every", 2]
    train(reversal, straight, "--max-steps", 4, *guided)
    train(reversal, resumed, "--max-steps", 2, *guided)
    train(reversal, resumed, "--max-steps", 4, "--resume", *guided)
    assert_same_weights(final_weights(straight), final_weights(resumed))


def test_a_guided_step_makes_the_host_wait_for_nothing(reversal):
    """The reference is built on the host from the micro-batch's pair indices, and its count of
    aligned pieces added to the step's sums as a host number: a guided step reads nothing back
    from the device (test_loop's test of the unguided step)."""
    data = ParallelData(reversal.data)
    config = dataclasses.replace(PRESETS["tiny"].model_config(len(data.src_vocab)),
                                 alignment_layer=0, alignment_head=0)
    model = Transformer(config).train()
    micro_batches = MicroBatchStream(data, 300, seed=1).take(2)
    share = process_share(data, micro_batches, 0, 1)
    references = [alignment_targets(data, micro_batches[place], batch.tgt_input.shape[1],
                                    batch.src_tokens.shape[1]) for place, batch in share]
    processes = Processes(0, 1, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with HostReads() as reads:
        sums = training.forward_backward(model, share, 1e-3, 0.1, processes, "fp32", scaler,
                                         seed=(1, 0), alignments=references,
                                         alignment_lambda=0.05)
    assert reads.seen == []
    assert sums.shape == (4,) and torch.isfinite(sums).all()
    assert sums[3].item() == sum(aligned for _, _, aligned in references) > 0


# ------------------------------------------------------------------------------ the loss


def test_the_alignment_loss_is_the_cross_entropy_with_the_reference():
    attention = torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.2, 0.3, 0.5]]])
    # target piece 0 aligned with source pieces 0 and 2, piece 1 with 1, piece 2 with none
    positions = torch.tensor([0 * 3 + 0, 0 * 3 + 2, 1 * 3 + 1])
    weights = torch.tensor([0.5, 0.5, 1.0])
    expected = -(0.5 * math.log(0.5) + 0.5 * math.log(0.25)) - math.log(0.8)
    assert alignment_loss(attention.log(), positions, weights).item() == \
        pytest.approx(expected, rel=1e-6)


def test_the_model_adds_its_heads_cross_entropy_and_leaves_the_translation_loss_alone():
    """forward(alignment=...) computes the cross-entropy of the configured head's attention (as
    the attention maps write it out) with the reference that alignment_targets makes of a
    micro-batch's pairs; the §5.4 sums are the ones computed without it."""
    torch.manual_seed(0)
    config = dataclasses.replace(PRESETS["tiny"].model_config(9, dropout=0.0),
                                 alignment_layer=1, alignment_head=2)
    model = Transformer(config).eval()
    pairs = [([4, 5, 6], [7, 8]), ([5, 6], [4, 4, 8])]
    # (source piece, target piece), sorted by target piece: pair 0's target piece 0 with
    # source pieces 1 and 2, its piece 1 with 0; pair 1's piece 2 with 1
    data = SimpleNamespace(
        path="train.st", src_lengths=np.array([3, 2]), tgt_lengths=np.array([2, 3]),
        alignment_offsets=np.array([0, 3, 4]),
        alignment_pairs=np.array([[1, 0], [2, 0], [0, 1], [1, 2]], dtype=np.int16))
    batch = collate_pairs(pairs)
    positions, weights, aligned = alignment_targets(data, np.array([0, 1]),
                                                    batch.tgt_input.shape[1],
                                                    batch.src_tokens.shape[1])
    assert aligned == 3 and weights.tolist() == [0.5, 0.5, 1.0, 1.0]
    tensors = batch.to("cpu")
    arguments = (tensors.src_tokens, tensors.tgt_input, tensors.target_positions,
                 tensors.targets, 0.1)
    loss, nll, alignment_sum = model(*arguments, alignment=(torch.from_numpy(positions),
                                                            torch.from_numpy(weights)))
    assert torch.equal(torch.stack([loss, nll]), torch.stack(model(*arguments)))
    with torch.no_grad():
        head = alignment_attention(model, tensors.src_tokens, tensors.tgt_input, layer=1,
                                   heads=[2])
    expected = -(0.5 * head[0, 0, 1].log() + 0.5 * head[0, 0, 2].log() + head[0, 1, 0].log()
                 + head[1, 2, 1].log())
    torch.testing.assert_close(alignment_sum.detach(), expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- words to pieces


def test_word_pairs_become_the_pairs_of_their_pieces():
    assert read_pharaoh("0-1 1-0 1-0", "a.txt line 1", 2, 2) == [(0, 1), (1, 0)]
    assert read_pharaoh("", "a.txt line 1", 0, 3) == []
    # "New York er" → pieces ▁new ▁york er: words 0 1 1; "neu yorker" → ▁neu ▁yor k er
    source_words = piece_words(["▁new", "▁york", "er"])
    target_words = piece_words(["▁neu", "▁yor", "k", "er"])
    assert piece_pairs([(0, 0), (1, 1)], source_words, target_words) == [
        (0, 0), (1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (2, 3)]
    # a word without pieces (normalised away) aligns nothing
    assert piece_pairs([(2, 0)], source_words, target_words) == []


def test_binarize_keeps_each_pairs_alignment_in_pieces_and_drops_it_with_its_pair(reversal,
                                                                                   tmp_path):
    vocab = ParallelData(reversal.data).src_vocab
    (tmp_path / "s").write_text("ab c\nd\n" + "e " * 30 + "\nf gh\n")
    (tmp_path / "t").write_text("c ab\nd\nf\ngh f\n")
    (tmp_path / "a").write_text("0-1 1-0\n0-0\n\n1-0\n")
    result = run_attn("binarize", "--vocab", reversal.vocab, tmp_path / "s", tmp_path / "t",
                      "--alignments", tmp_path / "a", "-o", tmp_path / "d.st", "--max-len", 20)
    assert result.returncode == 0, result.stderr
    assert "1 dropped (too long)" in result.stderr
    data = ParallelData(tmp_path / "d.st")
    assert len(data) == 3 and data.has_alignments

    def expected(index, word_pairs):
        src, tgt = ([vocab.piece(int(token)) for token in ids] for ids in data.pair(index))
        return piece_pairs(word_pairs, piece_words(src), piece_words(tgt))

    assert [list(map(tuple, data.alignment(i).tolist())) for i in range(3)] == [
        expected(0, [(0, 1), (1, 0)]), expected(1, [(0, 0)]), expected(2, [(1, 0)])]
    # "ab" is two pieces or more (the vocabulary knows letters): each aligned with "c"
    assert len(data.alignment(0)) > 2


@pytest.mark.parametrize("alignments,fragments", [
    ("0-1 1-0\n0-0\n", ["a.txt has 2 lines", "s.txt has 3", "one line per training pair"]),
    ("0-1 1-0\n0-0\n0-0\n0-0\n", ["a.txt has 4 lines", "s.txt has 3"]),
    ("0-1 1-0\n0:0\n0-0\n", ["a.txt line 2: '0:0' is not a pair i-j"]),
    ("0-1 1-0\n0-0\n0-0 x\n", ["a.txt line 3: 'x' is not a pair i-j"]),
    ("0-1 1-\n0-0\n0-0\n", ["a.txt line 1: '1-' is not a pair i-j"]),
    ("0-1 2-0\n0-0\n0-0\n", ["a.txt line 1: pair 2-0 names source word 2, but line 1 of",
                             "s.txt has 2 words (0-1)"]),
    ("0-1 1-0\n0-0\n0-3\n", ["a.txt line 3: pair 0-3 names target word 3, but line 3 of",
                             "t.txt has 1 word"]),
])
def test_a_bad_alignment_file_is_one_error_line_naming_it(reversal, tmp_path, alignments,
                                                         fragments):
    (tmp_path / "s.txt").write_text("a b\nc\nd\n")
    (tmp_path / "t.txt").write_text("b a\nc\nd\n")
    (tmp_path / "a.txt").write_text(alignments)
    result = run_attn("binarize", "--vocab", reversal.vocab, tmp_path / "s.txt",
                      tmp_path / "t.txt", "--alignments", tmp_path / "a.txt", "-o",
                      tmp_path / "d.st")
    assert_clean_error(result, *fragments)
    assert not (tmp_path / "d.st").exists()


@pytest.mark.parametrize("aligned,options,fragments", [
    (False, ["--guided-alignment"], ["holds no word alignments",
                                     "binarize it with --alignments"]),
    (True, ["--alignment-head", "1"], ["--alignment-head", "add --guided-alignment"]),
    (True, ["--guided-alignment", "--alignment-head", "4"], ["--alignment-head 4", "4 heads"]),
    (True, ["--guided-alignment", "--alignment-layer", "2"], ["--alignment-layer 2",
                                                             "2 layers"]),
    (True, ["--guided-alignment", "--alignment-layer", "-3"], ["--alignment-layer -3"]),
])
def test_training_options_that_cannot_guide_are_one_error_line(reversal, tmp_path, aligned,
                                                               options, fragments):
    data = reversal.data
    if not aligned:  # the same pairs binarized without alignments
        data = tmp_path / "plain.st"
        assert run_attn("binarize", "--vocab", reversal.vocab, reversal.src, reversal.tgt,
                        "-o", data).returncode == 0
    result = run_attn("train", data, "-o", tmp_path / "run", "--preset", "tiny",
                      "--max-steps", "1", "--device", "cpu", *options)
    assert_clean_error(result, *fragments)


# ------------------------------------------------------------------------- the model file


def test_the_model_file_names_the_supervised_head_and_alignments_read_it(reversal, tmp_path):
    vocabulary = ParallelData(reversal.data).src_vocab
    plain_config = PRESETS["tiny"].model_config(len(vocabulary), dropout=0.0)
    # a file without the fields (every model written before them, and every unguided one)
    assert "alignment" not in plain_config.to_json()
    assert ModelConfig.from_json(plain_config.to_json()).alignment_layer is None
    guided_config = dataclasses.replace(plain_config, alignment_layer=1, alignment_head=3)
    assert ModelConfig.from_json(guided_config.to_json()) == guided_config
    with pytest.raises(ValueError, match="alignment_head 4"):
        dataclasses.replace(plain_config, alignment_layer=1, alignment_head=4)

    torch.manual_seed(0)
    save_model(tmp_path / "m.st", Transformer(guided_config), vocabulary)
    loaded = load_model(tmp_path / "m.st")
    assert loaded.config == guided_config
    assert chosen_heads(loaded.config) == (1, [3])  # by default: the supervised head
    assert chosen_heads(loaded.config, -2) == (0, None)  # another layer: its heads' average
    assert chosen_heads(plain_config) == (  # unguided: `default_layer`'s heads averaged
        layer_index(default_layer(plain_config.decoder_layers), plain_config.decoder_layers), None)
    src = torch.tensor([[4, 5, 6, 3]])
    tgt_in = torch.tensor([[2, 6, 5, 4]])
    with torch.inference_mode():
        assert torch.equal(alignment_attention(loaded.model, src, tgt_in),
                           alignment_attention(loaded.model, src, tgt_in, 1, [3]))


def test_a_reference_past_its_pieces_is_a_corrupt_data_file():
    data = SimpleNamespace(path="train.st", src_lengths=np.array([2]), tgt_lengths=np.array([2]),
                           alignment_offsets=np.array([0, 1]),
                           alignment_pairs=np.array([[2, 0]], dtype=np.int16))
    with pytest.raises(AttnError, match="train.st is corrupt"):
        alignment_targets(data, np.array([0]), 3, 3)
