"""Tags on the source: many target languages in one model, and tagged back-translation.

Johnson et al. (2017, "Google's Multilingual Neural Machine Translation System", §3) train one
model on many language pairs by starting each source sentence with an artificial token that
names the language to translate into ("<2es> Hello, how are you?"); the model, its training
and its search are otherwise unchanged. Caswell et al. (2019, "Tagged Back-Translation") start
the sources of back-translated pairs with a tag of their own, so that the model tells synthetic
sources from real ones; nothing is tagged at test time.

Spelling. attn's tags are `<2fr>` (Johnson et al.'s) and `<bt>`, reserved by `attn vocab --tags
fr,de,bt` through `--symbols`' mechanism (SentencePiece user-defined symbols): each becomes one
piece, "▁<2fr>", a word of its own. So a tag typed at the start of a line ("<2fr> Hello") and a
tag put before the line's ids (`attn binarize --target-tag fr`, `attn decode --target-lang fr`)
are the same ids, and an exported model takes "<2fr> Hello" in transformers too. OPUS-MT's
multi-target models spell theirs `>>fra<<` (the codes are their choice: mostly ISO 639-3), pieces
of their vocab.json that MarianTokenizer takes off the front of a line before SentencePiece cuts
the rest (`opus_language_code`); a model imported from one (`attn import hf`) keeps them, and
`--target-lang fra` puts `>>fra<<` first, as OPUS-MT expects.

Where the tags are recorded: in the vocabulary, and nowhere else. Every model file and data file
carries its vocabulary, so the tags a model knows are found by their spelling among its pieces
(`vocabulary_tags`), whoever made the model (training, averaging, an import) and however old the
file: no metadata that could drift from the pieces. A data file also says what its sources
start with (metadata `target_tag`, the language code, and `source_tags`, the pieces in order),
for `attn train`, which mixes corpora of different target languages only when each carries its
target tag (data.check_mixable).

No torch here: `attn vocab` and `attn binarize` import this.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import AttnError

WORD_START = "\u2581"  # SentencePiece's mark of a piece that begins a word ("▁")
BACK_TRANSLATION = "bt"  # the one tag name that is not a language (Caswell et al., 2019)
# A tag's name: a language code (fr, fra, pt_br, zh-Hant) or bt.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,15}")
# attn's pieces (`symbol` makes them, `attn vocab` adds the "▁"), and OPUS-MT's.
ATTN_TARGET = re.compile(WORD_START + r"?<2([A-Za-z0-9][A-Za-z0-9_-]*)>")
ATTN_OTHER = re.compile(WORD_START + r"?<(" + BACK_TRANSLATION + r")>")
OPUS_TARGET = re.compile(r">>([^<>\s]+)<<")


def symbol(name: str) -> str:
    """The text of tag `name`: `<2fr>` for a target language, `<bt>` for back-translation."""
    return f"<{name}>" if name == BACK_TRANSLATION else f"<2{name}>"


def parse_names(value: str, option: str) -> list[str]:
    """`fr,de,bt` as tag names, each once, in order; a bad one is an AttnError naming it."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise AttnError(f"{option} takes comma-separated tag names (fr,de,bt), not {value!r}")
    for name in names:
        if not NAME.fullmatch(name):
            raise AttnError(f"{option}: {name!r} is not a tag name: a language code (fr, fra, "
                            f"pt_br) or {BACK_TRANSLATION}, letters, digits, _ and - only")
    return list(dict.fromkeys(names))


def symbols(value: str, option: str = "--tags") -> list[str]:
    """`attn vocab --tags fr,de,bt`: the symbols to reserve (`vocab.learn`'s `symbols`)."""
    return [symbol(name) for name in parse_names(value, option)]


@dataclass(frozen=True)
class VocabularyTags:
    """The tags a vocabulary holds: target languages by code, and the others (bt) by name, each
    with its id."""

    targets: dict[str, int] = field(default_factory=dict)
    others: dict[str, int] = field(default_factory=dict)

    def listing(self) -> str:
        """How an error names them: "its target tags: cs, de, fr" or that it has none."""
        if not self.targets:
            return ("it has no target-language tags: reserve them with `attn vocab --tags "
                    "fr,de,...` and train on data binarized with --target-tag")
        return f"its target tags: {', '.join(sorted(self.targets))}"


def piece_tag(piece: str) -> tuple[str, str] | None:
    """("target", code) or ("other", name) for a tag piece, None for any other piece."""
    if not piece.endswith((">", "<<")):  # most pieces: no regex
        return None
    for kind, pattern in (("target", ATTN_TARGET), ("target", OPUS_TARGET),
                          ("other", ATTN_OTHER)):
        match = pattern.fullmatch(piece)
        if match:
            return kind, match[1]
    return None


def vocabulary_tags(vocabulary) -> VocabularyTags:
    """The tags among a vocabulary's pieces (a `vocab.Vocabulary`: milliseconds for 37,000
    pieces). attn's "▁<2fr>" is preferred to a bare "<2fr>" where both are pieces."""
    pieces = vocabulary.pieces
    if pieces is None:
        pieces = vocabulary.processor.id_to_piece(list(range(len(vocabulary))))
    found: dict[str, dict[str, int]] = {"target": {}, "other": {}}
    for index, piece in enumerate(pieces):
        tag = piece_tag(piece)
        if tag is not None:
            kind, name = tag
            if name not in found[kind] or piece.startswith(WORD_START):
                found[kind][name] = index
    return VocabularyTags(found["target"], found["other"])


def tag_ids(vocabulary, target: str | None, others: Sequence[str] = (), where: str = "",
            target_option: str = "--target-lang", other_option: str | None = None) -> list[int]:
    """The ids every source line starts with: target language `target`'s tag first (None:
    none), then each of `others` (bt). A tag the vocabulary lacks is one AttnError naming
    `where` (the vocabulary's file), the option (`target_option`, `other_option`: that of
    `others`, None where there is none) and the tags it has."""
    if target is None and not others:
        return []
    found = vocabulary_tags(vocabulary)
    where = where or "the vocabulary"
    ids = []
    if target is not None:
        if target not in found.targets:
            if not NAME.fullmatch(target):
                raise AttnError(f"{target_option} takes a language code (fr, fra, pt_br), not "
                                f"{target!r}")
            hint = ""
            if target in found.others:  # bt: a tag of training sources, not a language
                hint = (f" ({target} is not a language: use {other_option} {target})"
                        if other_option else f" ({target} is not a language)")
            raise AttnError(f"{target_option} {target}: {where} has no tag for it{hint}; "
                            f"{found.listing()}")
        ids.append(found.targets[target])
    for name in others:
        if name not in found.others:
            if name in found.targets:
                raise AttnError(f"{other_option} {name}: {name} is a target language: use "
                                f"{target_option} {name}")
            known = ", ".join(sorted(found.others)) or "none"
            raise AttnError(f"{other_option} {name}: {where} has no <{name}> tag (its other "
                            f"tags: {known}; reserve one with `attn vocab --tags ...,"
                            f"{BACK_TRANSLATION}`)")
        ids.append(found.others[name])
    return ids


def target_tags(vocabulary, lang: str | None, where: str,
                option: str = "--target-lang") -> tuple[int, ...]:
    """The ids of target language `lang`'s tag in `vocabulary` (none for None)."""
    return tuple(tag_ids(vocabulary, lang, where=where, target_option=option))


@dataclass(frozen=True)
class SourceTags:
    """What `attn binarize --target-tag fr --tag bt` puts before every source sentence: the ids,
    and what the data file says of them (metadata)."""

    ids: tuple[int, ...]
    metadata: dict[str, str]

    def prepend(self, sequences: list[list[int]]) -> list[list[int]]:
        """Each sentence's ids with the tags first; an empty one stays empty (its pair is
        dropped as having an empty side, as without tags)."""
        return [[*self.ids, *sequence] if sequence else sequence for sequence in sequences]


def binarize_tags(vocabulary, target: str | None, others: Sequence[str],
                  where: str) -> SourceTags | None:
    """`attn binarize --target-tag CODE --tag bt` checked against the source vocabulary: the
    tags to put first (None: none)."""
    if target is None and not others:
        return None
    ids = tag_ids(vocabulary, target, others, where, "--target-tag", "--tag")
    metadata = {"source_tags": " ".join(vocabulary.piece(index) for index in ids)}
    if target is not None:
        metadata["target_tag"] = target
    return SourceTags(tuple(ids), metadata)


def untagged_note(vocabulary, name: str) -> str | None:
    """What `attn decode` says of a model that knows target tags when --target-lang is not
    given (its sources then carry none: fine only where the lines hold their tags)."""
    targets = vocabulary_tags(vocabulary).targets
    if not targets:
        return None
    return (f"{name} translates into several languages (its target tags: "
            f"{', '.join(sorted(targets))}): without --target-lang the lines must start with "
            "their tag")


def opus_language_code(line: str) -> tuple[str | None, str]:
    """MarianTokenizer's rule for OPUS-MT's lines: a line starting with `>>xxx<<` is that code
    (a piece of its own) and the rest (cut by SentencePiece). (None, line) otherwise."""
    if line.startswith(">>"):
        end = line.find("<<")
        if end != -1:
            return line[:end + 2], line[end + 2:]
    return None, line


# ------------------------------------------------------- NLLB-200 and M2M-100: languages forced
#
# NLLB-200's and M2M-100's language codes are tokens of their vocabularies (interop/m2m.py): the
# source's first, and the target's forced as the first output token. A model imported from
# one says which spelling it uses (metadata `lang_codes`).
LANG_CODE_PATTERNS = {"nllb": re.compile(r"([a-z]{3}_[A-Z][a-z]{3})"),
                      "m2m100": re.compile(r"__([a-z]{2,3}(?:_[A-Za-z]+)?)__")}
# ISO 639-1 codes (what LibreTranslate and `attn serve -m en-fr=...` name languages by) as
# NLLB-200's: the language's most used script, and for a macrolanguage the variety NLLB trained
# (ar: Modern Standard Arabic, fa: Western Persian, ms: Standard Malay, zh: Simplified).
NLLB_ISO639_1 = dict(pair.split("=") for pair in """
af=afr_Latn ak=aka_Latn am=amh_Ethi ar=arb_Arab as=asm_Beng ay=ayr_Latn az=azj_Latn ba=bak_Cyrl
be=bel_Cyrl bg=bul_Cyrl bm=bam_Latn bn=ben_Beng bo=bod_Tibt bs=bos_Latn ca=cat_Latn cs=ces_Latn
cy=cym_Latn da=dan_Latn de=deu_Latn dz=dzo_Tibt ee=ewe_Latn el=ell_Grek en=eng_Latn eo=epo_Latn
es=spa_Latn et=est_Latn eu=eus_Latn fa=pes_Arab ff=fuv_Latn fi=fin_Latn fj=fij_Latn fo=fao_Latn
fr=fra_Latn ga=gle_Latn gd=gla_Latn gl=glg_Latn gn=grn_Latn gu=guj_Gujr ha=hau_Latn he=heb_Hebr
hi=hin_Deva hr=hrv_Latn ht=hat_Latn hu=hun_Latn hy=hye_Armn id=ind_Latn ig=ibo_Latn is=isl_Latn
it=ita_Latn ja=jpn_Jpan jv=jav_Latn ka=kat_Geor kg=kon_Latn ki=kik_Latn kk=kaz_Cyrl km=khm_Khmr
kn=kan_Knda ko=kor_Hang kr=knc_Latn ks=kas_Arab ku=kmr_Latn ky=kir_Cyrl lb=ltz_Latn lg=lug_Latn
li=lim_Latn ln=lin_Latn lo=lao_Laoo lt=lit_Latn lv=lvs_Latn mg=plt_Latn mi=mri_Latn mk=mkd_Cyrl
ml=mal_Mlym mn=khk_Cyrl mr=mar_Deva ms=zsm_Latn mt=mlt_Latn my=mya_Mymr nb=nob_Latn ne=npi_Deva
nl=nld_Latn nn=nno_Latn no=nob_Latn ny=nya_Latn oc=oci_Latn om=gaz_Latn or=ory_Orya pa=pan_Guru
pl=pol_Latn ps=pbt_Arab pt=por_Latn qu=quy_Latn rn=run_Latn ro=ron_Latn ru=rus_Cyrl rw=kin_Latn
sa=san_Deva sc=srd_Latn sd=snd_Arab sg=sag_Latn si=sin_Sinh sk=slk_Latn sl=slv_Latn sm=smo_Latn
sn=sna_Latn so=som_Latn sq=als_Latn sr=srp_Cyrl ss=ssw_Latn st=sot_Latn su=sun_Latn sv=swe_Latn
sw=swh_Latn ta=tam_Taml te=tel_Telu tg=tgk_Cyrl th=tha_Thai ti=tir_Ethi tk=tuk_Latn tl=tgl_Latn
tn=tsn_Latn tr=tur_Latn ts=tso_Latn tt=tat_Cyrl tw=twi_Latn ug=uig_Arab uk=ukr_Cyrl ur=urd_Arab
uz=uzn_Latn vi=vie_Latn wo=wol_Latn xh=xho_Latn yi=ydd_Hebr yo=yor_Latn zh=zho_Hans zu=zul_Latn
zh-hans=zho_Hans zh-hant=zho_Hant zh-cn=zho_Hans zh-tw=zho_Hant pt-br=por_Latn
""".split())


def lang_code_style(pieces: Sequence[str]) -> str | None:
    """"nllb" or "m2m100" where a vocabulary's pieces hold that family's language codes (at
    least two: one could be a word), else None."""
    for style, pattern in LANG_CODE_PATTERNS.items():
        if sum(1 for piece in pieces if pattern.fullmatch(piece)) >= 2:
            return style
    return None


def forced_language_codes(vocabulary, style: str) -> dict[str, int]:
    """The language codes of an NLLB-200 or M2M-100 vocabulary, each with its id: NLLB's by
    its token (fra_Latn), M2M-100's by the code inside its token (fr for __fr__)."""
    pattern = LANG_CODE_PATTERNS[style]
    return {match[1]: index for index, piece in enumerate(vocabulary.pieces or ())
            if (match := pattern.fullmatch(piece))}


def forced_language_code(code: str, codes: dict[str, int], style: str, option: str,
                         where: str) -> int:
    """The id of language `code` in a model whose languages are tokens (`codes`,
    `forced_language_codes`): the model's own code (fra_Latn, or __fr__ / fr), an ISO 639-1
    one (fr, zh-Hant) or, for NLLB, ISO 639-3 where one script has it (fra). An unknown one is
    an AttnError naming `option`, `where` and a few of the codes there are."""
    spelled = LANG_CODE_PATTERNS[style].fullmatch(code)
    if spelled and spelled[1] in codes:
        return codes[spelled[1]]
    if code in codes:
        return codes[code]
    if style == "nllb":
        mapped = NLLB_ISO639_1.get(code.lower().replace("_", "-"))
        if mapped in codes:
            return codes[mapped]
        scripts = [name for name in codes if name.split("_")[0] == code.lower()]
        if len(scripts) == 1:
            return codes[scripts[0]]
    else:
        base = code.lower().replace("_", "-").split("-")[0]
        if base in codes:
            return codes[base]
    known = sorted(codes)
    shown = ", ".join(known[:8]) + (f", ... ({len(known)} in all)" if len(known) > 8 else "")
    raise AttnError(f"{option} {code}: {where} has no language {code!r} (its codes: {shown})")
