"""`attn decode --constraints`, `--glossary` and `--ban` (controls.py, lexical.py) through the
real entry point, on the committed reversal model (tests/fixtures: outputs are the inputs' letters
reversed): phrases held, phrases kept out, a prefix and phrases together, nothing changed without
them, and each bad input one line naming its file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attn_cli.decode.controls import Controls, split_fields
from attn_cli.decode.translator import load_translator
from attn_cli.errors import AttnError

from ..conftest import assert_clean_error, run_attn

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text(encoding="utf-8"))
CHECKPOINT = FIXTURES / GOLDEN["checkpoint"]
ON_CPU = ["--device", "cpu", "--threads", "1"]
INPUTS = GOLDEN["inputs"][:6]
# Phrases the free outputs do not hold: one word, two words, a word twice, three phrases.
PHRASES = [["a a"], ["j", "f e"], ["c c"], ["b", "h", "i i"], ["e f g"], []]


def decode(*options, stdin: str):
    result = run_attn("decode", "-m", CHECKPOINT, *ON_CPU, *options, stdin=stdin)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines(), result.stderr


def holds(output: str, phrase: str) -> bool:
    return f" {phrase} " in f" {output} "


@pytest.mark.parametrize("beam", [4, 1])
def test_every_phrase_is_in_every_output(beam):
    lines = "".join("\t".join([source, *phrases]) + "\n"
                    for source, phrases in zip(INPUTS, PHRASES))
    outputs, _ = decode("--beam", beam, "--constraints", stdin=lines)
    assert len(outputs) == len(INPUTS)
    free = GOLDEN["beam4"] if beam == 4 else GOLDEN["greedy"]
    for output, phrases, unforced in zip(outputs, PHRASES, free):
        assert all(holds(output, phrase) for phrase in phrases), (output, phrases)
        if not phrases:
            assert output == unforced
    assert any(not holds(unforced, phrases[0]) for unforced, phrases in zip(free, PHRASES[:5]))


@pytest.mark.parametrize("search", ["misses", "all"])
def test_a_phrase_the_output_holds_anyway_changes_nothing_by_default(search):
    """--constraint-search misses (the default): a line whose free output already holds its
    phrases keeps that output, byte for byte; `all` searches it with them (the phrases still
    held, the output maybe another)."""
    phrases = [free.split()[1] for free in GOLDEN["beam4"][:6]]
    lines = "".join(f"{source}\t{phrase}\n" for source, phrase in zip(INPUTS, phrases))
    outputs, _ = decode("--constraints", "--constraint-search", search, stdin=lines)
    assert all(holds(output, phrase) for output, phrase in zip(outputs, phrases))
    if search == "misses":
        assert outputs == GOLDEN["beam4"][:6]


def test_a_prefix_and_phrases_together_and_nbest():
    lines = "".join(f"{source}\t{prefix}\t{phrase}\n" for source, prefix, phrase in
                    zip(INPUTS[:3], ["j j", "", "d"], ["a a", "c c", "b b"]))
    outputs, _ = decode("--prefix", "--constraints", "--nbest", "2", stdin=lines)
    best = [row.split("\t")[2] for row in outputs if row.startswith(("0\t", "1\t", "2\t"))][::2]
    assert best[0].startswith("j j") and holds(best[0], "a a")
    assert holds(best[1], "c c")
    assert best[2].startswith("d") and holds(best[2], "b b")


def test_a_glossary_forces_the_terms_found_in_each_line(tmp_path):
    """Terms are found on word boundaries ("g d" in line 1, not inside another word), their
    targets held; a line without a term is the free search's."""
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("# source<TAB>target\ng d\ta a\nc j f\tb b\nzz\tc\n", encoding="utf-8")
    outputs, _ = decode("--glossary", glossary, stdin="\n".join(GOLDEN["inputs"]) + "\n")
    for source, output, free in zip(GOLDEN["inputs"], outputs, GOLDEN["beam4"]):
        expected = [target for term, target in (("g d", "a a"), ("c j f", "b b"))
                    if holds(source, term)]
        assert all(holds(output, target) for target in expected), (source, output)
        if not expected:
            assert output == free
    assert holds(outputs[0], "a a") and holds(outputs[4], "b b")


def test_banned_phrases_appear_in_no_output(tmp_path):
    banned = tmp_path / "ban.txt"
    banned.write_text("d d\n\n# a comment\nj\n", encoding="utf-8")
    outputs, _ = decode("--ban", banned, "--nbest", "3",
                        stdin="\n".join(GOLDEN["inputs"]) + "\n")
    texts = [row.split("\t")[2] for row in outputs]
    assert texts and not any(holds(text, "d d") or holds(text, "j") for text in texts)
    assert any(holds(free, "d d") for free in GOLDEN["beam4"])


def test_an_output_that_cannot_hold_its_phrases_is_warned_about():
    """--max-len-b 0: the output may be as long as the source only, and a phrase of more
    pieces than that cannot fit; the line still gets an output, and stderr names it."""
    outputs, stderr = decode("--constraints", "--max-len-b", "0", "--max-len-a", "1",
                             stdin="a\tb c d e f g\nb e g i\n")
    assert len(outputs) == 2
    assert "line 1: its output could not hold every constraint" in stderr
    assert "line 2:" not in stderr


def test_the_lines_before_a_bad_one_are_translated_first():
    result = run_attn("decode", "-m", CHECKPOINT, *ON_CPU, "--constraints",
                      stdin="g d j c d d\tc c\nb e\t\tf\n")
    assert result.returncode == 2 and "error: <stdin>:2: constraint 1 is empty" in result.stderr
    assert len(result.stdout.splitlines()) == 1 and holds(result.stdout.strip(), "c c")


def test_the_fields_of_a_line():
    assert split_fields("s\tp\tc1\tc2", True, True, "f", 1) == ("s", "p", ["c1", "c2"])
    assert split_fields("s\t\tc1", True, True, "f", 1) == ("s", "", ["c1"])
    assert split_fields("s", True, True, "f", 1) == ("s", "", [])
    assert split_fields("s\t", False, True, "f", 1) == ("s", "", [])
    assert split_fields("s\ta\tb", False, False, "f", 1) == ("s\ta\tb", "", [])
    with pytest.raises(AttnError, match=r"^f:4: constraint 2 is empty"):
        split_fields("s\tc1\t \tc3", False, True, "f", 4)
    with pytest.raises(AttnError, match=r"^f:2: --prefix reads one tab per line"):
        split_fields("s\tp\tc", True, False, "f", 2)


def test_controls_merge_phrases_once():
    controls = Controls((5,), ((1, 2),)).with_phrases([(1, 2), (3,), (3,)])
    assert controls == Controls((5,), ((1, 2), (3,)))
    assert controls.with_phrases([(3,)]) is controls


def test_the_python_api_takes_controls():
    translator = load_translator(CHECKPOINT, device="cpu", threads=1, workers=1)
    vocab = translator.tgt_vocab
    controls = [Controls(phrases=(tuple(vocab.encode(["a a"])[0]),)), None]
    found = translator.translate_window(INPUTS[:2], 1,
                                        controls=[controls[0], Controls()])
    assert holds(translator.detokenize([found[0][0]])[0], "a a")
    assert translator.detokenize([found[1][0]])[0] == GOLDEN["beam4"][1]


def test_a_translator_is_made_with_its_glossary_and_bans_as_the_command_is(tmp_path):
    """From Python the controls come with the translator, as paths or as values: the same
    outputs as `attn decode --glossary --ban`; the translator is complete when made."""
    (tmp_path / "terms.tsv").write_text("g d\ta a\nc j f\tb b\n", encoding="utf-8")
    (tmp_path / "ban.txt").write_text("d d\n", encoding="utf-8")
    lines = GOLDEN["inputs"]
    command, _ = decode("--glossary", tmp_path / "terms.tsv", "--ban", tmp_path / "ban.txt",
                        stdin="\n".join(lines) + "\n")
    from_files = load_translator(CHECKPOINT, device="cpu", threads=1, workers=1,
                                 glossary=tmp_path / "terms.tsv", bans=tmp_path / "ban.txt")
    from_values = load_translator(CHECKPOINT, device="cpu", threads=1, workers=1,
                                  glossary={"g d": "a a", "c j f": "b b"}, bans=["d d", " "])
    assert from_files.translate(lines) == from_values.translate(lines) == command
    assert command != GOLDEN["beam4"]  # the controls changed outputs
    assert from_values.controls.bans == [from_values.tgt_vocab.encode(["d d"])[0]]


def test_a_bad_control_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    from attn_cli.decode import translator as translator_module

    def loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the controls were read")

    monkeypatch.setattr(translator_module, "load_models", loading)
    (tmp_path / "terms.tsv").write_text("g d\n", encoding="utf-8")
    for controls, message in (({"glossary": tmp_path / "terms.tsv"}, "terms.tsv:1:"),
                              ({"bans": tmp_path / "absent.txt"}, "absent.txt"),
                              ({"bans": ["", "  "]}, "bans: no phrases to ban"),
                              ({"shortlist": tmp_path / "terms.tsv"}, "terms.tsv")):
        with pytest.raises(AttnError, match=message):
            load_translator(CHECKPOINT, device="cpu", **controls)


def test_a_parser_takes_no_glossary_bans_or_shortlist():
    """A constraint of its own on every batch (parsing's trees) forces pieces the controls
    know nothing of: refused, not ignored."""
    def parser_constraint(loaded):
        return lambda lines: None

    with pytest.raises(AttnError, match="for translation, not parsing"):
        load_translator(CHECKPOINT, device="cpu", threads=1, bans=["a"],
                        constraint_for=parser_constraint)


@pytest.mark.parametrize("options, stdin, files, message", [
    (["--constraints"], "b e\t\tf\ng d j\tc c\n", {},
     "error: <stdin>:1: constraint 1 is empty"),
    (["--constraints"], "b e\tx y\ng d j\tc c\n", {},
     "error: <stdin>:1: the constraint 'x y' has characters outside the model's target "
     "vocabulary"),
    (["--glossary", "{terms}"], "g d j\n", {"terms": "g d\ta a\nb c d\n"},
     "error: {terms}:2: a glossary line is source<TAB>target, this one has 1 field"),
    (["--glossary", "{terms}"], "g d j\n", {"terms": "g d\ta a\nb\t \n"},
     "error: {terms}:2: the target term is empty"),
    (["--glossary", "{terms}"], "g d j\n", {"terms": "g d\ta a\nb\txyz\n"},
     "error: {terms}:2: the target term 'xyz' has characters outside the model's target "
     "vocabulary"),
    (["--glossary", "{missing}"], "g d j\n", {}, "error: glossary {missing} does not exist"),
    (["--ban", "{ban}"], "g d j\n", {"ban": "\n# nothing\n"},
     "error: {ban}: no phrases to ban"),
    (["--ban", "{ban}"], "g d j\n", {"ban": "a\nq q\n"},
     "error: {ban}:2: the banned phrase 'q q' has characters outside"),
    (["--constraints", "--sample"], "g d j\n", {}, "error: --constraints does not go with "
     "--sample"),
    (["--glossary", "{terms}", "--sample"], "g d j\n", {"terms": "g\ta\n"},
     "error: --glossary does not go with --sample"),
    (["--constraints", "--split-sentences"], "g d j\n", {},
     "error: --constraints does not go with --split-sentences"),
])
def test_bad_controls_get_one_line_naming_the_file_and_line(tmp_path, options, stdin, files,
                                                           message):
    paths = {name: tmp_path / f"{name}.txt" for name in ("terms", "ban", "missing")}
    for name, text in files.items():
        paths[name].write_text(text, encoding="utf-8")
    options = [option.format(**paths) for option in options]
    result = run_attn("decode", "-m", CHECKPOINT, *ON_CPU, *options, stdin=stdin)
    assert_clean_error(result)
    assert message.format(**paths) in result.stderr, result.stderr
