"""`attn score --tokenize compound-split`: the paper's tokenized BLEU with hyphenated compounds
split (tensor2tensor's get_ende_bleu), checked on hand-worked examples."""

from __future__ import annotations

import math

import pytest

from attn_cli.compound_bleu import moses_like_tokenize, paper_words, split_compounds
from attn_cli.scoring import text_scores

from .conftest import assert_clean_error, run_attn


def test_words_break_as_moses_tokenizer_breaks_them():
    line = "Das „Rich-Text“-Format kostet 1,50 Euro, z.B. hier... Dr. Müller's Büro."
    # „ and “ split off (not alphanumeric, not . ' ` , -); 1,50 keeps its comma (digits on
    # both sides), Euro, does not; z.B. keeps its period (another period and a letter); the
    # run of dots is one word; Dr. before an upper-case word and the last word's period split;
    # the apostrophe split (German); the hyphens stay inside words: compounds come next.
    assert moses_like_tokenize(line) == (
        "Das „ Rich-Text “ -Format kostet 1,50 Euro , z.B. hier ... Dr . Müller ' s Büro .")
    assert moses_like_tokenize("etwa 3. am Montag.\tOk") == "etwa 3. am Montag . Ok"


@pytest.mark.parametrize("tokenized,split", [
    ("rich-text format", "rich ##AT##-##AT## text format"),
    ("Rich-Text-Format", "Rich ##AT##-##AT## Text ##AT##-##AT## Format"),
    # as Perl's s{(\S)-(\S)}{...}g: the first match took the b, so the second hyphen stays
    ("a-b-c", "a ##AT##-##AT## b-c"),
    ("3-4 - -Format", "3 ##AT##-##AT## 4 - -Format"),
])
def test_compounds_split_as_tensor2tensor_does(tokenized, split):
    assert split_compounds(tokenized) == split


def test_corpus_bleu_by_hand():
    """Reference words: Das Rich ##AT##-##AT## Text ##AT##-##AT## Format ist gut . (9);
    hypothesis: Das Rich ##AT##-##AT## Text Format ist gut . (8). Matches: 8/8 unigrams, 6/7
    bigrams (not `Text Format`), 4/6 trigrams, 2/5 4-grams; brevity penalty exp(1 - 9/8)."""
    hypothesis, reference = "Das Rich-Text Format ist gut.", "Das Rich-Text-Format ist gut."
    assert paper_words(hypothesis) == "Das Rich ##AT##-##AT## Text Format ist gut ."
    expected = 100 * math.exp(1 - 9 / 8) * (8 / 8 * 6 / 7 * 4 / 6 * 2 / 5) ** 0.25
    score = corpus_bleu([hypothesis], [reference])
    assert score.score == pytest.approx(expected, abs=1e-9)  # 61.02
    assert "tok:moses-like+compound-split" in score.signature and "smooth:none" in score.signature
    assert corpus_bleu([hypothesis.lower()], [reference], lowercase=True).score == \
        pytest.approx(expected, abs=1e-9)


def corpus_bleu(hypotheses: list[str], references: list[str], lowercase: bool = False):
    """The paper's BLEU as `attn score --tokenize compound-split` computes it."""
    return text_scores(hypotheses, references, ["bleu"], "compound-split", lowercase)[0]


def test_score_command_reports_the_papers_bleu_beside_chrf(tmp_path):
    hypotheses = tmp_path / "hyp.de"
    references = tmp_path / "ref.de"
    hypotheses.write_text("Das Rich-Text Format ist gut.\nHallo Welt!\n", encoding="utf-8")
    references.write_text("Das Rich-Text-Format ist gut.\nHallo, Welt!\n", encoding="utf-8")
    paper = run_attn("score", "--ref", references, hypotheses, "--tokenize", "compound-split")
    assert paper.returncode == 0, paper.stderr
    bleu_line, chrf_line = paper.stdout.splitlines()
    assert bleu_line.startswith("BLEU|nrefs:1|case:mixed|eff:no|tok:moses-like+compound-split|")
    expected = corpus_bleu(hypotheses.read_text().splitlines(),
                           references.read_text().splitlines())
    assert f"= {expected.score:.2f} " in bleu_line
    plain = run_attn("score", "--ref", references, hypotheses)
    assert chrf_line == plain.stdout.splitlines()[1]  # chrF takes no tokenizer: unchanged
    assert plain.stdout.splitlines()[0] != bleu_line
    each = run_attn("score", "--ref", references, hypotheses, "--tokenize", "compound-split",
                    "--sentence-level")
    assert each.returncode == 0 and len(each.stdout.splitlines()) == 2
    assert float(each.stdout.splitlines()[0]) == pytest.approx(61.02, abs=0.01)


def test_score_compound_split_with_mismatched_files(tmp_path):
    (tmp_path / "hyp").write_text("a\nb\n", encoding="utf-8")
    (tmp_path / "ref").write_text("a\n", encoding="utf-8")
    assert_clean_error(run_attn("score", "--ref", tmp_path / "ref", tmp_path / "hyp",
                                "--tokenize", "compound-split"), "line counts differ")
