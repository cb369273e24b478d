"""The host work of one guided decode step, alone: filling N rows' token masks (one matcher
after another, or in parallel through xgrammar's BatchGrammarMatcher with a number of threads),
each row then accepting one token, the masks' copy to the device and application
(`apply_token_masks`, as the engine does), and their way to the engine process (through its
pipe, or in the shared mask buffer with a one-byte message).

Guided steps wait for this work (its sum is the step's floor when it exceeds the forward), so
this tells which part sets a guided batch's speed on a host:

    python scripts/bench_grammar_masks.py --rows 1 64 256 --threads 1 2 4 8
    python scripts/bench_grammar_masks.py --device cuda --vocab-size 151936   # Qwen3's width

The rows follow the structured-output benchmark's schema (an array of people) along random
allowed tokens, each row at its own point, so that their masks differ as in a real batch.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

SCRIPTS_DIR = Path(__file__).resolve().parent
if str(SCRIPTS_DIR) not in sys.path:
    sys.path.insert(0, str(SCRIPTS_DIR))
from bench_structured_output import PEOPLE

from minisgl_backend.benchmark.tokenizer import committed_tokenizer
from minisgl_backend.engine import protocol
from minisgl_backend.engine.mask_buffer import MaskBuffer
from minisgl_backend.grammar.guide import (
    Guide,
    allowed_tokens,
    apply_token_masks,
    fill_masks,
    fill_threads,
    mask_words,
)
from minisgl_backend.host_cpus import usable_cpus


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="BatchGrammarMatcher thread counts to time (besides fill_masks)")
    p.add_argument("--tokenizer", default="llama-3", help="a committed benchmark tokenizer")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the logits' width (default: the tokenizer's)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    return p.parse_args()


def walk(guides: list[Guide], words: int, rng: random.Random, steps: int) -> None:
    """Advance each guide along `steps` random allowed tokens (fewer where it ends)."""
    mask = np.empty((1, words), dtype=np.int32)
    for guide in guides:
        for _ in range(rng.randrange(steps + 1)):
            guide.fill(mask, 0)
            allowed = allowed_tokens(mask)
            if guide.finished or not len(allowed):
                break
            guide.accept(int(rng.choice(allowed)))


def timed(fn: Callable[[], object], steps: int) -> float:
    """Mean milliseconds of `fn()` over `steps` calls, after one untimed."""
    fn()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return 1e3 * (time.perf_counter() - start) / steps


def echo(conn: Connection) -> None:
    """A stand-in engine process: answer every message with one byte until an empty one."""
    while data := conn.recv_bytes():
        protocol.decode(data)
        conn.send_bytes(b"k")


def round_trip(conn: Connection, message: bytes) -> None:
    conn.send_bytes(message)
    conn.recv_bytes()


def measure(compiled: xgr.CompiledGrammar, rows: int, words: int, vocab_size: int,
            device: torch.device, rng: random.Random, args: argparse.Namespace,
            conn: Connection) -> list[float]:
    """The table's cells for `rows` guided rows."""
    guides = [Guide(compiled, set()) for _ in range(rows)]
    walk(guides, words, rng, 40)
    # In the shared mask buffer, page-locked on a GPU: where the engine copies masks from.
    buffer = MaskBuffer(rows, words)
    page_locked = device.type == "cuda" and buffer.lock_pages()
    masks = buffer.view(0, rows)
    indices = list(range(rows))
    matchers = [g.matcher for g in guides]

    def one_by_one() -> None:
        for i, guide in enumerate(guides):
            guide.fill(masks, i)

    cells = [timed(one_by_one, args.steps)]
    for threads in args.threads:
        batch = xgr.BatchGrammarMatcher(max_threads=threads)
        cells.append(timed(partial(batch.batch_fill_next_token_bitmask, matchers, masks,
                                   indices=indices), args.steps))
    cells.append(timed(lambda: fill_masks(guides, masks, indices), args.steps))
    # One allowed token per row, accepted then rolled back (the state stays).
    one_by_one()
    tokens = [int(allowed_tokens(m)[0]) for m in masks]

    def accept() -> None:
        for guide, token in zip(guides, tokens):
            if guide.accept(token):
                guide.matcher.rollback(1)

    cells.append(timed(accept, args.steps))
    logits = torch.zeros(rows, vocab_size, device=device)

    def apply() -> None:
        apply_token_masks(logits, np.arange(rows), masks, page_locked=page_locked)
        if device.type == "cuda":
            torch.cuda.synchronize()

    cells.append(timed(apply, args.steps))
    # How the masks reach the engine process: through its pipe (encoded, sent, decoded), or
    # written in the shared mask buffer with only the MASKS message (`masks_ready`) sent.
    cells.append(timed(lambda: round_trip(conn, protocol.encode(protocol.MASKS, {
        "masks": masks})), args.steps))
    cells.append(timed(partial(round_trip, conn, protocol.masks_ready(1)), args.steps))
    return cells


def main() -> None:
    args = parse_args()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=committed_tokenizer(args.tokenizer))
    vocab_size = args.vocab_size or len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema({**PEOPLE, "minItems": 4})
    words = mask_words(vocab_size)
    device = torch.device(args.device)
    rng = random.Random(0)
    print(f"tokenizer {args.tokenizer}, vocabulary {vocab_size}, device {args.device}, "
          f"{args.steps} steps; ms per step")
    print(f"os.cpu_count() {os.cpu_count()}, usable CPUs {usable_cpus()}: fill_masks uses "
          + ", ".join(f"{fill_threads(rows)} thread(s) at {rows} rows" for rows in args.rows)
          + f"; xgrammar's default would be {os.cpu_count() // 2}")
    header = ["rows", "one by one"] + [f"batch, {t} threads" for t in args.threads] + [
        "fill_masks", "accept", "copy + apply", "masks through a pipe", "buffer + MASKS message"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    ours, theirs = mp.get_context("spawn").Pipe(duplex=True)
    engine = mp.get_context("spawn").Process(target=echo, args=(theirs,), daemon=True)
    engine.start()
    for rows in args.rows:
        cells = measure(compiled, rows, words, vocab_size, device, rng, args, ours)
        print(f"| {rows} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    ours.send_bytes(b"")
    engine.join()


if __name__ == "__main__":
    main()
