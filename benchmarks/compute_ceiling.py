"""This CPU's compute ceiling for issue 15's throughput targets, in three figures:

1. **FMA peak**: a C loop of 12 independent float32 FMA chains (8 lanes with AVX2 + FMA, 16
   with AVX-512), built with ``-march=native``, on 1 .. ``--threads`` OpenMP threads: GFLOP/s at
   2 FLOP per lane per FMA, the best of 5 runs. It is the hardware bound of float32 arithmetic,
   and so of the bf16 matmul on CPUs without bf16 instructions (``csrc/gemm/avx2.c`` widens bf16
   to float32 and sums with FMA). CPUs with AVX512-BF16 or AMX multiply bf16 faster than this;
   there the figure is not their ceiling, and the script says so.
2. **The engine's bf16 matmul** on such CPUs (``csrc/gemm/avx2.c``: the engine's own object of
   that unit, built with its flags, timed in C, as a decode step calls it) at several row
   counts: GFLOP/s and share of 1 over the model's decoder layers (its four projections,
   weighted as in the model) and over its LM head. Each shape is timed over copies of it that add up to ``--cold-mib`` (256 MiB,
   beyond the last-level cache) on 2 MiB pages, so weights are read cold, as in a step. Beside
   it, the ``torch.matmul`` probe that ``bench`` divides by for MFU.
3. **W1's ceiling**: W1's model FLOPs (``bench``'s count: 2 x matmul params x tokens; 32
   requests, prompts 64-512 tokens, 128 output tokens, seed 0) over 1: the output tok/s W1 would
   reach if the matmuls ran at the FMA peak and everything else (attention, element-wise ops,
   scheduling) were free. Issue 15's target 1 asks for 750.

    .venv/bin/python benchmarks/compute_ceiling.py [--model DIR] [--threads 2] [--cold-mib 256]
        [--rows 1,16,32,64,128,512] [--rounds 5]
    .venv/bin/python benchmarks/compute_ceiling.py --tiny     # smoke run: short loops, a tiny model, seconds

Appends its figures to benchmarks/results/compute_ceiling.jsonl.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

import torch

from pagedserve.bench.datasets import sample_random
from pagedserve.bench.results import record
from pagedserve.bench.flops import measure_matmul_flops, model_flops, projection_shapes
from pagedserve.bench.throughput import load_tokenizer_and_config
from pagedserve.model.loader import cpu_has_bf16
from pagedserve.model.packed_linear import avx2_bf16

FMA_LOOP = r"""
#if !defined(__FMA__) && !defined(__AVX512F__)
#error "no FMA on this CPU"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>
#ifdef __AVX512F__
typedef __m512 V;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define ASM "+v"
#else
typedef __m256 V;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define ASM "+x"
#endif
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
    const long iters = atol(argv[1]);
    double best = 0;
    for (int run = 0; run < 5; run++) {
        float sink = 0;
        int team = 1;
        const double t0 = now();
#pragma omp parallel reduction(+ : sink)
        {
#pragma omp single
            team = omp_get_num_threads();   /* 12 named chains: as an array GCC stores them every iteration */
            V a0 = SET1(0), a1 = SET1(1), a2 = SET1(2), a3 = SET1(3), a4 = SET1(4), a5 = SET1(5);
            V a6 = SET1(6), a7 = SET1(7), a8 = SET1(8), a9 = SET1(9), a10 = SET1(10), a11 = SET1(11);
            const V b = SET1(0.999f), c = SET1(0.001f);
            for (long k = 0; k < iters; k++) {
                a0 = FMA(a0, b, c); a1 = FMA(a1, b, c); a2 = FMA(a2, b, c); a3 = FMA(a3, b, c);
                a4 = FMA(a4, b, c); a5 = FMA(a5, b, c); a6 = FMA(a6, b, c); a7 = FMA(a7, b, c);
                a8 = FMA(a8, b, c); a9 = FMA(a9, b, c); a10 = FMA(a10, b, c); a11 = FMA(a11, b, c);
                __asm__("" : ASM(a0), ASM(a1), ASM(a2), ASM(a3), ASM(a4), ASM(a5));
                __asm__("" : ASM(a6), ASM(a7), ASM(a8), ASM(a9), ASM(a10), ASM(a11));
            }
            V s = ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7)));
            s = ADD(s, ADD(ADD(a8, a9), ADD(a10, a11)));
            float o[LANES];
            memcpy(o, &s, sizeof(o));
            sink += o[0];
        }
        const double g = (double)iters * team * 12 * LANES * 2 / (now() - t0) / 1e9;
        if (g > best) best = g;
        if (sink != sink) return 1; /* keeps the result live */
    }
    printf("%d %.3f\n", LANES, best);
    return 0;
}
"""


def compile_c(src_text: str, out_dir: str, flags: list[str]) -> str:
    """Build ``src_text`` with ``$CC`` (default ``cc``, as the engine's kernels); the executable's
    path. Exits with a message (status 2) where it cannot be built here."""
    src, exe = os.path.join(out_dir, "main.c"), os.path.join(out_dir, "main")
    with open(src, "w") as fh:
        fh.write(src_text)
    cc = os.environ.get("CC", "cc")
    try:
        done = subprocess.run([cc, *flags, src, "-o", exe, "-lm"], capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit(f"compute_ceiling: no C compiler ({cc}); set CC") from None
    if done.returncode != 0:
        raise SystemExit("compute_ceiling: this CPU has no AVX2 + FMA or AVX-512 (or the build failed):\n" + done.stderr[-2000:])
    return exe


def fma_peak(threads: int, iters: int = 100_000_000) -> tuple[int, float]:
    """(lanes, best GFLOP/s) of the FMA loop on ``threads`` OpenMP threads (one per core, spread)."""
    with tempfile.TemporaryDirectory(prefix="fma_peak_") as tmp:
        exe = compile_c("#include <string.h>\n#include <stdlib.h>\n" + FMA_LOOP, tmp, ["-O2", "-march=native", "-fopenmp"])
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="spread")
        out = subprocess.run([exe, str(iters // threads)], check=True, capture_output=True, text=True, env=env).stdout.split()
    return int(out[0]), float(out[1])


GEMM_MAIN = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "gemm.h" /* ps_avx2_gemm: the unit's matmul, linked from the engine's object of gemm/avx2.c */
#include <sys/mman.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmp(const void* a, const void* b) { double d = *(const double*)a - *(const double*)b; return (d > 0) - (d < 0); }
/* args: K N M copies rounds (1 .. 63); prints the median seconds of one pass over the copies */
int main(int argc, char** argv) {
    if (argc != 6) return 2;
    const int64_t K = atol(argv[1]), N = atol(argv[2]), M = atol(argv[3]);
    const int copies = atoi(argv[4]), rounds = atoi(argv[5]);
    if (K < 1 || N < 1 || M < 1 || copies < 1 || rounds < 1 || rounds > 63) return 2;
    const int64_t per = (N + 15) / 16 * 16 * K;
    const size_t bytes = ((size_t)per * 2 * copies + (2 << 20) - 1) / (2 << 20) * (2 << 20);
    uint16_t* w = aligned_alloc(2 << 20, bytes);
    uint16_t* x = malloc(M * K * 2);
    uint16_t* y = malloc(M * N * 2);
    if (!w || !x || !y) return 3;
    madvise(w, bytes, MADV_HUGEPAGE);
    for (int64_t i = 0; i < per * copies; i++) w[i] = (uint16_t)(0x3c00 + i % 251);
    madvise(w, bytes, 25); /* MADV_COLLAPSE, as the engine does for its weights (Linux >= 6.1; else 4 KiB pages) */
    for (int64_t i = 0; i < M * K; i++) x[i] = (uint16_t)(0x3c00 + i % 13);
    double t[64];
    for (int r = 0; r <= rounds; r++) {
        const double t0 = now();
        for (int c = 0; c < copies; c++)
            if (ps_avx2_gemm(x, M, K, w + c * per, NULL, y, N)) return 1;
        t[r] = now() - t0; /* round 0: warm-up */
    }
    qsort(t + 1, rounds, sizeof(double), cmp);
    printf("%.9f\n", t[1 + rounds / 2]);
    return 0;
}
"""


def avx2_matmul(cfg, rows: list[int], rounds: int, threads: int, cold_bytes: int) -> dict[int, tuple[float, float]]:
    """Per row count, GFLOP/s of ``csrc/gemm/avx2.c`` (the unit's object as the engine builds it
    for its decode library, linked into a C timer: a decode step calls it from C too; the caller
    checks that the CPU has AVX2 + FMA, as gemm.c does) over the model's decoder layers (its four
    projections, weighted as in the model) and over its LM head. Each shape is timed over enough copies to read
    ``cold_bytes`` a pass (beyond the last-level cache: cold, as in a step); the median pass time
    over the copies is one instance's time."""
    from pagedserve.ops.cpu import build

    # The engine's object of the unit (its flags, from the decode library; kept under kernels/obj/,
    # compiled here if the engine has not yet), linked into the timer built with the portable flags.
    unit = [(src, flags) for src, flags in build._units("decode") if src == "gemm/avx2.c"]
    [(obj, _)] = build._objects(build._CSRC, unit)
    flags = build._COMMON_FLAGS + build._LIBS["decode"][0] + ["-I", os.path.join(build._CSRC, "gemm"), obj]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    layer = projection_shapes(cfg)
    head = (cfg.vocab_size, cfg.hidden_size)
    with tempfile.TemporaryDirectory(prefix="avx2_gemm_") as tmp:
        exe = compile_c(GEMM_MAIN, tmp, flags)

        def instance_seconds(n: int, k: int, m: int) -> float:
            copies = max(1, -(-cold_bytes // (-(-n // 16) * 16 * k * 2)))
            out = subprocess.run([exe, str(k), str(n), str(m), str(copies), str(rounds)], check=True, capture_output=True, text=True, env=env)
            return float(out.stdout) / copies

        result = {}
        for m in rows:
            layer_s = sum(instance_seconds(n, k, m) for n, k in layer)
            head_s = instance_seconds(*head, m)
            result[m] = (2.0 * m * sum(n * k for n, k in layer) / layer_s / 1e9, 2.0 * m * head[0] * head[1] / head_s / 1e9)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder or GGUF (default: the default model)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--cold-mib", type=int, default=256, help="weights each timed pass of 2. reads (MiB; beyond the last-level cache)")
    ap.add_argument("--rows", default="1,16,32,64,128,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="smoke run: short loops, 8 MiB passes, rows 1,16, a tiny random model")
    args = ap.parse_args()
    iters = 100_000_000
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.rows, args.rounds, args.cold_mib, iters = "1,16", 1, 8, 2_000_000
    cores = len(os.sched_getaffinity(0))
    if not 1 <= args.threads <= cores:
        ap.error(f"--threads must be 1 .. {cores} (the cores this process may use): more threads than cores understate the peak")
    if not 1 <= args.rounds <= 63:
        ap.error("--rounds must be 1 .. 63")
    torch.set_num_threads(args.threads)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error("--rows must be positive integers separated by commas")
    if min(rows) < 1:
        ap.error("--rows must be positive")

    peaks = {t: fma_peak(t, iters) for t in sorted({1, args.threads})}
    lanes, peak = peaks[args.threads]
    print(f"1. FMA peak (float32, {lanes} lanes): " + ", ".join(f"{t} thread(s) {p:.1f} GFLOP/s" for t, (_, p) in peaks.items()))
    if cpu_has_bf16():
        print("   this CPU multiplies bf16 natively (AMX or AVX512-BF16): the float32 FMA peak is not its bf16 ceiling")

    _, tokenizer, cfg = load_tokenizer_and_config(args.model)
    probe = measure_matmul_flops(cfg.hidden_size, cfg.intermediate_size, torch.bfloat16, seconds=1.0) / 1e9
    print(f"2. bench's matmul probe (MFU's denominator): {probe:.1f} GFLOP/s ({probe / peak:.0%} of the FMA peak)")
    matmul = {}
    if avx2_bf16(torch.bfloat16):
        print(f"   the engine's bf16 matmul (gemm/avx2.c), cold ({args.cold_mib} MiB a pass), {args.threads} threads, GFLOP/s and share of the FMA peak:")
        for m, (layers, head) in avx2_matmul(cfg, rows, args.rounds, args.threads, args.cold_mib << 20).items():
            print(f"   {m:5d} rows: decoder layers {layers:6.1f} ({layers / peak:5.1%}), LM head {head:6.1f} ({head / peak:5.1%})")
            matmul[m] = {"decoder_layers_gflop_s": layers, "lm_head_gflop_s": head}
    else:
        print("   the engine's bf16 matmul here is not gemm/avx2.c (AMX, AVX512-BF16 or oneDNN): not measured")

    reqs = sample_random(tokenizer, 32, (64, 512), (128, 128), seed=0)
    prompt = sum(len(r.prompt_token_ids) for r in reqs)
    out = sum(r.expected_output_len for r in reqs)
    flops = model_flops(cfg).flops(prompt + out - len(reqs), out)
    t = flops / (peak * 1e9)
    print(f"3. W1 ({len(reqs)} requests, {prompt} prompt + {out} output tokens): {flops / 1e12:.2f} TFLOP of matmuls, "
          f"{t:.1f} s at the FMA peak: at most {out / t:.0f} output tok/s with all else free (target 1: 750)")
    record("compute_ceiling", {"threads": args.threads, "fma_lanes": lanes, "fma_peak_gflop_s": {t: p for t, (_, p) in peaks.items()},
                               "matmul_probe_gflop_s": probe, "avx2_matmul": matmul, "w1_tflop": flops / 1e12,
                               "w1_ceiling_output_tok_s": out / t}, tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})


if __name__ == "__main__":
    main()
