"""Glossaries in `attn decode --glossary` (issue 42): how often the output holds each term found
in its source line, what forcing them does to BLEU and chrF, and what it costs in speed, on a
Multi30k en→de model and a glossary of terms drawn from test2016.

The glossary: test2016's source words paired with the reference words eflomal aligned them to
(`--reference`: Pharaoh lines of test2016 as benchmarks/alignment_aer.py's --save-reference
writes them, over whitespace words). Chosen deterministically: a whitespace source word, its
punctuation stripped at both ends and lowercased, alphabetic and of at least 4 letters; each of
its occurrences with exactly one link votes for the target word of that link (punctuation
stripped at both ends, its case as in the reference); the most voted target (ties: the first in
sorting order) is kept if it holds at least 60% of all the word's occurrences and at least 2; the
words are ranked by occurrences (ties: alphabetically) and the first `--terms` taken. BLEU with
this glossary is ORACLE-INFORMED: its terms come from the references' own alignments, so it
says what forcing right terms does, not what a user's glossary would.

What it reports:
- term use: over every (line, term) pair where the glossary finds the term in the source line
  (`attn_cli.decode.glossary.Glossary.matches`, what decode forces), the share of outputs
  holding the target term as a whole word (case-sensitive; word characters not on either
  side), without and with `--glossary` (target: 100% with), and how many lines have a term;
- BLEU (sacreBLEU, 13a) and chrF of the whole test set without and with the glossary, and with
  `--constraint-search all` (every line with terms searched with them, not only those whose
  free output misses one);
- speed: the real CLI (`python -m attn_cli decode --device cpu`, beam 4) on the lines, without
  and with `--glossary` alternated `--repeats` times in the same run, the median seconds and
  sentences/s (`--stats-json`) of each and their ratio, and the median of each alternated
  pair's ratio (steadier where other jobs share the machine); the same for the lines that have a
  term only;
- `--constraints` with each line's phrases given explicitly (`source<TAB>term1<TAB>term2`),
  asserted byte-identical to `--glossary`'s output;
- of the lines whose free output already holds all their terms, how many the glossary changes
  (dynamic beam allocation searches otherwise even where nothing needs forcing).
A miss (a term's source word found, its target not whole in the output with the glossary) is
listed on stderr with the line, the term, the output without and with, and what the CLI shows of
it (raw pieces and scores of the glossary's n-best and of the free search, the term's pieces as
forced, the length limit).

    python -m benchmarks.glossary_terms -m model.st --reference ref.gdfa
    python -m benchmarks.glossary_terms -m model.st --reference ref.gdfa --save-glossary t.tsv
    python -m benchmarks.glossary_terms -m model.st --reference ref.gdfa --lines 300 --repeats 1

A markdown table on stdout; progress, the CPU and the misses on stderr. Only the same-run ratios
carry from one machine to another.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import time
import unicodedata
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks._harness import SHARED, attn_command, decode_stats, log
from benchmarks.machine import cpu_info

TEST = "test_2016_flickr"
MIN_LETTERS = 4
MIN_SHARE = 0.6  # of a source word's occurrences that its majority target must hold
MIN_VOTES = 2


def read_lines(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle]


def is_punctuation(character: str) -> bool:
    return unicodedata.category(character).startswith("P")


def stripped(word: str) -> str:
    """A whitespace word without the punctuation at its ends ("dog." → "dog", "T-Shirt" kept)."""
    start, end = 0, len(word)
    while start < end and is_punctuation(word[start]):
        start += 1
    while end > start and is_punctuation(word[end - 1]):
        end -= 1
    return word[start:end]


def links_by_source(line: str) -> dict[int, list[int]]:
    """A Pharaoh line `i-j ...` → {source word i: [target words j]}."""
    links: dict[int, list[int]] = defaultdict(list)
    for pair in line.split():
        i, j = pair.split("-")
        links[int(i)].append(int(j))
    return links


def choose_terms(sources: list[str], references: list[str], alignments: list[str],
                 count: int) -> list[tuple[str, str, int, int]]:
    """The glossary's (source, target, occurrences, votes), ranked (see the module's notes)."""
    occurrences: Counter[str] = Counter()
    votes: dict[str, Counter[str]] = defaultdict(Counter)
    for source, reference, alignment in zip(sources, references, alignments, strict=True):
        source_words, target_words = source.split(), reference.split()
        links = links_by_source(alignment)
        for i, word in enumerate(source_words):
            word = stripped(word).lower()
            if not (word.isalpha() and len(word) >= MIN_LETTERS):
                continue
            occurrences[word] += 1
            if len(links.get(i, ())) == 1:
                target = stripped(target_words[links[i][0]])
                if target:
                    votes[word][target] += 1
    chosen = []
    for word, seen in occurrences.items():
        if not votes[word]:
            continue
        target, voted = min(votes[word].items(), key=lambda item: (-item[1], item[0]))
        if voted >= MIN_VOTES and voted >= MIN_SHARE * seen:
            chosen.append((word, target, seen, voted))
    chosen.sort(key=lambda term: (-term[2], term[0]))
    return chosen[:count]


def write_glossary(path: Path, terms: list[tuple[str, str, int, int]]) -> None:
    path.write_text("".join(f"{source}\t{target}\n" for source, target, _, _ in terms),
                    encoding="utf-8")


def holds(output: str, target: str) -> bool:
    """Whether the output has the target as whole words (as written, no word character beside)."""
    return re.search(rf"(?<!\w){re.escape(target)}(?!\w)", output) is not None


def decode(model: str, lines: list[str], options: list[str], scratch: Path) -> dict:
    """One run of the real CLI: its output lines, --stats-json figures and stderr."""
    stats_path = scratch / "stats.json"
    stats_path.unlink(missing_ok=True)
    command = [*attn_command(), "decode", "-m", model, "--device", "cpu", *options,
               "--stats-json", str(stats_path)]
    text = "".join(line + "\n" for line in lines)
    result = subprocess.run(command, input=text.encode(), capture_output=True)
    stderr = result.stderr.decode()
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{stderr}")
    stats = decode_stats(stats_path, stderr)
    return {"output": result.stdout.decode(), "lines": result.stdout.decode().splitlines(),
            "seconds": stats["seconds"], "sentences_per_s": stats["sentences_per_s"],
            "stderr": stderr}


def alternated(model: str, lines: list[str], configurations: dict[str, list[str]],
               repeats: int, scratch: Path, what: str) -> dict[str, list[dict]]:
    """Each configuration run `repeats` times, in turns (A, B, A, B, ...): both see the same
    machine. Every run of a configuration must give the same output (fp32 on a CPU)."""
    runs: dict[str, list[dict]] = {name: [] for name in configurations}
    for repeat in range(repeats):
        for name, options in configurations.items():
            run = decode(model, lines, options, scratch)
            runs[name].append(run)
            log(f"  {what}, {name}, run {repeat + 1}/{repeats}: {run['seconds']:.2f}s, "
                f"{run['sentences_per_s']:.1f} sentences/s")
            if run["output"] != runs[name][0]["output"]:
                raise SystemExit(f"{what}, {name}: run {repeat + 1}'s output differs from run 1's")
    return runs


def median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def term_use(pairs: list[tuple[int, str]], outputs: list[str]) -> tuple[int, list]:
    """How many (line, target) pairs the outputs hold, and the pairs they miss."""
    missed = [(line, target) for line, target in pairs if not holds(outputs[line], target)]
    return len(pairs) - len(missed), missed


def has_pieces(pieces: list[str], phrase: list[str]) -> list[int]:
    """Where the phrase's pieces start in the output's pieces (what a constraint counts)."""
    return [at for at in range(len(pieces) - len(phrase) + 1)
            if pieces[at:at + len(phrase)] == phrase]


def nbest_of(text: str) -> dict[int, list[tuple[float, list[str]]]]:
    """`--nbest --raw` lines of one run (`line<TAB>score<TAB>pieces`, the line from 0, its
    hypotheses best first) → {line: [(score, pieces)]}."""
    found: dict[int, list[tuple[float, list[str]]]] = defaultdict(list)
    for row in text.splitlines():
        line, score, pieces = row.split("\t")
        found[int(line)].append((float(score), pieces.split()))
    return found


def text_of(pieces: list[str]) -> str:
    """SentencePiece's pieces → their text (enough to look for a whole word)."""
    return "".join(pieces).replace("\u2581", " ").strip()


def diagnose(model: str, missed: list[tuple[int, str]], sources: list[str],
             targets: list[list[str]], glossary_path: Path, common: list[str],
             scratch: Path) -> dict[tuple[int, str], list[str]]:
    """What can be said of each miss: the raw pieces and scores of the glossary's n-best and of
    the free search (the real CLI again, on the missed lines: fp32 on a CPU does not depend on
    the batching), the term's pieces as the vocabulary cuts it alone (what decode forces), and
    the output's length limit."""
    from attn_cli.decode.translator import load_translator
    from attn_cli.formats import TRANSLATION
    from attn_cli.search import max_output_length

    lines = sorted({line for line, _ in missed})
    texts = [sources[line] for line in lines]
    run = decode(model, texts, [*common, "--glossary", str(glossary_path), "--raw", "--nbest",
                                str(TRANSLATION.beam)], scratch)
    forced = nbest_of(run["output"])
    warned = {lines[int(number) - 1] for number in re.findall(
        r"decode: \w+ (\d+): its output could not", run["stderr"])}
    free = nbest_of(decode(model, texts, [*common, "--raw", "--nbest", "2"], scratch)["output"])
    translator = load_translator(model, device="cpu")
    src_vocab, tgt_vocab = translator.src_vocab, translator.tgt_vocab

    def pieces_of(text: str) -> list[str]:
        return [tgt_vocab.piece(token) for token in tgt_vocab.encode([text])[0]]

    causes = {}
    for line, target in missed:
        row = lines.index(line)
        (score, pieces), alternatives = forced[row][0], forced[row][1:]
        free_score, free_pieces = free[row][0]
        phrase = pieces_of(target)
        limit = max_output_length(len(src_vocab.encode([sources[line]])[0]),
                                  TRANSLATION.max_len_a, TRANSLATION.max_len_b)
        said = [f"the line's terms: {targets[line]}; this one as pieces alone: "
                f"{' '.join(phrase)}",
                f"output pieces (score {score:.4f}): {' '.join(pieces)}",
                f"free output pieces (score {free_score:.4f}): {' '.join(free_pieces)}"]
        if line in warned:
            said.append("decode warned: no output held every phrase within the length limit")
        starts = has_pieces(pieces, phrase)
        for at in starts:
            after = pieces[at + len(phrase)] if at + len(phrase) < len(pieces) else None
            if after is not None and not after.startswith("\u2581"):
                said.append(f"CAUSE: the term's pieces are in the output (from piece {at}), "
                            f"then {after!r}, a piece that continues the word: the constraint "
                            "is met, the word does not end there")
        if not starts:
            said.append("CAUSE: the term's pieces are not in the output")
        if len(pieces) + 1 >= limit:
            said.append(f"CAUSE: the output reached its length limit ({len(pieces)} pieces + "
                        f"EOS = {limit} = source pieces + {TRANSLATION.max_len_b})")
        if re.search(rf"(?<!\w){re.escape(target)}(?!\w)", text_of(pieces), re.IGNORECASE):
            said.append("CAUSE: held in another casing")
        whole = [f"#{k} (score {other_score:.4f})" for k, (other_score, other)
                 in enumerate(alternatives, start=2) if holds(text_of(other), target)]
        if whole:
            said.append(f"lower in the glossary's {TRANSLATION.beam}-best (#1: the output), "
                        f"the term is whole: {', '.join(whole)}")
        if all(has_pieces(free_pieces, pieces_of(term)) for term in targets[line]):
            better = "higher" if free_score > score else "lower"
            said.append(f"the free output holds every phrase of the line and scores {better} "
                        f"({free_score:.4f} vs {score:.4f})"
                        + (": a search error of the constrained search, which deals its "
                           "beam out over banks" if free_score > score else ""))
        causes[line, target] = said
    return causes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", required=True, help="an en→de attn model file (.st)")
    parser.add_argument("--data", type=Path, default=SHARED / "data" / "multi30k",
                        help="Multi30k's raw files (test_2016_flickr.en, .de) "
                             "[default: %(default)s]")
    parser.add_argument("--src", default="en", help="source language [default: en]")
    parser.add_argument("--tgt", default="de", help="target language [default: de]")
    parser.add_argument("--reference", type=Path, required=True,
                        help="eflomal's alignments of test2016 (Pharaoh lines, over whitespace "
                             "words: benchmarks/alignment_aer.py --save-reference)")
    parser.add_argument("--terms", type=int, default=100, help="glossary terms [default: 100]")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each configuration, alternated [default: 3]")
    parser.add_argument("--lines", type=int, default=0,
                        help="decode the first N lines of test2016 (0: all; the glossary is "
                             "drawn from all) [default: 0]")
    parser.add_argument("--save-glossary", type=Path, help="write the glossary (TSV) here")
    parser.add_argument("--threads", type=int, default=0,
                        help="attn decode --threads (0: all cores) [default: 0]")
    args = parser.parse_args(argv)

    import sacrebleu

    from attn_cli.decode.glossary import Glossary

    started = time.perf_counter()
    cpu, isa = cpu_info()
    log(f"CPU: {cpu} ({isa})")
    if not (args.data / f"{TEST}.{args.src}").exists():
        raise SystemExit(f"no {TEST}.{args.src} in {args.data}: Multi30k's raw files, --data DIR "
                         "(or $ATTN_SHARED/data/multi30k)")
    sources = read_lines(args.data / f"{TEST}.{args.src}")
    references = read_lines(args.data / f"{TEST}.{args.tgt}")
    alignments = read_lines(args.reference)
    if len(alignments) != len(sources):
        raise SystemExit(f"{args.reference} has {len(alignments)} lines, {TEST} {len(sources)}")
    terms = choose_terms(sources, references, alignments, args.terms)
    log(f"glossary: {len(terms)} terms from {args.reference} (first: "
        + ", ".join(f"{s} → {t}" for s, t, _, _ in terms[:5]) + ")")
    count = min(args.lines or len(sources), len(sources))
    sources, references = sources[:count], references[:count]

    with tempfile.TemporaryDirectory(prefix="glossary_terms.") as scratch_name:
        scratch = Path(scratch_name)
        glossary_path = args.save_glossary or scratch / "glossary.tsv"
        write_glossary(glossary_path, terms)
        glossary = Glossary.read(glossary_path)
        targets = [glossary.targets(line) for line in sources]  # what decode forces
        pairs = [(i, target) for i, found in enumerate(targets) for target in found]
        with_terms = [i for i, found in enumerate(targets) if found]
        log(f"{len(pairs)} (line, term) pairs on {len(with_terms)} of {count} lines")

        common = ["--threads", str(args.threads)]
        configurations = {"without": common, "with": [*common, "--glossary", str(glossary_path)],
                          "all": [*common, "--glossary", str(glossary_path),
                                  "--constraint-search", "all"]}
        log(f"all {count} lines, alternated {args.repeats}x:")
        full = alternated(args.model, sources, configurations, args.repeats, scratch, "all")
        subset = [sources[i] for i in with_terms]
        log(f"the {len(subset)} lines with terms, alternated {args.repeats}x:")
        part = alternated(args.model, subset, configurations, args.repeats, scratch, "terms")
        explicit = ["\t".join([line, *found]) for line, found in zip(sources, targets)]
        constrained = decode(args.model, explicit, [*common, "--constraints"], scratch)
        log(f"  --constraints (explicit phrases): {constrained['seconds']:.2f}s")

    outputs = {name: runs[0]["lines"] for name, runs in full.items()}
    identical = constrained["output"] == full["with"][0]["output"]
    if not identical:
        differ = sum(a != b for a, b in zip(constrained["lines"], outputs["with"]))
        raise SystemExit(f"--constraints and --glossary differ on {differ} lines")
    same_subset = all(part[name][0]["lines"] == [outputs[name][i] for i in with_terms]
                      for name in part)
    held = {name: term_use(pairs, outputs[name]) for name in outputs}
    # Lines whose free output already holds each of its terms: the glossary's search could give
    # them unchanged; how often it does not is what dynamic beam allocation costs there.
    already = [i for i in with_terms
               if all(holds(outputs["without"][i], target) for target in targets[i])]
    changed = sum(outputs["with"][i] != outputs["without"][i] for i in already)
    scores = {name: (sacrebleu.corpus_bleu(outputs[name], [references]).score,
                     sacrebleu.corpus_chrf(outputs[name], [references]).score)
              for name in outputs}

    missed = held["with"][1]
    if missed:
        log(f"{len(missed)} misses with --glossary:")
        with tempfile.TemporaryDirectory(prefix="glossary_terms.") as scratch_name:
            glossary_path = args.save_glossary or Path(scratch_name) / "glossary.tsv"
            if not args.save_glossary:
                write_glossary(glossary_path, terms)
            causes = diagnose(args.model, missed, sources, targets, glossary_path, common,
                              Path(scratch_name))
        for line, target in missed:
            log(f"  line {line + 1}: term {target!r}\n    source: {sources[line]}"
                f"\n    output: {outputs['with'][line]}"
                f"\n    without: {outputs['without'][line]}"
                + "".join(f"\n    - {said}" for said in causes[line, target]))
    warned = re.findall(r"decode: \w+ \d+: its output could not", full["with"][0]["stderr"])
    warned_note = f"; decode warned of {len(warned)} lines" if warned else ""

    def speed_row(name: str, label: str, runs: dict[str, list[dict]], lines: int,
                  ratio: bool) -> str:
        seconds = median(runs[name], "seconds")
        rate = median(runs[name], "sentences_per_s")
        times = ", ".join(f"{run['seconds']:.2f}" for run in runs[name])
        if ratio:
            pairs = [run["seconds"] / before["seconds"]
                     for before, run in zip(runs["without"], runs[name])]
            versus = (f"{seconds / median(runs['without'], 'seconds'):.2f}x | "
                      f"{statistics.median(pairs):.2f}x ({', '.join(f'{r:.2f}' for r in pairs)})")
        else:
            versus = "1.00x | 1.00x"
        return f"| {label} | {lines} | {seconds:.2f} ({times}) | {rate:.1f} | {versus} |"

    total = len(pairs)
    out = [f"Glossary of {len(terms)} terms drawn from {TEST} {args.src}→{args.tgt} by eflomal's "
           f"alignments (`{args.reference}`: ORACLE-INFORMED, the terms come from the "
           f"references), model `{args.model}`, beam 4, {count} lines, `--threads "
           f"{args.threads}`; {cpu} ({isa}). {total} (line, term) pairs on "
           f"{len(with_terms)} of {count} lines.", "",
           "| decode | term use | BLEU | chrF |", "|---|---:|---:|---:|"]
    for name, label in (("without", "without a glossary"), ("with", "`--glossary`"),
                        ("all", "`--glossary --constraint-search all`")):
        hits = held[name][0]
        out.append(f"| {label} | {hits}/{total} = {100 * hits / max(total, 1):.1f}% | "
                   f"{scores[name][0]:.2f} | {scores[name][1]:.2f} |")
    out.append(f"| `--constraints`, each line's terms given explicitly | byte-identical to "
               f"`--glossary`: {'yes' if identical else 'NO'} | | |")
    out += ["", f"{len(already)} of the {len(with_terms)} lines with terms hold all of them "
                f"without the glossary; on {changed} of those the glossary's output differs "
                f"from the free one."]
    out += ["", f"Speed (alternated {args.repeats}x in this run; median decode seconds, "
                f"each run's in brackets; sentences/s from `--stats-json`; a pair: a run with the "
                f"glossary and the run without just before it, which saw the same machine):",
            "",
            "| decode | lines | seconds | sentences/s | time vs without: medians | "
            "median of the pairs' ratios |",
            "|---|---:|---:|---:|---:|---:|",
            speed_row("without", "all lines, without", full, count, False),
            speed_row("with", "all lines, `--glossary`", full, count, True),
            speed_row("all", "all lines, `--glossary --constraint-search all`", full, count,
                      True),
            speed_row("without", "lines with terms, without", part, len(subset), False),
            speed_row("with", "lines with terms, `--glossary`", part, len(subset), True),
            speed_row("all", "lines with terms, `--constraint-search all`", part, len(subset),
                      True),
            "", f"The lines-with-terms runs' outputs equal the full runs' lines: "
                f"{'yes' if same_subset else 'NO'}. {len(missed)} misses with the glossary"
                f"{warned_note}. {time.perf_counter() - started:.0f}s in all."]
    print("\n".join(out))


if __name__ == "__main__":
    main()
