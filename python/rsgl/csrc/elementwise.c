/* add+RMSNorm, SiLU-and-multiply and rotary over float32 rows (..._f32) and bfloat16 rows
   (..._bf16). */
#include "common.h"

#define ACT_BF16 0
#include "elementwise_impl.h"
#undef ACT_BF16

#define ACT_BF16 1
#include "elementwise_impl.h"
#undef ACT_BF16

/* Grammar masks: in each of `nrows` rows of float32 logits (row rows[i], `width` wide),
   every token whose bit is clear in row i of `bitmask` (int32 words, bit j % 32 of word
   j / 32, `words` per row) becomes -inf; tokens past the bitmask's 32 * words too. */
void rsgl_apply_token_bitmask_f32(float* logits, int64_t stride, int64_t width,
                                  const int64_t* rows, int64_t nrows, const int32_t* bitmask,
                                  int64_t words, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (nrows > 1 && threads > 1)
    for (int64_t i = 0; i < nrows; i++) {
        float* row = logits + rows[i] * stride;
        const uint32_t* bits = (const uint32_t*)(bitmask + i * words);
        for (int64_t w = 0; w < words && w * 32 < width; w++) {
            const uint32_t b = bits[w];
            if (b == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int64_t end = base + 32 < width ? base + 32 : width;
            for (int64_t j = base; j < end; j++)
                if (!((b >> (j - base)) & 1u)) row[j] = -INFINITY;
        }
        for (int64_t j = words * 32; j < width; j++) row[j] = -INFINITY;
    }
}

/* The instruction sets this library was compiled for, which pick the kernels' paths: the
   AVX-512 ones, the bf16 dot products, F16C conversions; else portable loops that the
   compiler vectorizes for whatever remains (AVX2 with FMA, or SSE2). */
const char* rsgl_kernel_isa(void) {
    return ""
#if defined(__AVX512F__)
           " avx512f"
#endif
#if defined(__AVX512BF16__)
           " avx512_bf16"
#endif
#if defined(__AVX2__)
           " avx2"
#endif
#if defined(__FMA__)
           " fma"
#endif
#if defined(__F16C__)
           " f16c"
#endif
#if !defined(__AVX__)
           " sse2"
#endif
        ;
}
