/* The attention kernels, one instance per KV cache element type, each with entry points
   for float32 and bfloat16 activations. */
#include "common.h"
#include "kv8.h"

/* The decode kernels' work items: a request, or a kv head of one (a head's arithmetic is
   the same whichever item or thread it falls in, so no split changes a bit of the output).
   A request longer than a thread's share of the batch's positions is split into its kv
   heads, the rest stay whole (every request split took 28-30 us a layer for four of 150
   positions, against 21 whole: each item pays its own pass over the slots), and the items
   go costliest first, so that the dynamic schedule ends balanced. SmolLM2's 9 heads over 3
   kv heads in bfloat16 on 2 Zen 4 threads, us a layer, the previous split (one item per
   request in index order, a request's kv heads only for a batch of one) against this one,
   two alternated runs: 29.8 and 30.1 / 26.4 and 27.0 for requests of 50 and 550 positions,
   27.9 and 27.9 / 23.6 and 23.4 for 50, 100 and 450; unchanged for even lengths and at 16
   and 64 requests. */
typedef struct {
    int64_t cost, b, j0, j1;
} DecodeItem;

static int costlier_first(const void* x, const void* y) {
    const DecodeItem *a = (const DecodeItem*)x, *c = (const DecodeItem*)y;
    if (a->cost != c->cost) return a->cost > c->cost ? -1 : 1;
    if (a->b != c->b) return a->b < c->b ? -1 : 1;
    return a->j0 < c->j0 ? -1 : a->j0 > c->j0;
}

/* The items of B requests of seq_lens positions (*n of them; the caller frees). */
static DecodeItem* decode_items(const int64_t* seq_lens, int64_t B, int64_t Hkv, int nthreads,
                                int64_t* n) {
    DecodeItem* items = (DecodeItem*)malloc(sizeof(DecodeItem) * (size_t)(B * Hkv + 1));
    if (!items) abort();
    int64_t total = 0, k = 0;
    for (int64_t b = 0; b < B; b++) total += seq_lens[b];
    for (int64_t b = 0; b < B; b++) {
        if (seq_lens[b] * nthreads > total)
            for (int64_t j = 0; j < Hkv; j++) items[k++] = (DecodeItem){seq_lens[b], b, j, j + 1};
        else
            items[k++] = (DecodeItem){seq_lens[b] * Hkv, b, 0, Hkv};
    }
    qsort(items, (size_t)k, sizeof(DecodeItem), costlier_first);
    *n = k;
    return items;
}

#define KV_SCALED 0

/* float32 */
#define KV_T float
#define KV_SUFFIX f32
#define KV_STORE(p, i, x) ((p)[i] = (x))
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#define KV_AVX512 0
#include "attention_instance.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_STORE
#undef KV_LOAD16
#undef KV_AVX512

/* float16: needs the compiler's _Float16 (GCC 12, clang 15 on x86-64) */
#if defined(__FLT16_MAX__)
#define KV_T _Float16
#define KV_SUFFIX f16
#define KV_STORE(p, i, x) ((p)[i] = (_Float16)(x))
#define KV_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))
#define KV_AVX512 1
#include "attention_instance.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_STORE
#undef KV_LOAD16
#undef KV_AVX512
#endif

/* bfloat16 */
#if 1
#define KV_T uint16_t
#define KV_SUFFIX bf16
#define KV_STORE(p, i, x) bf16_store(p, i, x)
#define KV_LOAD16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p))), 16))
#define KV_AVX512 1
#define KV_DPBF16 1
#include "attention_instance.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_STORE
#undef KV_LOAD16
#undef KV_AVX512
#undef KV_DPBF16
#endif

/* fp8_e5m2, fp8_e4m3 (uint8 bytes) and int8 (with a scale per slot and kv head) */
#define KV_AVX512 1
#define KV_T uint8_t
#define KV_SUFFIX e5m2
#define KV_STORE(p, i, x) e5m2_store(p, i, x)
#define KV_LOAD16(p) e5m2x16_load(p)
#include "attention_instance.h"
#undef KV_SUFFIX
#undef KV_STORE
#undef KV_LOAD16

#define KV_SUFFIX e4m3
#define KV_STORE(p, i, x) e4m3_store(p, i, x)
#define KV_LOAD16(p) e4m3x16_load(p)
#include "attention_instance.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_STORE
#undef KV_LOAD16

#undef KV_SCALED
#define KV_SCALED 1
#define KV_T int8_t
#define KV_SUFFIX i8
#define KV_LOAD16(p) i8x16_load(p)
#include "attention_instance.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_LOAD16
#undef KV_AVX512
#undef KV_SCALED
