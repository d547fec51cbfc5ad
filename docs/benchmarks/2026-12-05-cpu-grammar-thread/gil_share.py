"""What a thread of pure Python keeps of its pace while xgrammar compiles a grammar on another thread.

    python3 docs/benchmarks/2026-12-05-cpu-grammar-thread/gil_share.py [--properties 400]

Compiles a JSON schema of N string properties with a pattern once alone, then once on a thread while
the main thread counts loop iterations; prints the compile times, the main loop's share of its solo
rate and its longest pause. The scheduler thread is that main loop when the engine compiles a grammar
on the backend's thread (engine/structured.py, compile_in_background).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import xgrammar as xgr

from deltaserve.engine.structured import grammar_vocabulary
from deltaserve.tiny import default_model_dir
from deltaserve.tokenizer import Tokenizer


def schema(tag: str, n: int) -> str:
    properties = {f"{tag}{i}": {"type": "string", "pattern": "[a-z]+[0-9]{2}"} for i in range(n)}
    return json.dumps({"type": "object", "properties": properties})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--properties", type=int, default=400)
    n = parser.parse_args().properties
    tokenizer = Tokenizer.from_dir(default_model_dir())
    vocab = grammar_vocabulary(tokenizer)
    info = xgr.TokenizerInfo(
        vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=len(vocab), stop_token_ids=[248046]
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False, max_threads=1)
    started = time.perf_counter()
    compiler.compile_json_schema(schema("a", n))
    print(f"compile alone: {time.perf_counter() - started:.3f} s")
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < 0.5:
        count += 1
    solo_rate = count / 0.5

    def compile_beside() -> None:
        t = time.perf_counter()
        compiler.compile_json_schema(schema("b", n))
        print(f"compile on a thread: {time.perf_counter() - t:.3f} s")

    thread = threading.Thread(target=compile_beside)
    started = time.perf_counter()
    thread.start()
    count, last, longest = 0, started, 0.0
    while thread.is_alive():
        now = time.perf_counter()
        longest, last, count = max(longest, now - last), now, count + 1
    elapsed = time.perf_counter() - started
    print(
        f"main loop beside it: {count / elapsed / solo_rate:.0%} of its solo rate, longest pause {longest * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
