/* Query-token tasks for the AVX-512 BF16 path (included by attention_avx512.c): one OpenMP task
 * per decode token (decode_token_bf16 / decode_token_q8) or per tile of a prefill chunk's tokens
 * (prefill_tile_bf16), longest first. */

/* Query tokens per thread from which a call runs one task per token (decode_token_bf16) rather
 * than per (token, KV head): enough tasks to share between the threads. */
#ifndef TOKEN_TASKS_PER_THREAD
#define TOKEN_TASKS_PER_THREAD 4
#endif
/* Most scores (num_heads * context) a token task keeps: 6 bytes each, 768 KiB, within a 1 MiB L2.
 * Measured on Zen 4 with 32 query / 8 KV heads: 2,000-4,000 tokens of context 1.29-1.36x the
 * per-head tasks, 6,000-8,000 tokens (1.5 MiB of scores) 0.89-1.00x. */
#define TOKEN_TASK_MAX_SCORES (1 << 17)

/* qsort order of (cost, first token, rows) tasks: costlier first, then lower index. */
static int costlier_first(const void* a, const void* b) {
    const int64_t* x = (const int64_t*)a;
    const int64_t* y = (const int64_t*)b;
    if (x[0] != y[0]) return x[0] > y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : (x[1] > y[1]);
}

static inline int token_tasks_preferred(int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t max_n) {
    return num_kv_heads > 1 && num_kv_heads <= TOKEN_TASK_MAX_KV_HEADS && num_heads * max_n <= TOKEN_TASK_MAX_SCORES
        && num_tokens >= TOKEN_TASKS_PER_THREAD * omp_get_max_threads();
}

/* The call's tasks as (cost, first token, rows) triples, costliest first (LPT: with tokens in
 * batch order a long context last left one thread working while the other waited; the order
 * changes no token's arithmetic). A task is one token, or with tile_rows > 1 up to tile_rows
 * consecutive tokens of one sequence with consecutive lengths (a prefill chunk's rows).
 * Returns the number of tasks, or -1 on allocation failure (*tasks: free()). */
static int64_t token_task_list(const int64_t* token_seq, const int64_t* token_lens, int64_t num_tokens, int64_t tile_rows,
                               int64_t** tasks) {
    int64_t* t3 = (int64_t*)malloc(sizeof(int64_t) * 3 * num_tokens);
    *tasks = t3;
    if (t3 == NULL) return -1;
    int64_t count = 0;
    for (int64_t t = 0; t < num_tokens;) {
        int64_t rows = 1, cost = token_lens[t];
        while (rows < tile_rows && t + rows < num_tokens && token_seq[t + rows] == token_seq[t]
               && token_lens[t + rows] == token_lens[t] + rows) {
            cost += token_lens[t + rows];
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

/* paged_attention's fast path (bf16 queries; bf16 or int8 cache) with one OpenMP task per query
 * token, or per tile of a prefill chunk's tokens (bf16 cache, block size a multiple of 16;
 * fast_path_shape and token_tasks_preferred hold); max_n: the largest token_lens. Returns 0,
 * or -2 on allocation failure. */
static int paged_attention_tokens(const uint16_t* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                                  int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, uint16_t* out,
                                  int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t block_size, float scale, int kv_int8, int64_t max_n) {
    const int64_t group = num_heads / num_kv_heads;
    /* elements of a bf16 block, or bytes of an int8 one */
    const int64_t block_stride = kv_int8 ? num_kv_heads * Q8_BYTES(block_size, head_dim) : num_kv_heads * block_size * head_dim;
    /* a tile's scores (rows * group * max_n) within the token task's budget */
    int64_t tile_rows = TOKEN_TASK_MAX_SCORES / (group * max_n);
    tile_rows = tile_rows > TILE_MAX_ROWS ? TILE_MAX_ROWS : tile_rows;
    if (token_seq == NULL || kv_int8 || block_size % 16 != 0 || tile_rows < 2) tile_rows = 1;
    int64_t* tasks;
    const int64_t num_tasks = token_task_list(token_seq, token_lens, num_tokens, tile_rows, &tasks);
    if (num_tasks < 0) return -2;
    const int64_t score_elems = (num_heads > tile_rows * group ? num_heads : tile_rows * group) * max_n;
    int failed = 0;
#pragma omp parallel
    {
    __m512 (*acc)[4][8] = (__m512 (*)[4][8])aligned_alloc(64, sizeof(__m512) * (TOKEN_TASK_MAX_KV_HEADS > tile_rows ? TOKEN_TASK_MAX_KV_HEADS : tile_rows) * 4 * 8);
    float* scores = acc ? (float*)malloc((sizeof(float) + sizeof(uint16_t)) * score_elems) : NULL;
    uint16_t* pbf = scores ? (uint16_t*)(scores + score_elems) : NULL;
    if (scores == NULL) {
#pragma omp atomic write
        failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; i++) {
        if (scores == NULL) continue;
        const int64_t t = tasks[3 * i + 1], rows = tasks[3 * i + 2];
        const int64_t* table = block_tables + (token_seq ? token_seq[t] : t) * max_blocks;
        const uint16_t* qp = q + t * num_heads * head_dim;
        uint16_t* op = out + t * num_heads * head_dim;
#define TOKEN_TASK(G_, NV_)                                                                                                  \
        do {                                                                                                                 \
            if (kv_int8)                                                                                                     \
                decode_token_q8(qp, (const char*)k_cache, (const char*)v_cache, table, token_lens[t], block_size,         \
                                block_stride, num_kv_heads, G_, scale, op, scores, acc, NV_);                                     \
            else if (rows > 1)                                                                                               \
                prefill_tile_bf16(qp, (const uint16_t*)k_cache, (const uint16_t*)v_cache, table, token_lens[t], rows,       \
                                  block_size, block_stride, num_kv_heads, G_, scale, op, scores, pbf, acc, NV_);                \
            else                                                                                                             \
                decode_token_bf16(qp, (const uint16_t*)k_cache, (const uint16_t*)v_cache, table, token_lens[t], block_size, \
                                  block_stride, num_kv_heads, G_, scale, op, scores, pbf, acc, NV_);                              \
        } while (0)
        FAST_PATH_DISPATCH(group, head_dim, TOKEN_TASK)
#undef TOKEN_TASK
    }
    free(scores);
    free(acc);
    }
    free(tasks);
    return failed ? -2 : 0;
}
