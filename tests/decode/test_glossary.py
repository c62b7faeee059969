"""Glossaries (glossary.py): reading a TSV of terms or a request's pairs, every bad input one
error line naming the file and line (or the pair), and finding the terms in a text: whole words
only, a lower-case term in any casing, a capitalised one as written, whitespace runs as one
space, the longest match first. No model: these are the source side of `--glossary`."""

from __future__ import annotations

import itertools
import random
import sys
import unicodedata

import pytest

from attn_cli.decode.glossary import MARK_PLANES, Glossary, Match, Term
from attn_cli.errors import AttnError


def glossary_file(tmp_path, content: str | bytes):
    path = tmp_path / "glossary.tsv"
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_bytes(content)
    return path


def found(glossary: Glossary, text: str) -> list[tuple[str, str]]:
    """Each match as (the text it covers, the target it forces), in order."""
    return [(text[match.start:match.end], match.target) for match in glossary.matches(text)]


def error_of(make) -> str:
    """The message of the AttnError that `make()` raises, checked to be one line."""
    with pytest.raises(AttnError) as raised:
        make()
    message = str(raised.value)
    assert "\n" not in message
    return message


# Reading a file


def test_a_file_is_read_skipping_comments_and_blank_lines(tmp_path):
    """Comment lines (`#`, maybe indented) and blank ones are skipped; each term keeps its line
    number, and the terms keep the file's order."""
    path = glossary_file(tmp_path, "# terms of the bank\n\nbank\tBank\n   \n  # indented\n"
                                   "credit card\tKreditkarte\n")
    glossary = Glossary.read(path)
    assert len(glossary) == 2
    assert glossary.terms == (Term("bank", "Bank", 3), Term("credit card", "Kreditkarte", 6))


def test_a_byte_order_mark_and_crlf_line_ends_are_tolerated(tmp_path):
    """A spreadsheet's export: a BOM before the first term and CRLF line ends are not part of
    the terms."""
    path = glossary_file(tmp_path, "\ufeffbank\tBank\r\nloan\tKredit\r\n".encode("utf-8"))
    assert Glossary.read(path).terms == (Term("bank", "Bank", 1), Term("loan", "Kredit", 2))


def test_the_whitespace_of_terms_is_squeezed(tmp_path):
    """Fields are stripped and inner runs of whitespace become one space, so a term typed with
    two spaces still matches a text with one."""
    path = glossary_file(tmp_path, "  credit \u00a0 card  \t  carte   de crédit \n")
    glossary = Glossary.read(path)
    assert glossary.terms == (Term("credit card", "carte de crédit", 1),)
    assert glossary.targets("my credit card") == ["carte de crédit"]


def test_a_term_given_twice_with_the_same_target_is_kept_once(tmp_path):
    """Exact duplicates (after squeezing) are harmless: one term, its first line."""
    path = glossary_file(tmp_path, "bank\tBank\nbank \t Bank\n")
    assert Glossary.read(path).terms == (Term("bank", "Bank", 1),)


@pytest.mark.parametrize("content, line, problem", [
    ("bank\tBank\nloan\n", 2, "a glossary line is source<TAB>target, this one has 1 field "
                              "(no tab)"),
    ("bank\tBank\n\nloan\tKredit\textra\n", 3, "a glossary line is source<TAB>target, this one "
                                              "has 3 fields"),
    ("bank\tBank\n \tKredit\n", 2, "the source term is empty"),
    ("bank\t  \n", 1, "the target term is empty"),
])
def test_a_malformed_line_is_an_error_naming_file_and_line(tmp_path, content, line, problem):
    """A line without exactly one tab, or with an empty term, is refused (not skipped): the
    error names the file and the 1-based line."""
    path = glossary_file(tmp_path, content)
    assert error_of(lambda: Glossary.read(path)) == f"{path}:{line}: {problem}"


def test_a_source_term_given_two_targets_is_an_error_naming_both_lines(tmp_path):
    """Which target a term should force cannot be guessed: both lines are named."""
    path = glossary_file(tmp_path, "bank\tBank\nloan\tKredit\nbank\tUfer\n")
    assert error_of(lambda: Glossary.read(path)) == (
        f'{path}:3: "bank" is already {path}:1\'s term, with another target ("Bank" there, '
        f'"Ufer" here): keep one')


def test_lower_case_terms_equal_in_any_casing_are_one_term(tmp_path):
    """"strasse" and "straße" are found in the same texts (casefold), so two targets for them
    conflict; the error shows how the first was spelt."""
    path = glossary_file(tmp_path, "straße\tstreet\nstrasse\troad\n")
    assert error_of(lambda: Glossary.read(path)) == (
        f'{path}:2: "strasse" is already {path}:1\'s term ("straße"), with another target '
        f'("street" there, "road" here): keep one')


@pytest.mark.parametrize("content", ["", "# only a comment\n\n", "\ufeff\n"])
def test_a_file_without_terms_is_an_error(tmp_path, content):
    """An empty glossary is a mistake (a wrong file, a failed export), not "no constraints"."""
    path = glossary_file(tmp_path, content)
    assert error_of(lambda: Glossary.read(path)) == (
        f"{path}: no terms (a glossary line is source<TAB>target)")


def test_invalid_utf8_is_an_error_naming_the_line(tmp_path):
    """A Latin-1 glossary is refused at its first bad line, not read as mojibake."""
    path = glossary_file(tmp_path, b"bank\tBank\ncaf\xe9\tCaf\xe9\n")
    assert error_of(lambda: Glossary.read(path)) == f"{path}:2: invalid UTF-8 (byte 4 of the line)"


def test_a_missing_file_or_a_directory_is_an_error_naming_it(tmp_path):
    """The error names the path given, as a glossary."""
    missing = tmp_path / "missing.tsv"
    assert error_of(lambda: Glossary.read(missing)) == f"glossary {missing} does not exist"
    assert error_of(lambda: Glossary.read(tmp_path)) == (
        f"glossary {tmp_path} is a directory, not a file")


# Pairs (a request's JSON)


def test_pairs_from_a_dict_or_a_list_make_the_same_glossary():
    """serve's two JSON shapes, {source: target} and [[source, target], ...], read alike; terms
    from pairs have line 0, and are squeezed as a file's are."""
    from_dict = Glossary.from_pairs({"bank": "Bank", "credit  card": "Kreditkarte"})
    from_list = Glossary.from_pairs([["bank", "Bank"], ("credit card", " Kreditkarte")])
    assert from_dict.terms == from_list.terms == (
        Term("bank", "Bank", 0), Term("credit card", "Kreditkarte", 0))
    assert from_dict.targets("A credit card bank.") == ["Kreditkarte", "Bank"]


@pytest.mark.parametrize("pairs, message", [
    ([["bank", "Bank"], ["loan", "Kredit"], ["rate", ""]],
     "glossary[2]: the target term is empty"),
    ([["bank", "Bank"], ["loan", "Kredit", "x"]],
     "glossary[1]: a glossary pair is [source, target], this one has 3 items"),
    ([["bank"]], "glossary[0]: a glossary pair is [source, target], this one has 1 item"),
    (["bank"], "glossary[0]: a glossary pair is [source, target], not str"),
    ([["bank", 3]], "glossary[0]: the target term is int, not a string"),
    ([[None, "x"]], "glossary[0]: the source term is NoneType, not a string"),
    ([["bank", "Bank"], ["Loan", "x"], ["bank", "Ufer"]],
     'glossary[2]: "bank" is already glossary[0]\'s term, with another target ("Bank" there, '
     '"Ufer" here): keep one'),
    ({"bank": "Bank", " ": "leer"}, 'glossary[" "]: the source term is empty'),
    ({"bank": "Bank", "bank ": "Ufer"},
     'glossary["bank "]: "bank" is already glossary["bank"]\'s term, with another target '
     '("Bank" there, "Ufer" here): keep one'),
    ({}, "glossary: no terms (a glossary line is source<TAB>target)"),
    ([], "glossary: no terms (a glossary line is source<TAB>target)"),
    ("bank", "glossary: a glossary is a list of [source, target] pairs or an object of "
             "source: target, not str"),
    (3, "glossary: a glossary is a list of [source, target] pairs or an object of "
        "source: target, not int"),
])
def test_bad_pairs_are_errors_naming_the_pair(pairs, message):
    """Each error names the pair by its 0-based index in the list, or its key in the object,
    so that a client can find it in its request."""
    assert error_of(lambda: Glossary.from_pairs(pairs)) == message


def test_pairs_errors_use_the_given_name():
    """A server names where the pairs came from (`glossary` of a request, a server's file)."""
    assert error_of(lambda: Glossary.from_pairs([["a", ""]], name="request.glossary")) == (
        "request.glossary[0]: the target term is empty")


# Matching


def test_terms_match_whole_words_only():
    """"art" is not in "party" nor "artist"; punctuation is a boundary ("art's", "(art)")."""
    glossary = Glossary.from_pairs({"art": "Kunst", "bank": "Bank"})
    assert found(glossary, "The party's artist, a banker.") == []
    assert found(glossary, "art's (art) art-bank") == [
        ("art", "Kunst"), ("art", "Kunst"), ("art", "Kunst"), ("bank", "Bank")]


def test_a_boundary_is_needed_only_where_the_term_edge_is_a_word_character():
    """Terms ending or starting in punctuation: "C++" in "I like C++.", "e.g." before a comma,
    ".NET" after "ASP"; but "C" is still not inside "C++"'s neighbour "CC++"."""
    glossary = Glossary.from_pairs({"C++": "C++", "e.g.": "z. B.", ".NET": ".NET"})
    assert found(glossary, "I like C++.") == [("C++", "C++")]
    assert found(glossary, "(e.g., this) ASP.NET") == [("e.g.", "z. B."), (".NET", ".NET")]
    assert found(glossary, "CC++ and MyC++") == []


def test_word_boundaries_know_unicode_letters_and_combining_marks():
    """Non-Latin words are words: "café" is not in "cafés" (é written as e + U+0301 too), and
    a Devanagari word is not found inside a longer one (its vowel signs and viramas are
    combining marks, which Python's \\w alone does not count as word characters)."""
    glossary = Glossary.from_pairs({"café": "Café", "cafe\u0301": "Café", "हिन्दी": "Hindi",
                                    "東京": "Tokyo"})
    assert found(glossary, "cafés cafe\u0301s café") == [("café", "Café")]
    assert found(glossary, "हिन्दीभाषा हिन्दी") == [("हिन्दी", "Hindi")]
    assert found(glossary, "in 東京.") == [("東京", "Tokyo")]


def test_the_combining_marks_are_all_in_the_planes_scanned():
    """token_pattern scans only MARK_PLANES for combining marks (to start fast): a Python whose
    Unicode puts marks elsewhere must widen them."""
    scanned = {code for plane in MARK_PLANES for code in plane}
    outside = [hex(code) for code in range(sys.maxunicode + 1)
               if code not in scanned and unicodedata.category(chr(code)).startswith("M")]
    assert outside == []


def test_a_lower_case_term_matches_any_casing():
    """"bank" is found as "Bank" and "BANK"; casefold, so "straße" is found as "STRASSE"."""
    glossary = Glossary.from_pairs({"bank": "Bank", "straße": "Straße"})
    assert [match.start for match in glossary.matches("bank Bank BANK bAnK")] == [0, 5, 10, 15]
    assert found(glossary, "STRASSE") == [("STRASSE", "Straße")]


def test_a_capitalised_term_matches_only_as_written():
    """A name ("Apple", "AWS") is a different word in another casing."""
    glossary = Glossary.from_pairs({"Apple": "Apple Inc.", "AWS": "Amazon Web Services"})
    assert found(glossary, "an apple, APPLE, aws, Aws") == []
    assert found(glossary, "Apple on AWS") == [("Apple", "Apple Inc."),
                                               ("AWS", "Amazon Web Services")]


def test_a_capitalised_term_wins_over_a_lower_case_one_on_the_same_text():
    """"Bank" (a name) and "bank" both match "Bank": the one written so is more specific."""
    glossary = Glossary.from_pairs({"bank": "Ufer", "Bank": "Bank AG"})
    assert found(glossary, "Bank bank BANK") == [("Bank", "Bank AG"), ("bank", "Ufer"),
                                                 ("BANK", "Ufer")]


def test_the_target_is_forced_as_written_whatever_the_texts_case():
    """A sentence-initial "Credit card" forces "carte de crédit" as written: the translation
    seldom starts with the term ("Les paiements par carte de crédit")."""
    glossary = Glossary.from_pairs({"credit card": "carte de crédit", "bank": "banque",
                                    "Apple": "apple"})
    assert found(glossary, "Credit card and credit card") == [
        ("Credit card", "carte de crédit"), ("credit card", "carte de crédit")]
    assert found(glossary, "BANK by Apple") == [("BANK", "banque"), ("Apple", "apple")]


def test_a_multi_word_term_matches_across_any_whitespace_run():
    """A term's space is any run of whitespace (no-break space, tabs, a line break), and the
    match covers the whole run; no whitespace, or a hyphen, is another word."""
    glossary = Glossary.from_pairs({"credit card": "Kreditkarte"})
    for text in ["credit\u00a0card", "credit   card", "credit\t\ncard"]:
        assert glossary.matches(f"a {text}.") == [
            Match(2, 2 + len(text), Term("credit card", "Kreditkarte", 0), "Kreditkarte")]
    assert found(glossary, "creditcard credit-card") == []


def test_overlapping_terms_take_the_longest_match_first():
    """"New York City" over "New York" over "York"; a shorter term still matches where it
    stands alone. Length decides before position: the later, longer "b c d" beats "a b"."""
    glossary = Glossary.from_pairs({"New York": "NY", "New York City": "NYC", "York": "Y"})
    assert found(glossary, "New York City, New York, York") == [
        ("New York City", "NYC"), ("New York", "NY"), ("York", "Y")]
    glossary = Glossary.from_pairs({"a b": "AB", "b c d": "BCD"})
    assert found(glossary, "a b c d") == [("b c d", "BCD")]


def test_overlapping_terms_of_one_length_take_the_leftmost():
    """"a b" and "b c" (same length) in "a b c": the leftmost is chosen, the other overlaps it."""
    glossary = Glossary.from_pairs({"a b": "AB", "b c": "BC"})
    assert found(glossary, "a b c") == [("a b", "AB")]


def test_targets_are_each_matched_target_once_in_text_order():
    """The constraints of a line: first-occurrence order, duplicates removed."""
    glossary = Glossary.from_pairs({"bank": "Bank", "loan": "Kredit", "credit": "Kredit"})
    assert glossary.targets("A loan from the bank, a bank loan, credit.") == ["Kredit", "Bank"]
    assert glossary.targets("nothing here") == []
    assert glossary.targets("") == []


def test_a_hundred_thousand_terms_match_a_thousand_lines():
    """The index, not a loop over the terms: 10^5 terms of one to three words (sharing first
    words, as real ones do; some with punctuation or capitals) against 10^3 lines of 30 words;
    each match found is its term's text, and the line's longest terms are taken."""
    words = [f"w{index}" for index in range(10_000)] + ["C++", "e.g.", "Apple"]
    sources = (words + [f"{first} {second}" for first, second in
                        itertools.product(words[:200], words[200:400])]
               + [" ".join(three) for three in
                  itertools.product(words[:40], words[40:80], words[80:115])])[:100_000]
    glossary = Glossary.from_pairs([(source, f"t{index}") for index, source in enumerate(sources)])
    assert len(glossary) == 100_000
    generator = random.Random(0)
    lines = [" ".join(generator.choices(words[:120], k=30)) + " C++." for _ in range(1_000)]
    matches = [glossary.matches(line) for line in lines]
    for line, line_matches in zip(lines[:50], matches):
        for match in line_matches:
            assert " ".join(line[match.start:match.end].split()) == match.term.source
    assert sum(map(len, matches)) > 10_000
    assert any(match.term.source.count(" ") == 2 for match in itertools.chain(*matches))
    assert all(line_matches[-1].term.source == "C++" for line_matches in matches)
