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

/* The uniforms of the sampler's exponential race (rsgl.layers.sampler.exponential_noise),
   bit for bit: for row r and token i, a splitmix64-style hash of
   seeds[r] * K1 + positions[r] * K2 + i * K3 (wrapping 64-bit arithmetic), whose top 24
   bits v become (v + 0.5) / 2^24 rounded to float32, held below 1. out: [rows, vocab]
   float32. */
void rsgl_race_uniforms(const int64_t* seeds, const int64_t* positions, int64_t rows,
                        int64_t vocab, float* out, int threads) {
    const uint64_t k1 = (uint64_t)INT64_C(-7046029254386353131);
    const uint64_t k2 = UINT64_C(0x632BE59BD9B4E019);
    const uint64_t k3 = (uint64_t)INT64_C(-4658895280553007687);
    const uint64_t k4 = (uint64_t)INT64_C(-7723592293110705685);
    const float below_one = 1.0f - 0x1p-24f;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (rows > 1 && threads > 1 && rows * vocab > PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const uint64_t key = (uint64_t)seeds[r] * k1 + (uint64_t)positions[r] * k2;
        float* row = out + r * vocab;
#pragma omp simd
        for (int64_t i = 0; i < vocab; i++) {
            uint64_t x = key + (uint64_t)i * k3;
            x ^= x >> 30;
            x *= k3;
            x ^= x >> 27;
            x *= k4;
            x ^= x >> 31;
            /* (v + 0.5) / 2^24 as one rounding of the integer 2v + 1, then an exact
               scaling: -ffast-math may not split it into another rounding. */
            const float u = (float)(int32_t)(2 * (x >> 40) + 1) * 0x1p-25f;
            row[i] = u < below_one ? u : below_one;
        }
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
#if defined(__AVX512VNNI__)
           " avx512_vnni"
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
