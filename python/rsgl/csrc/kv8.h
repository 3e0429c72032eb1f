/* The 8-bit KV cache element types (--kv-cache-dtype fp8_e5m2, fp8_e4m3, int8): widening
   their rows to floats for the attention loops, and rounding floats to them exactly as the
   torch path stores them (rsgl/model_executor/kv_cache.py), so a key stored by the fused
   decode step equals the one a prefill stores.
   - fp8_e5m2 and fp8_e4m3 (torch's float8_e5m2 / float8_e4m3fn) store the value itself,
     saturated to the format's largest finite value, rounded to nearest even.
   - int8 stores round(x * 127 / amax) per (token, kv head), and amax / 127 beside it as a
     float32 scale; the kernels multiply a score by its key's scale and a probability by its
     value's scale instead of scaling each element. */
#ifndef RSGL_KV8_H
#define RSGL_KV8_H
#include "common.h"

#define E5M2_MAX 57344.f
#define E4M3_MAX 448.f

/* The value of fp8 bits b with M mantissa bits (7 - M exponent bits) and exponent bias
   `bias` (no infinities or NaNs: the stores never write them). */
static inline float fp8_value(uint8_t b, int M, int bias) {
    const int e = (b & 0x7f) >> M, m = b & ((1 << M) - 1);
    const float mag =
        e ? ldexpf((float)((1 << M) + m), e - bias - M) : ldexpf((float)m, 1 - bias - M);
    return b & 0x80 ? -mag : mag;
}

/* x rounded to nearest even in fp8 of M mantissa bits and bias `bias`, saturated at max
   (a NaN too, where torch's store would keep it NaN: a NaN key poisons its scores either
   way). */
static inline uint8_t fp8_bits(float x, int M, int bias, float max) {
    union { float f; uint32_t u; } c;
    c.f = x;
    const uint8_t sign = (uint8_t)((c.u >> 24) & 0x80);
    float a = fabsf(x);
    if (!(a <= max)) a = max;
    if (a < ldexpf(1.f, 1 - bias))  /* subnormal: a whole number of the smallest step */
        return sign | (uint8_t)rintf(ldexpf(a, bias - 1 + M));  /* rounding up to 1 << M
                                                                   is the smallest normal */
    int ex;
    frexpf(a, &ex);
    ex -= 1;  /* a = 1.xxx * 2^ex */
    int m = (int)rintf(ldexpf(a, M - ex)) - (1 << M);
    if (m == 1 << M) {
        m = 0;
        ex += 1;
    }
    return sign | (uint8_t)((ex + bias) << M) | (uint8_t)m;
}

static inline void e5m2_store(uint8_t* p, int64_t i, float x) {
    p[i] = fp8_bits(x, 2, 15, E5M2_MAX);
}

static inline void e4m3_store(uint8_t* p, int64_t i, float x) {
    p[i] = fp8_bits(x, 3, 7, E4M3_MAX);
}

/* Every fp8 byte's value, filled when the library loads. */
static float e5m2_table[256], e4m3_table[256];

__attribute__((constructor)) static void fill_fp8_tables(void) {
    for (int b = 0; b < 256; b++) {
        e5m2_table[b] = fp8_value((uint8_t)b, 2, 15);
        e4m3_table[b] = fp8_value((uint8_t)b, 3, 7);
    }
}

/* Rows as floats (see widen_f32). fp8 is the top of a float16 with the exponent re-biased:
   e5m2's bits are a float16's top byte; e4m3's sign, exponent and mantissa moved into a
   float16's fields read 2^-8 of the value (bias 15 instead of 7), subnormals included. */
#if defined(__F16C__)
static inline __m256 e5m2x8_load(const uint8_t* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
    return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}

static inline __m256 e4m3x8_load(const uint8_t* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
#endif

#if defined(__AVX512F__)
static inline __m512 e5m2x16_load(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
    return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}

static inline __m512 e4m3x16_load(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
    const __m256i h =
        _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

static inline __m512 i8x16_load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#endif

static inline const float* widen_e5m2(const uint8_t* src, float* tmp, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(tmp + i, e5m2x8_load(src + i));
#endif
    for (; i < n; i++) tmp[i] = e5m2_table[src[i]];
    return tmp;
}

static inline const float* widen_e4m3(const uint8_t* src, float* tmp, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(tmp + i, e4m3x8_load(src + i));
#endif
    for (; i < n; i++) tmp[i] = e4m3_table[src[i]];
    return tmp;
}

/* int8 rows widen to their integers; the scales apply to scores and probabilities. */
static inline const float* widen_i8(const int8_t* src, float* tmp, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) tmp[i] = (float)src[i];
    return tmp;
}

/* An int8 cache's decode kernels score keys against the query rounded to 16-bit integers
   per head: v = round(x * Q16_MAX / amax) (the multiplier one float32 division, as for
   keys), kept in two signed bytes, v = 256 * hi + lo with hi = (v + 128) >> 8 and lo in
   -128 .. 127 (Q16_MAX = 127 * 257 keeps hi within a signed byte). Writes v's bytes and
   returns the scale, amax times float32(1 / Q16_MAX): x ~ scale * v. */
#define Q16_MAX 32639.f
static inline float q16_split(const float* x, int64_t n, int8_t* hi, int8_t* lo) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float inv = amax > 0.f ? Q16_MAX / amax : 0.f;
    for (int64_t i = 0; i < n; i++) {
        float q = rintf(x[i] * inv);
        q = q > Q16_MAX ? Q16_MAX : (q < -Q16_MAX ? -Q16_MAX : q);
        const int32_t v = (int32_t)q;
        hi[i] = (int8_t)((v + 128) >> 8);
        lo[i] = (int8_t)(v - 256 * hi[i]);
    }
    return amax * (1.f / Q16_MAX);
}

/* One head's n values x as int8 at dst, with their scale at *scale: as KVCache.set_kv does
   (the multiplier 127 / amax, one float32 division; the scale amax times float32(1/127)). */
static inline void i8_store_head(int8_t* dst, float* scale, const float* x, int64_t n) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t i = 0; i < n; i++) {
        float q = rintf(x[i] * inv);
        q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
        dst[i] = (int8_t)q;
    }
    *scale = amax * (1.f / 127.f);
}

#endif /* RSGL_KV8_H */
