/* Query-token tasks for the AVX2 path (included by attention_avx2.c): one OpenMP task per query
 * token over all its KV heads (task_avx2 with nkv = num_kv_heads), longest first, when
 * token_tasks_preferred holds (attention_token_tasks.c). Each block's K and V are then read as
 * one contiguous stream of num_kv_heads * block_size * head_dim values instead of one head's
 * 2 KiB slice per task (benchmarks/README.md, "Issue 15 on an AVX2-only Zen 1"). */

/* paged_attention over token tasks (head_dim % 8 == 0, group <= AVX2_MAX_GROUP, no int8 cache);
 * max_n: the largest token_lens. Returns 0, or -2 on allocation failure. */
static int paged_attention_tokens_avx2(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                                       int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, void* out,
                                       int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, float scale, int is_bf16, int64_t max_n) {
    const int64_t group = num_heads / num_kv_heads, esize = is_bf16 ? 2 : 4;
    const int64_t block_stride = num_kv_heads * block_size * head_dim;  /* elements */
    int64_t* tasks;
    const int64_t num_tasks = token_task_list(token_seq, token_lens, num_tokens, 1, &tasks);
    if (num_tasks < 0) return -2;
    int failed = 0;
#pragma omp parallel
    {
    float (*qf)[MAX_HEAD_DIM] = (float (*)[MAX_HEAD_DIM])aligned_alloc(32, sizeof(float) * MAX_HEAD_DIM * 2 * num_heads);
    float (*acc)[MAX_HEAD_DIM] = qf ? qf + num_heads : NULL;
    float* scores = qf ? (float*)malloc(sizeof(float) * num_heads * max_n) : NULL;
    if (scores == NULL) {
#pragma omp atomic write
        failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; i++) {
        if (scores == NULL) continue;
        const int64_t t = tasks[3 * i + 1];
        const int64_t* table = block_tables + (token_seq ? token_seq[t] : t) * max_blocks;
        const char* qp = (const char*)q + t * num_heads * head_dim * esize;
        char* op = (char*)out + t * num_heads * head_dim * esize;
        if (is_bf16)
            task_avx2_any(qp, k_cache, v_cache, table, token_lens[t], block_size, block_stride, 0, num_kv_heads, group, head_dim,
                          scale, op, scores, qf, acc, 1);
        else
            task_avx2_any(qp, k_cache, v_cache, table, token_lens[t], block_size, block_stride, 0, num_kv_heads, group, head_dim,
                          scale, op, scores, qf, acc, 0);
    }
    free(scores);
    free(qf);
    }
    free(tasks);
    return failed ? -2 : 0;
}
