"""What ``allowed_token_ids`` and ``bad_words`` cost a step: the worker's sampling metadata plus
the sampler for ``--rows`` greedy rows over SmolLM2's vocabulary, each row restricted, against
the same rows unrestricted, in the same process, alternating. Also the one-time cost of n
copies of a request with a full-vocabulary ``allowed_token_ids`` (clone, encode, decode with
the checks), which a request pays at admission. Prints medians in ms and the ratios.

    .venv/bin/python benchmarks/sampling_bans.py [--rows 32] [--rounds 30] [--threads 2]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch

from pagedserve import messages as serial
from pagedserve.model.sampler import Sampler
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.input_batch import CachedRequestState, InputBatch

V = 49152


def batch_of(rows: int, make_params) -> tuple[InputBatch, np.ndarray]:
    batch = InputBatch(rows, 1024, 64, V, torch.device("cpu"))
    ids = [batch.add_request(CachedRequestState(f"r{i}", make_params(i), [], None), list(range(300)), list(range(100)), [0], 0)
           for i in range(rows)]
    return batch, np.array(ids, dtype=np.int64)


def with_bad_words(i: int) -> SamplingParams:
    p = SamplingParams(temperature=0.0)
    rnd = random.Random(i)
    p._bad_words_token_ids = [[rnd.randrange(V) for _ in range(rnd.randint(1, 6))] for _ in range(128)]  # the cap: 64 words x 2
    return p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, V)
    sampler = Sampler()
    cases = {
        "unrestricted": batch_of(args.rows, lambda i: SamplingParams(temperature=0.0)),
        "allowed 100 ids": batch_of(args.rows, lambda i: SamplingParams(temperature=0.0, allowed_token_ids=list(range(100)))),
        "allowed all ids": batch_of(args.rows, lambda i: SamplingParams(temperature=0.0, allowed_token_ids=list(range(V)))),
        "bad words 128 spellings": batch_of(args.rows, with_bad_words),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, (batch, rows) in cases.items():
            t = time.perf_counter()
            sampler(logits, batch.sampling_metadata(rows))
            times[name].append((time.perf_counter() - t) * 1e3)
    base = statistics.median(times["unrestricted"])
    print(f"{args.rows} greedy rows, vocabulary {V}: metadata + sampling per step (median of {args.rounds})")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:26s} {m:6.2f} ms   {m / base:5.2f}x unrestricted")
    params = SamplingParams(allowed_token_ids=list(range(V)), n=5, max_tokens=8)
    t = time.perf_counter()
    kids = [params.clone() for _ in range(5)]
    clone = time.perf_counter() - t
    t = time.perf_counter()
    msgs = [serial.encode(k) for k in kids]
    enc = time.perf_counter() - t
    t = time.perf_counter()
    for m in msgs:
        serial.decode(m)
    dec = time.perf_counter() - t
    print(f"n=5 copies of a full-vocabulary allowed_token_ids (the per-request cap): clone {clone * 1e3:.1f} ms, "
          f"encode {enc * 1e3:.1f} ms, decode with checks {dec * 1e3:.1f} ms, {sum(map(len, msgs)) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
