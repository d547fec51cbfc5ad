"""Encoding random-token texts of 2k-128k tokens with the Qwen3.5 tokenizer in one piece and as
`Tokenizer.encode` does (pieces on all cores): the best of 5, and whether the ids agree.
python3 tokenize_bench.py"""

import random
import time

import deltaserve.tokenizer as T
from deltaserve.tokenizer_build import cached_tokenizer_dir

tok = T.Tokenizer.from_dir(cached_tokenizer_dir())
random.seed(0)
print("tokens  chars    one piece  in pieces  same ids")
for n in (2048, 8192, 32768, 131072):
    text = tok.decode([random.randrange(1000, 100000) for _ in range(n)])
    whole = tok._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
    one, cut = [], []
    for _ in range(5):
        t = time.perf_counter()
        tok._tokenizer.encode_batch_fast([text], add_special_tokens=False)
        one.append(time.perf_counter() - t)
        t = time.perf_counter()
        ids = tok.encode(text)
        cut.append(time.perf_counter() - t)
    print(f"{n:>6} {len(text):>7} {min(one) * 1e3:>9.1f} ms {min(cut) * 1e3:>7.1f} ms  {ids == whole}")
