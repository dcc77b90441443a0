/* Query-token tasks for paged_attention (the AVX512-BF16 and the AVX2 paths): when a call runs
 * one task per query token (all its KV heads, each block read whole: decode_token_bf16, task_avx2
 * over all heads) rather than per (token, KV head), and the order of those tasks, longest first.
 * Portable: built without ISA flags. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention.h"

/* qsort order of (cost, first token, rows) tasks: costlier first, then lower index. */
static int costlier_first(const void* a, const void* b) {
    const int64_t* x = (const int64_t*)a;
    const int64_t* y = (const int64_t*)b;
    if (x[0] != y[0]) return x[0] > y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : (x[1] > y[1]);
}

int token_tasks_preferred(int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t max_n) {
    return num_kv_heads > 1 && num_kv_heads <= TOKEN_TASK_MAX_KV_HEADS && num_heads * max_n <= TOKEN_TASK_MAX_SCORES
        && num_tokens >= TOKEN_TASKS_PER_THREAD * omp_get_max_threads();
}

/* The call's tasks as (cost, first token, rows) triples, costliest first (LPT: with tokens in
 * batch order a long context last left one thread working while the other waited; the order
 * changes no token's arithmetic). A task is one token, or with tile_rows > 1 up to tile_rows
 * consecutive tokens of one sequence with consecutive lengths (a prefill chunk's rows). A token's
 * cost is the keys it reads: under a sliding window (window > 0) at most window.
 * Returns the number of tasks, or -1 on allocation failure (*tasks: free()). */
int64_t token_task_list(const int64_t* token_seq, const int64_t* token_lens, int64_t num_tokens, int64_t tile_rows,
                        int64_t window, int64_t** tasks) {
    int64_t* t3 = (int64_t*)malloc(sizeof(int64_t) * 3 * num_tokens);
    *tasks = t3;
    if (t3 == NULL) return -1;
    int64_t count = 0;
    for (int64_t t = 0; t < num_tokens;) {
        int64_t rows = 1, cost = token_lens[t] - pa_first_key(token_lens[t], window);
        while (rows < tile_rows && t + rows < num_tokens && token_seq[t + rows] == token_seq[t]
               && token_lens[t + rows] == token_lens[t] + rows) {
            cost += token_lens[t + rows] - pa_first_key(token_lens[t + rows], window);
            rows++;
        }
        t3[3 * count] = cost;
        t3[3 * count + 1] = t;
        t3[3 * count + 2] = rows;
        count++;
        t += rows;
    }
    qsort(t3, (size_t)count, 3 * sizeof(int64_t), costlier_first);
    return count;
}
