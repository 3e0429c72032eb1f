/* Projections over GGUF's own weight blocks: y[M, N] = x[M, K] . W[N, K]^T, where each row
   of W is K / 32 blocks of one of llama.cpp's formats, read as the file stores them.

     Q4_0  18 bytes: fp16 d, 16 bytes of nibbles            w = d * (q - 8)
     Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles    w = d * q + m
     Q8_0  34 bytes: fp16 d, 32 int8                        w = d * q

   Nibble byte j holds element j (low half) and element j + 16 (high half). Each weight is
   rebuilt in float32 exactly as gguf's dequantize (and so transformers' loader) computes
   it: d * q has at most 19 significant bits, so it is exact in float32 and the one rounding
   is the + m (one fused multiply-add rounds once too). The model therefore multiplies by
   the same numbers as the dequantized float32 model, reading 4.5-8.5 bits per weight
   instead of 32; only the summation order differs.

   Every row of x is reduced in one fixed order whatever M is (32 lanes over the blocks,
   then a fixed tree), so a request's logits do not depend on the batch it ran in.

   rsgl_qlinear_<format>_<act>: x and y float32 (f32) or bfloat16 (bf16: x widened to float32
   once, y rounded once, as a bfloat16 linear with float32 accumulation rounds). */
#include <string.h>

#include "common.h"

#define QK 32

/* fp16 -> float32 without F16C: normals, subnormals, zeros, infinities and NaN. */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    union { uint32_t u; float f; } c;
    if (exp == 0x1fu) {
        c.u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        c.u = sign | ((exp + 112u) << 23) | (man << 13);
    } else {
        c.f = (float)man * 5.9604644775390625e-8f; /* man * 2^-24, exact */
        c.u |= sign;
    }
    return c.f;
#endif
}

static inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The 32 weights of one block, as floats (the portable path; the AVX2 path builds the same
   values in registers). */
static inline void dequant_block(int fmt, const uint8_t* b, float* w) {
    const float d = f16_to_f32(load_u16(b));
    if (fmt == 8) { /* Q8_0 */
        const int8_t* q = (const int8_t*)(b + 2);
        for (int i = 0; i < QK; i++) w[i] = d * (float)q[i];
        return;
    }
    const float m = fmt == 3 ? f16_to_f32(load_u16(b + 2)) : 0.f;
    const uint8_t* q = b + (fmt == 3 ? 4 : 2);
    const int off = fmt == 2 ? 8 : 0;
    for (int i = 0; i < QK / 2; i++) {
        w[i] = d * (float)((q[i] & 15) - off) + m;
        w[i + 16] = d * (float)((q[i] >> 4) - off) + m;
    }
}

static inline int64_t block_bytes(int fmt) { return fmt == 2 ? 18 : fmt == 3 ? 20 : 34; }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* One block's 32 weights in four registers: elements 0-7, 8-15, 16-23, 24-31. */
static inline void dequant_block8(int fmt, const uint8_t* b, __m256* w) {
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(load_u16(b) | (uint32_t)load_u16(b + 2) << 16)));
    const __m256 d = _mm256_broadcastss_ps(dm);
    if (fmt == 8) {
        const __m128i q0 = _mm_loadu_si128((const __m128i*)(b + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i*)(b + 18));
        w[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)));
        w[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))));
        w[2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)));
        w[3] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))));
        return;
    }
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + (fmt == 3 ? 4 : 2)));
    const __m128i nib = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(q, nib);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
    __m256i n[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                    _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
    if (fmt == 3) {
        const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(n[i]), d, m);
    } else {
        const __m256i eight = _mm256_set1_epi32(8);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(n[i], eight)));
    }
}

static inline float hsum8(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 s = _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* Rows r0 and (when two) r0 + 1 of y, output column n. */
static inline void dot_rows(int fmt, const uint8_t* wrow, int64_t nb, const float* x0,
                            const float* x1, float* y0, float* y1) {
    const int64_t bs = block_bytes(fmt);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t k = 0; k < nb; k++) {
        __m256 w[4];
        dequant_block8(fmt, wrow + k * bs, w);
        const float* p = x0 + k * QK;
        a0 = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(p), a0);
        a1 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(p + 8), a1);
        a2 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(p + 16), a2);
        a3 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(p + 24), a3);
        if (x1) {
            const float* r = x1 + k * QK;
            b0 = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(r), b0);
            b1 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(r + 8), b1);
            b2 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(r + 16), b2);
            b3 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(r + 24), b3);
        }
    }
    *y0 = hsum8(a0, a1, a2, a3);
    if (x1) *y1 = hsum8(b0, b1, b2, b3);
}
#else
/* The same lanes and tree as the AVX2 path, in plain C for whatever the compiler targets. */
static inline float hsum32(const float* acc) {
    float s[8], h[4];
    for (int i = 0; i < 8; i++) s[i] = (acc[i] + acc[8 + i]) + (acc[16 + i] + acc[24 + i]);
    for (int i = 0; i < 4; i++) h[i] = s[i] + s[4 + i];
    return (h[0] + h[2]) + (h[1] + h[3]);
}

static inline void dot_rows(int fmt, const uint8_t* wrow, int64_t nb, const float* x0,
                            const float* x1, float* y0, float* y1) {
    const int64_t bs = block_bytes(fmt);
    float a[QK] = {0}, b[QK] = {0}, w[QK];
    for (int64_t k = 0; k < nb; k++) {
        dequant_block(fmt, wrow + k * bs, w);
        const float* p = x0 + k * QK;
        for (int i = 0; i < QK; i++) a[i] += w[i] * p[i];
        if (x1) {
            const float* r = x1 + k * QK;
            for (int i = 0; i < QK; i++) b[i] += w[i] * r[i];
        }
    }
    *y0 = hsum32(a);
    if (x1) *y1 = hsum32(b);
}
#endif

/* y[M, N] = x[M, K] . W^T over float32 rows; K a multiple of 32. Columns of y are split over
   threads; each thread walks its weight rows once per pair of x rows. */
static void qlinear_f32(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* w,
                        int64_t N, float* y, int threads) {
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(fmt);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N * M * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* wrow = w + n * row_bytes;
        for (int64_t r = 0; r < M; r += 2) {
            const int two = r + 1 < M;
            dot_rows(fmt, wrow, nb, x + r * K, two ? x + (r + 1) * K : NULL, y + r * N + n,
                     two ? y + (r + 1) * N + n : NULL);
        }
    }
}

static void qlinear_bf16(int fmt, const uint16_t* x, int64_t M, int64_t K, const uint8_t* w,
                         int64_t N, uint16_t* y, int threads) {
    float* xf = (float*)malloc((size_t)(M * K + M * N) * sizeof(float));
    if (!xf) abort();
    float* yf = xf + M * K;
    widen_bf16(x, xf, M * K);
    qlinear_f32(fmt, xf, M, K, w, N, yf, threads);
    for (int64_t i = 0; i < M * N; i++) bf16_store(y, i, yf[i]);
    free(xf);
}

/* Rows `ids` of W as floats into out[len(ids), K]: an embedding lookup in the blocks. */
static void dequant_rows(int fmt, const uint8_t* w, int64_t K, const int64_t* ids, int64_t n,
                         float* out) {
    const int64_t nb = K / QK, bs = block_bytes(fmt);
    for (int64_t i = 0; i < n; i++)
        for (int64_t k = 0; k < nb; k++)
            dequant_block(fmt, w + ids[i] * nb * bs + k * bs, out + i * K + k * QK);
}

#define QLINEAR(name, fmt)                                                                   \
    void rsgl_qlinear_##name##_f32(const float* x, int64_t M, int64_t K, const uint8_t* w,   \
                                   int64_t N, float* y, int threads) {                       \
        qlinear_f32(fmt, x, M, K, w, N, y, threads);                                         \
    }                                                                                        \
    void rsgl_qlinear_##name##_bf16(const uint16_t* x, int64_t M, int64_t K,                 \
                                    const uint8_t* w, int64_t N, uint16_t* y, int threads) { \
        qlinear_bf16(fmt, x, M, K, w, N, y, threads);                                        \
    }                                                                                        \
    void rsgl_dequant_rows_##name(const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, \
                                  float* out) {                                              \
        dequant_rows(fmt, w, K, ids, n, out);                                                \
    }

/* ggml's type numbers: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8. */
QLINEAR(q4_0, 2)
QLINEAR(q4_1, 3)
QLINEAR(q8_0, 8)
