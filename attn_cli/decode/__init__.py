"""Decoding: `attn decode`, and `attn serve`, which is decoding behind HTTP. The translator and its
settings, the stdin/stdout pipe, what a user controls (prefixes, phrases, bans, glossaries),
faster decoding (shortlists, the compiled step), paragraphs and HTML, alignments read off the
attention. Entered by cli.py, serve/ and scripts only; it stands on the shared core."""
