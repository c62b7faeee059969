"""A stand-in for LibreTranslate: CTranslate2 translating each request on its own, over HTTP.

What LibreTranslate (argostranslate) does inside, with attn's sentence splitter and search
settings so that its answers can equal `attn serve`'s: a `POST /translate` of {q, source,
target} is cut into sentences (attn_cli.sentences, as `attn serve` cuts), and that request's
sentences, and no other's, go to one `ctranslate2.Translator.translate_batch` call, run in a
thread pool (LibreTranslate's waitress threads; CTranslate2 releases the GIL) on one Translator
whose `inter_threads` replicas take calls side by side. The search is attn's where CTranslate2
has the setting (benchmarks/ct2_reference.py: beam 4, length penalty 0.6, output limit |x| + 50,
pad and BOS banned); the answer is {translatedText}, the sentences' translations joined with the
text's own spacing. No batching across requests: that is the difference `attn serve` is measured
against (benchmarks/serve_load.py starts this server beside it).

    python -m benchmarks.ct2_server CT2_DIR [--port 0] [--compute-type int8]

CT2_DIR is an `attn export ct2` directory (CTranslate2's files, source.spm and target.spm). GET
/health answers 200 once the model is loaded; the first stderr line names the address
("listening on http://HOST:PORT"), as `attn serve`'s does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from attn_cli.decode.sentences import split_texts
from attn_cli.formats import BOS_ID, MAX_SOURCE_TOKENS, PAD_ID, SPECIAL_PIECES, TRANSLATION
from attn_cli.vocab import Vocabulary


class Engine:
    """One CTranslate2 Translator and the SentencePiece models beside it: sentences in,
    translations out, one `translate_batch` call for all of them."""

    def __init__(self, ct2_dir: str, compute_type: str, inter_threads: int, intra_threads: int,
                 beam: int):
        import ctranslate2

        self.src_vocab, self.tgt_vocab = (Vocabulary.from_file(Path(ct2_dir, f"{name}.spm"))
                                          for name in ("source", "target"))
        self.src_pieces = [self.src_vocab.processor.id_to_piece(i)
                           for i in range(len(self.src_vocab))]
        self.tgt_ids = {self.tgt_vocab.processor.id_to_piece(i): i
                        for i in range(len(self.tgt_vocab))}
        self.translator = ctranslate2.Translator(ct2_dir, device="cpu",
                                                 compute_type=compute_type,
                                                 inter_threads=inter_threads,
                                                 intra_threads=intra_threads)
        self.beam = beam
        self.banned = [[SPECIAL_PIECES[PAD_ID]], [SPECIAL_PIECES[BOS_ID]]]  # attn bans these

    def translate(self, sentences: list[str]) -> list[str]:
        if not sentences:
            return []
        # The model adds the source EOS itself (`attn export ct2`); cut as attn cuts.
        sources = [[self.src_pieces[i] for i in ids[:MAX_SOURCE_TOKENS]]
                   for ids in self.src_vocab.encode(sentences)]
        results = self.translator.translate_batch(
            sources, beam_size=self.beam, max_input_length=0,
            length_penalty=TRANSLATION.alpha if self.beam > 1 else 0.0,
            # One output limit per call: the longest source's a·|x| + b (a = 1).
            max_decoding_length=max(map(len, sources)) + TRANSLATION.max_len_b,
            suppress_sequences=self.banned)
        return self.tgt_vocab.decode([[self.tgt_ids[piece] for piece in result.hypotheses[0]]
                                      for result in results])


def build_app(engine: Engine, pool: ThreadPoolExecutor):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def translate(request):
        try:
            payload = await request.json()
            q = payload["q"]
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": "send JSON {q, source, target}"}, status_code=400)
        texts = [q] if isinstance(q, str) else list(q)
        split = split_texts(texts, payload.get("source") or None)
        outputs = await asyncio.get_running_loop().run_in_executor(
            pool, engine.translate, split.sentences)
        joined = split.join(outputs)
        return JSONResponse({"translatedText": joined[0] if isinstance(q, str) else joined})

    return Starlette(routes=[Route("/health", health), Route("/translate", translate,
                                                             methods=["POST"])])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("ct2_dir", help="An `attn export ct2` directory.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free one.")
    parser.add_argument("--compute-type", default="float32", help="CTranslate2's (int8, ...).")
    parser.add_argument("--inter-threads", type=int, default=os.cpu_count() or 1,
                        help="Calls translated side by side (replicas of the model).")
    parser.add_argument("--intra-threads", type=int, default=1,
                        help="Threads of each call.")
    parser.add_argument("--pool", type=int, default=4,
                        help="Request threads (waitress's default in LibreTranslate: 4).")
    parser.add_argument("--beam", type=int, default=TRANSLATION.beam)
    args = parser.parse_args(argv)
    import uvicorn

    engine = Engine(args.ct2_dir, args.compute_type, args.inter_threads, args.intra_threads,
                    args.beam)
    engine.translate(["Warm up."])
    pool = ThreadPoolExecutor(args.pool, "ct2-request")
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and without it
    # a kept-alive connection's answers wait ~40 ms for the client's delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(1024)
    host, port = sock.getsockname()[:2]
    print(f"ct2_server: listening on http://{host}:{port} (CTranslate2 {args.compute_type}, "
          f"{args.inter_threads} replica(s) × {args.intra_threads} thread(s), beam "
          f"{args.beam}, {args.pool} request threads)", file=sys.stderr, flush=True)
    config = uvicorn.Config(build_app(engine, pool), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    pool.shutdown()


if __name__ == "__main__":
    main()
