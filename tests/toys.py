"""Toys of our own for tests: a treebank whose brackets follow from its words, trees in the Penn
Treebank's trickier style, the sequence-reversal task, and models with random weights for tests
that need a model but not a trained one, and the helpers several test files share.
(tests/fixtures/make_fixtures.py imports this file too.)"""

from __future__ import annotations

import random
from html.parser import HTMLParser
from pathlib import Path

import torch

from attn_cli.config import PRESETS
from attn_cli.model import Transformer
from attn_cli.modelfile import save_model

# A toy English grammar whose brackets follow from the words: determiners open noun phrases,
# prepositions open prepositional phrases, verbs open verb phrases.
LEXICON = {"DT": ["the", "a"], "NN": ["cat", "dog", "mat", "man", "park", "hat"],
           "JJ": ["big", "small", "red"], "VBD": ["saw", "liked", "found"],
           "VBZ": ["sleeps", "runs"], "IN": ["on", "in", "with"]}


def _word(rng: random.Random, tag: str) -> str:
    return f"({tag} {rng.choice(LEXICON[tag])})"


def _noun_phrase(rng: random.Random, depth: int) -> str:
    words = [_word(rng, "DT")] + ([_word(rng, "JJ")] if rng.random() < 0.4 else [])
    simple = f"(NP {' '.join(words + [_word(rng, 'NN')])})"
    if depth < 2 and rng.random() < 0.35:
        return f"(NP {simple} (PP {_word(rng, 'IN')} {_noun_phrase(rng, depth + 1)}))"
    return simple


def toy_treebank(count: int, seed: int) -> str:
    """`count` trees in the Penn Treebank's file format (outer empty brackets, a final '.')."""
    rng = random.Random(seed)
    trees = []
    for _ in range(count):
        if rng.random() < 0.3:
            verb_phrase = f"(VP {_word(rng, 'VBZ')})"
        else:
            verb_phrase = f"(VP {_word(rng, 'VBD')} {_noun_phrase(rng, 0)})"
        trees.append(f"( (S {_noun_phrase(rng, 0)} {verb_phrase} (. .)) )")
    return "\n".join(trees) + "\n"


def toy_parser_commands(directory: Path, terminals: str, steps: int,
                        device: str = "cpu") -> list[list[str]]:
    """The recipe of a tiny parser, as the tests and checks/gpu_smoke.py make one: writes a toy
    treebank's train and dev splits (600 and 30 trees) into `directory` and returns the `attn`
    commands, in order, that make directory/parser.st of them through the real commands
    (linearize both splits, vocab, binarize, train, average the last checkpoint)."""
    (directory / "train.mrg").write_text(toy_treebank(600, seed=1), encoding="utf-8")
    (directory / "dev.mrg").write_text(toy_treebank(30, seed=2), encoding="utf-8")
    commands = [["parse", "linearize", directory / f"{split}.mrg", "-o", directory / split,
                 "--terminals", terminals] for split in ("train", "dev")]
    commands += [
        ["vocab", directory / "train.src", directory / "train.tgt", "-o",
         directory / "spm.model", "--size", 60, "--symbols", directory / "train.symbols"],
        ["binarize", "--vocab", directory / "spm.model", directory / "train.src",
         directory / "train.tgt", "-o", directory / "train.st"],
        ["train", directory / "train.st", "-o", directory / "run", "--preset", "tiny",
         "--max-steps", steps, "--batch-tokens", 1500, "--warmup", 100, "--lr-scale", 0.3,
         "--save-every", steps, "--log-every", steps, "--device", device],
        ["average", directory / "run", "--last", 1, "-o", directory / "parser.st"],
    ]
    return [[str(word) for word in command] for command in commands]


def reversal_pairs(count: int, seed: int, letters: str = "abcdefghij", shortest: int = 3,
                   longest: int = 7) -> tuple[list[str], list[str]]:
    """Sequences of letters (space-separated) and the same sequences reversed."""
    rng = random.Random(seed)
    sources, targets = [], []
    for _ in range(count):
        word = [rng.choice(letters) for _ in range(rng.randint(shortest, longest))]
        sources.append(" ".join(word))
        targets.append(" ".join(reversed(word)))
    return sources, targets


# Our own trees, in the treebank's style: outer empty brackets, several lines per tree, traces,
# nested empty elements, function tags and indices, -LRB-/-RRB-.
TREEBANK = """\
( (S
    (NP-SBJ-1 (DT The) (NN cat) )
    (VP (VBD sat)
      (PP-LOC (IN on) (NP (DT the) (NN mat) ))
      (S (NP-SBJ (-NONE- *-1) ) (VP (TO to) (VP (VB rest) ))))
    (. .) ))
( (S
    (NP-SBJ (NNP Alice) (-LRB- -LRB-) (NNP Al) (-RRB- -RRB-) )
    (VP (VBZ says)
      (SBAR (-NONE- 0)
        (S (NP-SBJ (-NONE- *T*-2) ) (VP (-NONE- *?*) ))))
    (, ,)
    (ADVP|PRT (RB up) )
    (. .) ))
"""


def random_model(vocab: int = 7, seed: int = 0) -> Transformer:
    """The tiny preset's network with random weights for a `vocab`-piece vocabulary, without
    dropout, in eval mode, its output distributions sharpened a little so that hypotheses
    differ clearly."""
    torch.manual_seed(seed)
    config = PRESETS["tiny"].model_config(vocab, dropout=0.0)
    model = Transformer(config).eval()
    with torch.no_grad():
        model.tgt_embed.weight.mul_(4)
    return model


def save_random_model(path: Path, vocabulary, preset: str = "tiny", seed: int = 0,
                      **provenance: str) -> Path:
    """A model file of `preset`'s architecture with random weights and `vocabulary`."""
    torch.manual_seed(seed)
    model = Transformer(PRESETS[preset].model_config(len(vocabulary)))
    save_model(path, model, vocabulary, **provenance)
    return path


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that, on a GPU, make the host wait for the device: a result whose size
    depends on the data (nonzero, masked_select, indexing with a boolean mask: the host must
    learn the size) and a value read back (`.item()`, `float(t)`, `if t:`). A CPU runs the same
    ops, so their count here is the count there. (`.tolist()` of a CPU tensor dispatches no op:
    it is not counted.)"""

    WAITING = {"nonzero", "masked_select", "_local_scalar_dense", "is_nonzero", "item"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.WAITING or (name in ("index", "index_put", "index_put_") and any(
                isinstance(index, torch.Tensor) and index.dtype == torch.bool
                for index in _flat(args[1]))):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


class HostSyncs(HostReads):
    """Every copy between host and device a GPU run would make, counted on a CPU run, where
    some of them dispatch no op at all. `reads` (device to host, the host waits):
    `HostReads`'s ops, and `.tolist()`, `.cpu()`, `.numpy()`. `uploads` (host to device,
    without `non_blocking` the host waits too): a tensor made from Python data
    (`torch.tensor(list)`, `x[list]`, `x[list] = ...`: torch's `lift_fresh`, counted where it
    is made, whatever its device), and `.to(...)` or `.cuda()` naming a device (the search's
    device is the host itself on a CPU run, so any move counts). Not seen: `copy_` from a
    host tensor made otherwise (by a CPU generator, say)."""

    READS = {"tolist", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.reads = self.seen
        self.uploads: list[str] = []
        self._methods = _TensorMethods(self)

    def __enter__(self):
        self._methods.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._methods.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "lift_fresh":
            self.uploads.append("lift_fresh")
        return super().__torch_dispatch__(func, types, args, kwargs)


class _TensorMethods(torch.overrides.TorchFunctionMode):
    """`HostSyncs`'s view of the tensor methods that dispatch no op on a CPU."""

    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name, kwargs = getattr(func, "__name__", ""), kwargs or {}
        if name in HostSyncs.READS:
            self.syncs.reads.append(name)
        elif name == "cuda" or name == "to" and ("device" in kwargs or any(
                isinstance(arg, (torch.device, str, torch.Tensor)) for arg in args[1:])):
            self.syncs.uploads.append(name)
        return func(*args, **kwargs)


def _flat(indices) -> list:
    return [index for index in (indices if isinstance(indices, (list, tuple)) else [indices])]


class CountedSteps:
    """`random_model`, whose outputs seldom end before their limit, made to end sooner: EOS
    gains a set bonus after each token and 1.2 per step. Each step's start is marked in the
    counts of `syncs`."""

    def __init__(self, syncs: HostSyncs, vocab: int = 40):
        self.model, self.syncs, self.marks = random_model(vocab, seed=5), syncs, []
        self.config = self.model.config
        self.eos_bonus = torch.zeros(vocab, vocab)
        self.eos_bonus[:, 3] = 4 * torch.randn(vocab, generator=torch.Generator().manual_seed(2))
        self.eos_slope = torch.zeros(vocab)
        self.eos_slope[3] = 1.2

    def encode(self, src_tokens):
        return self.model.encode(src_tokens)

    def start_decoding(self, memory, src_mask):
        return self.model.start_decoding(memory, src_mask)

    def decode_step(self, tokens, cache):
        self.marks.append((len(self.syncs.reads), len(self.syncs.uploads)))
        logits, grown = self.model.decode_step(tokens, cache)
        return logits + self.eos_bonus[tokens] + self.eos_slope * cache.step, grown

    def per_step(self) -> list[tuple[int, int]]:
        """(reads, uploads) from each step's start to the next's, the last's to the end."""
        ends = self.marks[1:] + [(len(self.syncs.reads), len(self.syncs.uploads))]
        return [(reads - reads_before, uploads - uploads_before) for
                (reads_before, uploads_before), (reads, uploads) in zip(self.marks, ends)]


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.seen = []

    def handle_starttag(self, tag, attrs):
        self.seen.append(("start", tag, attrs))

    def handle_startendtag(self, tag, attrs):
        self.seen.append(("empty", tag, attrs))

    def handle_endtag(self, tag):
        self.seen.append(("end", tag))

    def handle_comment(self, data):
        self.seen.append(("comment", data))


def tag_tree(document: str) -> list:
    """The start and end tags (with attributes) and comments of a document, in order."""
    parser = _Tags()
    parser.feed(document)
    parser.close()
    return parser.seen


def marian_greedy(marian, tokenizer, lines: list[str]) -> list[str]:
    """generate() one line at a time with attn's limit of |x| + 50 tokens, EOS forced last."""
    outputs = []
    for line in lines:
        ids = torch.tensor([tokenizer(line)["input_ids"]])
        with torch.inference_mode():
            found = marian.generate(input_ids=ids, num_beams=1, do_sample=False,
                                    max_length=1 + ids.shape[1] - 1 + 50)
        outputs.append(tokenizer.decode(found[0], skip_special_tokens=True))
    return outputs
