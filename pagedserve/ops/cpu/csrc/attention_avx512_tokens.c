/* Query-token tasks for the AVX-512 BF16 path (included by attention_avx512.c): one OpenMP task
 * per decode token (decode_token_bf16 / decode_token_q8) or per tile of a prefill chunk's tokens
 * (prefill_tile_bf16), longest first (the choice and the order: attention_token_tasks.c). */

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
