"""`attn decode --split-sentences` and `Translator.translate_paragraphs`: a line cut into
sentences translates as those sentences do one per line, joined with the line's spacing.

On the committed reversal model (tests/fixtures): its inputs are letters, and "?" and "!" (which
it has never seen) end its sentences, since sentencex takes a single letter before "." for an
initial."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attn_cli.decode.pipe import sentence_language
from attn_cli.decode.translator import load_translator, model_langs
from attn_cli.modelfile import load_model, save_model

from ..conftest import assert_clean_error, run_attn

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text(encoding="utf-8"))
CHECKPOINT = FIXTURES / GOLDEN["checkpoint"]
# One thread: a command's own threads wait on each other when another process holds a core.
ON_CPU = ["--device", "cpu", "--threads", "1"]

# Input lines, each as its sentences and the spacing around them (what sentences.split must
# find: written out here, so that the check does not lean on the code it checks).
LINES = [
    (["g d j c d d?", "b e g i!", "f g d c"], ["", " ", "  ", ""]),
    ([], [""]),
    ([], [" \t "]),
    (["c h g?", "g b c"], ["  ", "\t", " "]),
    (["a b", "c d"], ["", "\r", ""]),
    (["e f", "g h?"], ["", "\u2028", ""]),
    (["j h a f"], ["", ""]),
]


def joined(sentences: list[str], spacing: list[str]) -> str:
    return spacing[0] + "".join(s + after for s, after in zip(sentences, spacing[1:]))


@pytest.mark.parametrize("options", [[], ["--sample", "--seed", "5", "--buffer-size", "2"],
                                     ["-m", CHECKPOINT]],
                         ids=["beam", "sample", "ensemble"])
def test_a_line_translates_as_its_sentences_do_one_per_line(options, tmp_path):
    paragraphs = "".join(joined(*line) + "\n" for line in LINES)
    sentences = [sentence for line_sentences, _ in LINES for sentence in line_sentences]
    common = ["decode", "-m", CHECKPOINT, *ON_CPU, *options]
    alone = run_attn(*common, stdin="\n".join(sentences) + "\n")
    assert alone.returncode == 0, alone.stderr
    stats = tmp_path / "stats.json"
    split = run_attn(*common, "--split-sentences", "--stats-json", stats, stdin=paragraphs)
    assert split.returncode == 0, split.stderr

    translations = iter(alone.stdout.split("\n"))
    expected = "".join(joined([next(translations) for _ in line_sentences], spacing) + "\n"
                       for line_sentences, spacing in LINES)
    assert split.stdout == expected  # blank lines as they are, "\r" and U+2028 kept
    assert f"{len(sentences)} sentences cut from 5 lines" in split.stderr
    assert "by the rules of 'en' (no source language known from the model)" in split.stderr
    record = json.loads(stats.read_text())
    assert (record["sentences"], record["split_lines"]) == (len(sentences), 5)


def test_lines_of_one_sentence_decode_as_without_splitting():
    """The golden inputs (no sentence end inside) give the golden outputs."""
    result = run_attn("decode", "-m", CHECKPOINT, *ON_CPU, "--split-sentences",
                      stdin="\n".join(GOLDEN["inputs"]) + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == GOLDEN["beam4"]


def test_the_sentences_of_all_texts_are_searched_in_shared_batches():
    translator = load_translator(CHECKPOINT, device="cpu", threads=1, workers=1)
    searched = []
    for name in ("search", "stream_search"):  # batches, or a stream (the C++ fused step)
        search = getattr(translator, name)
        setattr(translator, name, lambda ids, *rest, search=search, **named:
                searched.append(len(ids)) or search(ids, *rest, **named))
    texts = [joined(*line) for line in LINES]
    found = translator.translate_paragraphs(texts)
    assert searched == [10]  # one batch: every sentence of every text
    one_per_line = iter(translator.translate([s for sentences, _ in LINES for s in sentences]))
    assert found == [joined([next(one_per_line) for _ in sentences], spacing)
                     for sentences, spacing in LINES]
    assert translator.translate_paragraphs([]) == []


def test_the_language_is_the_users_then_the_models_then_english(tmp_path):
    assert model_langs({"langs": "de-en"}) == ("de", "en")
    assert model_langs({"langs": "German"}) is None and model_langs({}) is None
    assert sentence_language("pt-BR", ("de", "en")) == ("pt", "--source-lang")
    assert sentence_language(None, ("de", "en")) == ("de", "the model's source language")
    assert sentence_language(None, None)[0] == "en"

    loaded = load_model(CHECKPOINT)
    german = tmp_path / "de-en.st"
    save_model(german, loaded.model, loaded.src_vocab, None, langs="de-en")
    line = "Sie kam am 3. Mai. Er nicht.\n"  # German's rules: two sentences; English's: three
    by_model = run_attn("decode", "-m", german, *ON_CPU, "--split-sentences",
                        stdin=line)
    assert "2 sentences cut from 1 lines" in by_model.stderr, by_model.stderr
    assert "rules of 'de' (the model's source language)" in by_model.stderr
    by_user = run_attn("decode", "-m", german, *ON_CPU, "--split-sentences",
                       "--source-lang", "en", stdin=line)
    assert "3 sentences cut from 1 lines" in by_user.stderr, by_user.stderr


@pytest.mark.parametrize("options, fragments", [
    (["--split-sentences", "--nbest", "2"], ["--split-sentences", "--nbest 2"]),
    (["--split-sentences", "--attention", "maps.st"], ["--attention", "--split-sentences"]),
    (["--source-lang", "de"], ["--source-lang", "add --split-sentences"]),
    (["--split-sentences", "--source-lang", "German language"], ["--source-lang",
                                                                 "'German language'"]),
])
def test_options_that_do_not_go_with_splitting_are_one_line(options, fragments):
    result = run_attn("decode", "-m", CHECKPOINT, *ON_CPU, *options, stdin="a b\n")
    assert_clean_error(result, *fragments)
