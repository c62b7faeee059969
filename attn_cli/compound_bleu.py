"""The paper's BLEU: tokenized, with hyphenated compounds split (`attn score --tokenize
compound-split`).

The 27.3 (base) and 28.4 (big) of Table 2 are not sacreBLEU scores. They were computed the way
tensor2tensor's `get_ende_bleu.sh` does it: hypotheses and references tokenized with Moses'
`tokenizer.perl`, every hyphen between two non-spaces written as a word of its own
(`rich-text` → `rich ##AT##-##AT## text`, the convention of GNMT, ConvS2S and Stanford's NMT
data), then BLEU over the resulting words, case-sensitive (`multi-bleu.perl`: no smoothing, no
further tokenization). Splitting compounds adds easy matches, so this score runs higher than
sacreBLEU's detokenized 13a; only it compares with the paper's table.

attn tokenizes with the rules of `tokenizer.perl` (default mode, not `-a`; German/generic
apostrophes) that decide where words break: symbols and punctuation other than . ' ` , - split
off, commas split except between digits, runs of dots kept together, a word-final period split
unless it ends an abbreviation (a word with another period and a letter, such as z.B., or one
followed by a lower-case word). Moses' per-language lists of abbreviations are not used, nor its
escaping of & < > ' " (which changes no word boundary), so a period after `Dr` or `Nr` becomes a
word of its own on both sides; the scores differ from the Perl pipeline's by that little.
Pure Python (sacrebleu's `regex`), no torch.
"""

from __future__ import annotations

import regex

SIGNATURE_TOKENIZER = "moses-like+compound-split"

_SPACES = regex.compile(r"\s+")
_CONTROL = regex.compile(r"[\x00-\x1f]")
# \p{IsAlnum} of Perl: letters (with their marks) and digits
_SPECIAL = regex.compile(r"([^\p{L}\p{M}\p{N}\s\.'`,\-])")
_DOT_RUN = regex.compile(r"\.(\.+)")
_COMMA_AFTER_NON_DIGIT = regex.compile(r"([^\p{N}]),")
_COMMA_BEFORE_NON_DIGIT = regex.compile(r",([^\p{N}])")
_FINAL_PERIOD = regex.compile(r"(\S+)\.")
_LETTER = regex.compile(r"\p{L}")
_LOWER_START = regex.compile(r"\p{Ll}")
_COMPOUND_HYPHEN = regex.compile(r"(\S)-(\S)")


def moses_like_tokenize(line: str) -> str:
    """`line`'s words as tokenizer.perl (default mode, German) breaks them, space-separated."""
    text = _CONTROL.sub("", _SPACES.sub(" ", f" {line} "))
    text = _SPECIAL.sub(r" \1 ", text)
    # A run of dots is one word (placeholders keep it out of the period rule below).
    text = _DOT_RUN.sub(r" DOTMULTI\1", text)
    while "DOTMULTI." in text:
        text = regex.sub(r"DOTMULTI\.([^.])", r"DOTDOTMULTI \1", text)
        text = text.replace("DOTMULTI.", "DOTDOTMULTI")
    text = _COMMA_AFTER_NON_DIGIT.sub(r"\1 , ", text)
    text = _COMMA_BEFORE_NON_DIGIT.sub(r" , \1", text)
    text = text.replace("'", " ' ")
    words = text.split()
    for index, word in enumerate(words):
        match = _FINAL_PERIOD.fullmatch(word)
        if match is None:
            continue
        stem = match.group(1)
        last = index == len(words) - 1
        abbreviation = ("." in stem and _LETTER.search(stem)) or (
            not last and _LOWER_START.match(words[index + 1]))
        if last or not abbreviation:
            words[index] = f"{stem} ."
    text = " ".join(words)
    while "DOTDOTMULTI" in text:
        text = text.replace("DOTDOTMULTI", "DOTMULTI.")
    return " ".join(text.replace("DOTMULTI", ".").split())


def split_compounds(tokenized: str) -> str:
    """`x-y` → `x ##AT##-##AT## y`, left to right as Perl's s{(\\S)-(\\S)}{...}g: in `a-b-c`
    the second hyphen follows a consumed `b` and stays."""
    return _COMPOUND_HYPHEN.sub(r"\1 ##AT##-##AT## \2", tokenized)


def paper_words(line: str) -> str:
    return split_compounds(moses_like_tokenize(line))


def bleu_metric(lowercase: bool = False, sentence: bool = False):
    """sacrebleu's BLEU as multi-bleu.perl computes it over `paper_words`: no tokenizer of its
    own, no smoothing (at the sentence level, sacrebleu's exp smoothing)."""
    from sacrebleu.metrics import BLEU

    # multi-bleu.perl: no smoothing (a corpus with no matching 4-gram scores 0)
    return BLEU(tokenize="none", lowercase=lowercase, effective_order=sentence,
                smooth_method="exp" if sentence else "none")


def signature(metric) -> str:
    """`bleu_metric`'s signature, naming the tokenization it was given."""
    return metric.get_signature().format().replace("tok:none", f"tok:{SIGNATURE_TOKENIZER}")


def sentence_bleu(hypotheses: list[str], references: list[str],
                  lowercase: bool = False) -> list[float]:
    metric = bleu_metric(lowercase, sentence=True)
    return [metric.sentence_score(paper_words(hypothesis), [paper_words(reference)]).score
            for hypothesis, reference in zip(hypotheses, references)]
