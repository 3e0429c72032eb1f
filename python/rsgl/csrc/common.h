/* Helpers shared by rsgl's CPU kernels (see rsgl/layers/cpu_kernels.py): prefetching,
   fast exp and sigmoid, bfloat16 conversions, widening 16-bit KV rows to floats, softmax,
   and FN(name), which names a kernel instance after the KV element type it was compiled
   for. */
#ifndef RSGL_COMMON_H
#define RSGL_COMMON_H
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Rows this many positions ahead are prefetched: KV slots are indirect, so the hardware
   prefetcher cannot follow them when the core's allocator scattered a request's pages. */
#define PREFETCH_AHEAD 4

static inline void prefetch_bytes(const void* p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch((const char*)p + i);
}

/* exp(x) for x <= 0: range reduction to [-ln2/2, ln2/2], a degree-6 polynomial (Cephes
   coefficients, ~1 ulp), and the power of two put straight into the exponent bits. Plain
   arithmetic, so the softmax loop vectorizes; libm's expf is a scalar call per element. */
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union { float f; int32_t i; } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}

/* exp(x) for any x, through exp_nonpos: e^x = 1 / e^-x for x > 0. */
static inline float sigmoid(float x) {
    const float e = exp_nonpos(x > 0.f ? -x : x);
    return x > 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}

#if defined(__AVX512F__)
/* exp_nonpos and sigmoid on 16 lanes, step for step (the compiler may fuse the scalar
   versions' multiply-adds differently: results agree to a float32 ulp). */
static inline __m512 exp_nonpos16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 sigmoid16(__m512 x) {
    const __m512 neg_abs = _mm512_min_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), x));
    const __m512 e = exp_nonpos16(neg_abs);
    const __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 num = _mm512_mask_blend_ps(pos, e, _mm512_set1_ps(1.f));
    /* 1 / (1 + e) by the 14-bit reciprocal and one Newton step (~2**-27 relative): a
       division is the slowest instruction here. */
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.f)));
    return _mm512_mul_ps(num, inv);
}

/* 16 bfloat16 values widened to floats. */
static inline __m512 bf16x16_load(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* 16 floats rounded to bfloat16 as f32_to_bf16 does, in the low halves of 32-bit lanes.
   (Not AVX512-BF16's vcvtneps2bf16, which flushes denormals to zero: torch keeps them.) */
static inline __m512i bf16x16_bits(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_blend_epi32(nan, rounded, quiet_nan);
}

static inline void bf16x16_store(uint16_t* p, __m512 x) {
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(bf16x16_bits(x)));
}

/* x rounded to bfloat16, as floats (bf16_round on 16 lanes). */
static inline __m512 bf16x16_round(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_bits(x), 16));
}
#endif

/* The elementwise kernels split rows over threads above this many elements (~150 KB per
   operand): below it the fork/join costs more than it saves. */
#define PARALLEL_MIN_ELEMS 32768

/* A KV row as floats: float32 rows are used in place; 16-bit rows are widened into tmp
   (n floats), so the attention loops run on floats whatever the cache stores. */
static inline const float* widen_f32(const float* src, float* tmp, int64_t n) {
    (void)tmp;
    (void)n;
    return src;
}

#if defined(__FLT16_MAX__)
/* float16 needs the compiler's _Float16 (GCC 12, clang 15 on x86-64); without it the float16
   kernels are left out and a float16 cache uses the eager torch path. */
static inline const float* widen_f16(const _Float16* src, float* tmp, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    /* GCC 12 cannot vectorize _Float16 -> float without AVX512-FP16; F16C can. */
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(tmp + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
    for (; i < n; i++) tmp[i] = (float)src[i];
    return tmp;
}
#endif

/* bfloat16 is the top half of a float32: widening is a shift; narrowing rounds to nearest
   even (as torch's .to(torch.bfloat16) does) and keeps NaN a quiet NaN. Written as plain
   selects so that loops over them vectorize. */
static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float x) {
    union { float f; uint32_t u; } c;
    c.f = x;
    const uint32_t rounded = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (c.u >> 16) | 0x40u;
    return (uint16_t)((c.u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* x rounded to bfloat16, as a float: what a bfloat16 torch op would have produced. */
static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static inline const float* widen_bf16(const uint16_t* src, float* tmp, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) tmp[i] = bf16_to_f32(src[i]);
    return tmp;
}

static inline void bf16_store(uint16_t* p, int64_t i, float x) { p[i] = f32_to_bf16(x); }

/* Scratch floats attend_one needs: a widened row (Hkv * D) and H x 16 x 16 partial sums. */
#define ATTEND_TMP(H, Hkv, D) ((Hkv) * (D) + 256 * (H))

/* Each of the H rows of sc (len scores) becomes its softmax. */
static void softmax_rows(float* sc, int64_t H, int64_t len) {
    for (int64_t h = 0; h < H; h++) {
        float* sh = sc + h * len;
        float mx = -FLT_MAX;
        float sum = 0.f;
        int64_t s0 = 0;
#if defined(__AVX512F__)
        /* 16 lanes at a time (the compiler leaves the max scalar and the exp at 8 lanes):
           at decode batch 64 x 1,024 positions the softmax was a quarter of attention. */
        __m512 m16 = _mm512_set1_ps(-FLT_MAX);
        for (; s0 + 16 <= len; s0 += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(sh + s0));
        mx = _mm512_reduce_max_ps(m16);
        for (int64_t s = s0; s < len; s++) mx = sh[s] > mx ? sh[s] : mx;
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512 sum16 = _mm512_setzero_ps();
        for (s0 = 0; s0 + 16 <= len; s0 += 16) {
            const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(sh + s0), vmx));
            _mm512_storeu_ps(sh + s0, e);
            sum16 = _mm512_add_ps(sum16, e);
        }
        sum = _mm512_reduce_add_ps(sum16);
#else
        for (int64_t s = 0; s < len; s++) mx = sh[s] > mx ? sh[s] : mx;
#endif
        for (int64_t s = s0; s < len; s++) {
            sh[s] = exp_nonpos(sh[s] - mx);
            sum += sh[s];
        }
        const float inv = 1.f / sum;
        for (int64_t s = 0; s < len; s++) sh[s] *= inv;
    }
}

/* FN(name) pastes the KV element suffix onto a name: rsgl_decode_layer_f16, ... */
#define FN_PASTE(name, suffix) name##_##suffix
#define FN_EXPAND(name, suffix) FN_PASTE(name, suffix)
#define FN(name) FN_EXPAND(name, KV_SUFFIX)

#endif /* RSGL_COMMON_H */
