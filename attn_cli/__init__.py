"""attn: the Transformer of "Attention Is All You Need", end to end, from the command line and
from Python:

    from attn_cli import load_translator

    translator = load_translator("model.st", beam=4)
    print(translator.translate(["A man is riding a bike.", "Two dogs play in the snow."]))

`import attn_cli` stays light (no torch) so that `attn --help` is instant; the names below load
their modules on first use.
"""

__version__ = "0.1.0"

_LAZY = {"load_translator": "decode.translator", "Translator": "decode.translator",
         "DecodeOptions": "decode.options",
         "load_model": "modelfile", "beam_search": "search"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
