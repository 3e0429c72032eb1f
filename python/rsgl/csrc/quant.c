/* Projections over low-bit weights: y[M, N] = x[M, K] . W[N, K]^T, each row of W held as
   K / 32 blocks of 32 weights, read as they are stored.

   GGUF's own blocks (`--quantization gguf`), as llama.cpp writes them:
     Q4_0  18 bytes: fp16 d, 16 bytes of nibbles            w = d * (q - 8)
     Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles    w = d * q + m
     Q8_0  34 bytes: fp16 d, 32 int8                        w = d * q
   Weights quantized when a model loads (`--quantization int4 / int8`): the same nibble or
   int8 blocks without headers, and a float32 scale (int4: and minimum) per group of G
   weights of a row, in arrays of their own (G a multiple of 32, G = K per channel; or 16):
     I4    16 bytes of nibbles                              w = s * q + m
     I8    32 int8                                          w = s * q
     I8H   32 int8, a scale per 16 (G = 16: Q6_K, Q3_K)     w = s * q
     I8M   32 int8, with minimums (G = 32: GGUF's Q5_K)     w = s * q + m

   Nibble byte j holds element j (low half) and element j + 16 (high half). Each weight is
   rebuilt in float32 exactly as gguf's dequantize (and so transformers' loader) computes
   it: d * q has at most 19 significant bits, so it is exact in float32, and the one
   rounding is the + m (a fused multiply-add rounds once too; Q4_0's d * (q - 8) is the
   exact d * q - 8d). The model therefore multiplies by the same numbers as the dequantized
   float32 model, reading 4.5-8.5 bits per weight instead of 32; only the summation order
   differs.

   Every row of x is reduced in one fixed order whatever M is (lanes over the blocks, then a
   fixed tree: 32 lanes on AVX-512 and in portable C, 8 on AVX2), so a request's logits do
   not depend on the batch it ran in.

   x and y are float32 (_f32) or bfloat16 (_bf16: x widened to float32 once, y rounded
   once, as a bfloat16 linear with float32 accumulation rounds). */
#include <string.h>

#include "common.h"
#include "gguf_blocks.h"

/* Block k of row n: its quants, scale d and offset m (w = d * q + m; int8 formats but I8M:
   m = 0); d2 scales its weights 16-31 (d, but for I8H). */
typedef struct {
    const uint8_t* q;
    float d, m, d2;
} Block;

/* d * q + m rounded as the AVX2 path rounds it: once, where the CPU fuses multiply-adds
   (the load-time int4 scales make d * q inexact, so the two roundings would differ). */
static inline float mul_add(float d, float q, float m) {
#if defined(__FMA__)
    return __builtin_fmaf(d, q, m);
#else
    return d * q + m;
#endif
}

/* Block k of a weight row: GGUF formats read d and m from the block's header; the
   load-time formats take their group's (gd, gm). With `fmt` a constant (the kernels are
   instantiated per format) the switch folds away. */
static inline __attribute__((always_inline)) Block block_in_row(const int fmt, const uint8_t* row,
                                                                int64_t k, float gd, float gm) {
    const uint8_t* b = row + k * block_bytes(fmt);
    Block out = {b, gd, gm, 0.f};
    switch (fmt) {
        case Q4_0:
            out.d = f16_to_f32(load_u16(b));
            out.m = -8.f * out.d;
            out.q = b + 2;
            break;
        case Q4_1:
            out.d = f16_to_f32(load_u16(b));
            out.m = f16_to_f32(load_u16(b + 2));
            out.q = b + 4;
            break;
        case Q8_0:
            out.d = f16_to_f32(load_u16(b));
            out.m = 0.f;
            out.q = b + 2;
            break;
        default:
            break;
    }
    out.d2 = out.d;
    return out;
}

/* Block k of row n of any matrix (the portable path and row lookups). */
static inline Block block_at(const QMat* a, int64_t n, int64_t k) {
    const uint8_t* row = a->w + n * a->row_bytes;
    if (!load_time(a->fmt)) return block_in_row(a->fmt, row, k, 0.f, 0.f);
    const int64_t g = n * a->groups + k * QK / a->group;
    Block out = block_in_row(a->fmt, row, k, a->scales[g], a->mins ? a->mins[g] : 0.f);
    if (a->fmt == I8H) out.d2 = a->scales[g + 1];
    return out;
}

/* One block's 32 weights as floats (the portable path; the AVX2 path builds the same values
   in registers). */
static inline void dequant_block(int fmt, Block b, float* w) {
    if (int8_quants(fmt)) {
        const int8_t* q = (const int8_t*)b.q;
        for (int i = 0; i < QK; i++)
            w[i] = fmt == I8M ? mul_add(b.d, (float)q[i], b.m)
                              : (i < QK / 2 ? b.d : b.d2) * (float)q[i];
        return;
    }
    for (int i = 0; i < QK / 2; i++) {
        w[i] = mul_add(b.d, (float)(b.q[i] & 15), b.m);
        w[i + 16] = mul_add(b.d, (float)(b.q[i] >> 4), b.m);
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* Block k of row n: its quants, and where its scale d and offset m are (m NULL for the int8
   formats but I8M). GGUF's come from `dm`, the converted headers of the blocks from c0 on;
   the load-time formats' from their arrays, at group g of the row (I8H: d[0] and d[1]). */
static inline __attribute__((always_inline)) const uint8_t* block_parts(
    const int fmt, const QMat* a, int64_t n, int64_t k, int64_t g, int64_t c0, const float* dm,
    const float** d, const float** m) {
    const uint8_t* row = a->w + n * a->row_bytes;
    if (load_time(fmt)) {
        g += n * a->groups;
        *d = a->scales + g;
        *m = a->mins ? a->mins + g : NULL;
        return row + k * block_bytes(fmt);
    }
    *d = dm + 2 * (k - c0);
    *m = *d + 1;
    return row + k * block_bytes(fmt) + (fmt == Q4_1 ? 4 : 2);
}

#endif

#if defined(__AVX512F__)
/* One block's 32 weights in two registers: elements 0-15 and 16-31, each rounded as the
   AVX2 path below rounds it (the same multiply or fused multiply-add per element). `d` and
   `m` point at the block's scale and offset as float32: broadcast straight from memory,
   they cost no shuffle. */
static inline void dequant_block16(int fmt, const uint8_t* q, const float* d, const float* m,
                                   __m512* w) {
    if (int8_quants(fmt)) {
        const __m512 s = _mm512_set1_ps(*d), s2 = _mm512_set1_ps(d[fmt == I8H]);
        const __m128i q0 = _mm_loadu_si128((const __m128i*)q);
        const __m128i q1 = _mm_loadu_si128((const __m128i*)(q + 16));
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1));
        if (fmt == I8M) {
            const __m512 o = _mm512_set1_ps(*m);
            w[0] = _mm512_fmadd_ps(f0, s, o);
            w[1] = _mm512_fmadd_ps(f1, s, o);
        } else {
            w[0] = _mm512_mul_ps(s, f0);
            w[1] = _mm512_mul_ps(s2, f1);
        }
        return;
    }
    /* The block's 16 possible weights, d * j + m for j = 0..15, looked up by nibble: a
       permute reads only its index's low 4 bits, so the widened bytes index their low
       halves as they are, and shifted by 4 their high halves. d * j is exact (at most 15
       significant bits), so each entry is rounded once, as d * q + m is above; Q4_0's
       d * (j - 8) is exact. Two permutes and one multiply-add replace four conversions and
       two multiply-adds: the conversions and the scale broadcasts shared one port, which
       the loop waited on (with the headers below, a batch-1 projection's block went from
       6.3 to 4.5 cycles on one thread; the same bits). */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table =
        fmt == Q4_0 ? _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.f)), _mm512_set1_ps(*d))
                    : _mm512_fmadd_ps(iota, _mm512_set1_ps(*d), _mm512_set1_ps(*m));
    const __m512i nib = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
    w[0] = _mm512_permutexvar_ps(nib, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(nib, 4), table);
}

/* The sum of four accumulators' 32 lanes in a fixed tree: (a + b) + (c + d) lane by lane,
   then the halves, pairs and neighbours. */
static inline float hsum8(__m256 a, __m256 b, __m256 c, __m256 d) {
    /* Pinned as hsum_lanes pins its sums. */
    __m256 ab = _mm256_add_ps(a, b), cd = _mm256_add_ps(c, d);
    __asm__("" : "+x"(ab), "+x"(cd));
    return hsum_lanes(_mm256_add_ps(ab, cd));
}

/* hsum8 of four accumulators of eight lanes, here the halves of lo (elements 0-15) and hi
   (16-31). -ffast-math lets the compiler fuse and reassociate each inlined copy its own
   way, so one order per row is checked, not promised; see dot_xtile. (The portable path
   gets the same bits for the int8 formats; the AVX2 path sums in an order of its own.) */
static inline float hsum16(__m512 lo, __m512 hi) {
    const __m256 a = _mm512_castps512_ps256(lo);
    const __m256 b = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lo), 1));
    const __m256 c = _mm512_castps512_ps256(hi);
    const __m256 d = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(hi), 1));
    return hsum8(a, b, c, d);
}

/* One row of x times weight rows n and n + 1, into y[n] and y[n + 1]: each product in 32
   lanes over the blocks, then hsum16. The two weight rows share the loop so that one row of
   x has four independent sums: each sum adds once per block, and one sum alone waits on the
   multiply-add's latency (a batch-1 projection ran 1.2x faster on one thread, SmolLM2's
   K = 1536). */
static inline __attribute__((always_inline)) void dot_pair(const int fmt, const QMat* a,
                                                           int64_t n, int64_t nb,
                                                           const float* x, float* y) {
    const int gguf = !load_time(fmt);
    const int64_t per = blocks_per_scale(fmt, a);
    int64_t g = 0, next = per; /* block k's group in the row, and where the next starts */
    __m512 a0 = _mm512_setzero_ps(), a1 = a0; /* row n */
    __m512 e0 = a0, e1 = a0;                  /* row n + 1 */
    float dm[2 * HEADER_CHUNK + 16], dm2[2 * HEADER_CHUNK + 16];
    for (int64_t c0 = 0; c0 < nb; c0 += HEADER_CHUNK) {
        const int64_t c1 = c0 + HEADER_CHUNK < nb ? c0 + HEADER_CHUNK : nb;
        if (gguf) gguf_headers(fmt, a->w + n * a->row_bytes, c0, c1 - c0, dm);
        if (gguf) gguf_headers(fmt, a->w + (n + 1) * a->row_bytes, c0, c1 - c0, dm2);
        for (int64_t k = c0; k < c1; k++) {
            if (k == next) g += scales_per_block(fmt), next += per;
            const float *d, *m;
            __m512 w[2];
            const uint8_t* q = block_parts(fmt, a, n, k, g, c0, dm, &d, &m);
            dequant_block16(fmt, q, d, m, w);
            const float* p = x + k * QK;
            const __m512 p0 = _mm512_loadu_ps(p), p1 = _mm512_loadu_ps(p + 16);
            a0 = _mm512_fmadd_ps(w[0], p0, a0);
            a1 = _mm512_fmadd_ps(w[1], p1, a1);
            q = block_parts(fmt, a, n + 1, k, g, c0, dm2, &d, &m);
            dequant_block16(fmt, q, d, m, w);
            e0 = _mm512_fmadd_ps(w[0], p0, e0);
            e1 = _mm512_fmadd_ps(w[1], p1, e1);
        }
    }
    y[n] = hsum16(a0, a1);
    y[n + 1] = hsum16(e0, e1);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The AVX2 path's lanes for the nibble formats. A block's 16 bytes go to the low half of a
   register and, shifted right by 4 in each 32-bit word, to its high half; after a mask of
   each byte's low nibble, register r takes byte r of each word (one byte shuffle), so its
   lanes 0-3 hold the low nibbles of bytes r, 4 + r, 8 + r, 12 + r and lanes 4-7 their high
   nibbles. Register r therefore holds the elements e with e % 4 == r, in increasing order
   (r, 4 + r, ..., 28 + r), and the kernels read x in that order: each call first copies its
   rows of x into it (interleave_x). Widening byte shuffles (four a block, on the one port
   that also broadcasts) bounded a batch-1 step's projections on AMD Zen 3, and so did the
   variable shifts that replaced them (two cycles each there); the immediate shift and the
   in-lane shuffles here cost a third less again, for the same weights. */

/* The shuffle that widens byte r of each 32-bit word to the word (the others zeroed). */
static inline __m256i byte_of_words(int r) {
    return _mm256_setr_epi32(0x80808000 | r, 0x80808004 | r, 0x80808008 | r, 0x8080800c | r,
                             0x80808000 | r, 0x80808004 | r, 0x80808008 | r, 0x8080800c | r);
}

/* One block's 32 weights in four registers (the int8 formats: elements 0-7, 8-15, 16-23,
   24-31; the nibble formats: in the order above), each rounded as the portable path rounds
   it. `d` and `m` point at the block's scale and offset as float32 (m NULL for the int8
   formats but I8M; Q4_0's offset is the exact -8d). */
static inline __attribute__((always_inline)) void dequant_block8(int fmt, const uint8_t* q,
                                                                 const float* d,
                                                                 const float* m, __m256* w) {
    const __m256 s = _mm256_broadcast_ss(d);
    if (int8_quants(fmt)) {
        const __m256 s2 = fmt == I8H ? _mm256_broadcast_ss(d + 1) : s;
        for (int i = 0; i < 4; i++) {
            const __m128i b = _mm_loadl_epi64((const __m128i*)(q + 8 * i));
            const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            w[i] = fmt == I8M ? _mm256_fmadd_ps(f, s, _mm256_broadcast_ss(m))
                              : _mm256_mul_ps(i < 2 ? s : s2, f);
        }
        return;
    }
    const __m256 o =
        fmt == Q4_0 ? _mm256_mul_ps(s, _mm256_set1_ps(-8.f)) : _mm256_broadcast_ss(m);
    const __m128i lo = _mm_loadu_si128((const __m128i*)q);
    const __m256i both = _mm256_and_si256(
        _mm256_inserti128_si256(_mm256_castsi128_si256(lo), _mm_srli_epi32(lo, 4), 1),
        _mm256_set1_epi8(15));
    for (int r = 0; r < 4; r++) {
        const __m256i j = _mm256_shuffle_epi8(both, byte_of_words(r));
        w[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(j), s, o);
    }
}

/* x's rows in the nibble formats' order: out[k * 32 + 8r + j] = x[k * 32 + 4j + r]. */
static void interleave_x(const float* x, int64_t n, float* out) {
    for (int64_t b = 0; b < n; b += QK)
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 8; j++) out[b + 8 * r + j] = x[b + 4 * j + r];
}

/* The n values of x in the order the kernels read them for weights of format fmt: a new
   buffer (the caller frees it) for the nibble formats, NULL where x serves as it is. */
static float* nibble_order(int fmt, const float* x, int64_t n) {
    if (int8_quants(fmt)) return NULL;
    float* out = (float*)malloc((size_t)n * sizeof(float));
    if (!out) abort();
    interleave_x(x, n, out);
    return out;
}

/* Rows x[0 .. R) of x times weight rows n .. n + W - 1 (R * W <= 8, constants in each
   inlined copy: tile_weight_rows), into y[r * N + n + i]. Each block is rebuilt once for
   the tile, and each (row, weight row) product is summed in one register of its own, a
   block's four registers of weights in turn, then by hsum_lanes: one order whatever the
   tile, so a row gets the same bits in any batch. (Four registers a product, as the AVX-512
   kernels keep two, left room for two of them: a tile of 8 rows rebuilt each weight four
   times, and past 4 rows the rebuilds bounded the step.) */
static inline __attribute__((always_inline)) void dot_tile(const int fmt, const QMat* a,
                                                           int64_t n, int64_t nb,
                                                           const float* x, int64_t K,
                                                           const int R, const int W, float* y,
                                                           int64_t N) {
    const int gguf = !load_time(fmt);
    const int64_t per = blocks_per_scale(fmt, a);
    int64_t g = 0, next = per; /* block k's group in the row, and where the next starts */
    __m256 acc[8];             /* (weight row i, row r)'s sums at [i * R + r] */
    for (int t = 0; t < R * W; t++) acc[t] = _mm256_setzero_ps();
    float dm[4][2 * HEADER_CHUNK + 16];
    for (int64_t c0 = 0; c0 < nb; c0 += HEADER_CHUNK) {
        const int64_t c1 = c0 + HEADER_CHUNK < nb ? c0 + HEADER_CHUNK : nb;
        for (int i = 0; gguf && i < W; i++)
            gguf_headers(fmt, a->w + (n + i) * a->row_bytes, c0, c1 - c0, dm[i]);
        for (int64_t k = c0; k < c1; k++) {
            if (k == next) g += scales_per_block(fmt), next += per;
            for (int i = 0; i < W; i++) {
                const float *d, *m;
                __m256 w[4];
                const uint8_t* q = block_parts(fmt, a, n + i, k, g, c0, dm[i], &d, &m);
                dequant_block8(fmt, q, d, m, w);
                for (int j = 0; j < 4; j++)
                    for (int r = 0; r < R; r++)
                        acc[i * R + r] = _mm256_fmadd_ps(
                            w[j], _mm256_loadu_ps(x + r * K + k * QK + 8 * j), acc[i * R + r]);
            }
        }
    }
    for (int i = 0; i < W; i++)
        for (int r = 0; r < R; r++) y[r * N + n + i] = hsum_lanes(acc[i * R + r]);
}

/* One instance per tile shape: rows r .. r + R of x against weight rows n .. n + W - 1. */
static inline __attribute__((always_inline)) void tile_rows(const int fmt, const QMat* a,
                                                            int64_t n, const float* x,
                                                            int64_t K, int64_t R, int64_t W,
                                                            float* y, int64_t N) {
#define F32_TILE(r, c) dot_tile(fmt, a, n, K / QK, x, K, r, c, y, N)
    TILE_SHAPES(R, W, F32_TILE);
#undef F32_TILE
}
#else
/* The AVX-512 path's lanes for the int8 formats and its tree, in plain C for whatever the
   compiler targets. */
static inline float hsum32(const float* acc) {
    float s[8], h[4];
    for (int i = 0; i < 8; i++) s[i] = (acc[i] + acc[8 + i]) + (acc[16 + i] + acc[24 + i]);
    for (int i = 0; i < 4; i++) h[i] = s[i] + s[4 + i];
    return (h[0] + h[2]) + (h[1] + h[3]);
}

static inline void dot_rows(const int fmt, const QMat* a, int64_t n, int64_t nb,
                            const float* x0, const float* x1, float* y0, float* y1) {
    float acc0[QK] = {0}, acc1[QK] = {0}, w[QK];
    for (int64_t k = 0; k < nb; k++) {
        dequant_block(fmt, block_at(a, n, k), w);
        const float* p = x0 + k * QK;
        for (int i = 0; i < QK; i++) acc0[i] += w[i] * p[i];
        if (x1) {
            const float* r = x1 + k * QK;
            for (int i = 0; i < QK; i++) acc1[i] += w[i] * r[i];
        }
    }
    *y0 = hsum32(acc0);
    if (x1) *y1 = hsum32(acc1);
}
#endif

#if defined(__AVX512F__)
/* Rows of x that share one rebuild of a weight row's blocks (AVX-512). */
#define X_TILE 8

/* Rows x[0 .. R) of x (R <= X_TILE, a constant in each inlined copy) times weight row n, into
   y[r * N + n]: each block is rebuilt once for all R rows, and each row's product is summed
   in the lanes and order of dot_pair (a sum of its own per half block, then hsum16), so a row
   gets the same bits in every tile (-ffast-math would let each inlined copy reassociate its
   own way; the sums are chains of fused multiply-adds, which it leaves alone, and
   tests/model/test_quant_linear.py checks every tile height against rows alone). With two
   rows sharing a rebuild, a projection of 8 rows rebuilt each weight 4 times; most of the
   work was the rebuild, and 8 rows of a decode step (or a short prompt's prefill) went to
   the dense copy instead. */
static inline __attribute__((always_inline)) void dot_xtile(const int fmt, const QMat* a,
                                                            int64_t n, int64_t nb,
                                                            const float* x, int64_t K,
                                                            const int R, float* y, int64_t N) {
    const int gguf = !load_time(fmt);
    const int64_t per = blocks_per_scale(fmt, a);
    int64_t g = 0, next = per; /* block k's group in the row, and where the next starts */
    __m512 lo[X_TILE], hi[X_TILE];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    float dm[2 * HEADER_CHUNK + 16];
    for (int64_t c0 = 0; c0 < nb; c0 += HEADER_CHUNK) {
        const int64_t c1 = c0 + HEADER_CHUNK < nb ? c0 + HEADER_CHUNK : nb;
        if (gguf) gguf_headers(fmt, a->w + n * a->row_bytes, c0, c1 - c0, dm);
        for (int64_t k = c0; k < c1; k++) {
            if (k == next) g += scales_per_block(fmt), next += per;
            const float *d, *m;
            __m512 w[2];
            const uint8_t* q = block_parts(fmt, a, n, k, g, c0, dm, &d, &m);
            dequant_block16(fmt, q, d, m, w);
            for (int r = 0; r < R; r++) {
                const float* p = x + r * K + k * QK;
                lo[r] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(p), lo[r]);
                hi[r] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(p + 16), hi[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) y[r * N + n] = hsum16(lo[r], hi[r]);
}

/* dot_xtile with R known: one instance per tile height. */
static inline __attribute__((always_inline)) void xtile(const int fmt, const QMat* a, int64_t n,
                                                        int64_t nb, const float* x, int64_t K,
                                                        int64_t R, float* y, int64_t N) {
    switch (R) {
        case 1: dot_xtile(fmt, a, n, nb, x, K, 1, y, N); break;
        case 2: dot_xtile(fmt, a, n, nb, x, K, 2, y, N); break;
        case 3: dot_xtile(fmt, a, n, nb, x, K, 3, y, N); break;
        case 4: dot_xtile(fmt, a, n, nb, x, K, 4, y, N); break;
        case 5: dot_xtile(fmt, a, n, nb, x, K, 5, y, N); break;
        case 6: dot_xtile(fmt, a, n, nb, x, K, 6, y, N); break;
        case 7: dot_xtile(fmt, a, n, nb, x, K, 7, y, N); break;
        default: dot_xtile(fmt, a, n, nb, x, K, 8, y, N); break;
    }
}

/* y[M, N] = x[M, K] . W^T over float32 rows; K a multiple of 32. Columns of y are split over
   threads two at a time; each thread walks its pair of weight rows once per tile of X_TILE
   rows of x (the pair stays in L1 between tiles, so memory sees each block once per call). */
static inline __attribute__((always_inline)) void row_tiles(const int fmt, const QMat* a,
                                                            int64_t n, const float* x,
                                                            int64_t M, int64_t K, int64_t N,
                                                            float* y) {
    /* Weight rows are short (360 bytes for a Q4_1 row of 576) and a decode step streams
       them from memory: asking for the rows 8 ahead took a batch-1 step's projections from
       12.3 to 6.7 ms (SmolLM2, Sapphire Rapids, 2 threads; 4, 8 and 16 rows measure alike).
       Past the matrix's end the hint reads nothing: prefetches never fault. */
    prefetch_bytes(a->w + (n + 8) * a->row_bytes, 2 * a->row_bytes);
    const int both = n + 1 < N;
    for (int64_t r = 0; r < M; r += X_TILE) {
        const int64_t R = M - r < X_TILE ? M - r : X_TILE;
        if (R == 1 && both) {
            /* One row of x takes the two weight rows together: four sums in flight. */
            dot_pair(fmt, a, n, K / QK, x + r * K, y + r * N);
            continue;
        }
        for (int64_t i = 0; i <= both; i++)
            xtile(fmt, a, n + i, K / QK, x + r * K, K, R, y + r * N, N);
    }
}
#elif !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
/* y[M, N] = x[M, K] . W^T over float32 rows; K a multiple of 32. Columns of y are split over
   threads two at a time; each thread walks its pair of weight rows once per pair of x rows
   (the pair stays in L1 between x pairs, so memory sees each block once per call). */
static inline __attribute__((always_inline)) void row_tiles(const int fmt, const QMat* a,
                                                            int64_t n, const float* x,
                                                            int64_t M, int64_t K, int64_t N,
                                                            float* y) {
    /* Weight rows are short and a decode step streams them from memory: ask for the rows 8
       ahead (see the AVX-512 row_tiles). */
    prefetch_bytes(a->w + (n + 8) * a->row_bytes, 2 * a->row_bytes);
    const int both = n + 1 < N;
    for (int64_t r = 0; r < M; r += 2) {
        const int two = r + 1 < M;
        for (int64_t i = 0; i <= both; i++)
            dot_rows(fmt, a, n + i, K / QK, x + r * K, two ? x + (r + 1) * K : NULL,
                     y + r * N + n + i, two ? y + (r + 1) * N + n + i : NULL);
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* y[M, N] = x[M, K] . W^T over float32 rows; K a multiple of 32. x's rows go in tiles of
   equal height, up to X_ROWS (9 rows: 5 and 4, not 8 and a lone row that pays for a whole
   rebuild of the weights); columns of y are split over threads a few weight rows at a time,
   and each thread walks its weight rows once per tile (they stay in L1 between tiles, so
   memory sees each block once per call). */
static void qlinear_f32(const QMat* a, const float* x, int64_t M, int64_t K, int64_t N,
                        float* y, int threads) {
    if (M <= 0) return;
    float* interleaved = nibble_order(a->fmt, x, M * K);
    if (interleaved) x = interleaved;
    const int64_t height = tile_height(M), step = tile_weight_rows(height);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N * M * K >= 65536)
    for (int64_t n = 0; n < N; n += step) {
        /* Weight rows are short and a decode step streams them from memory: ask for the
           rows 8 ahead (see the AVX-512 row_tiles). */
        prefetch_bytes(a->w + (n + 8) * a->row_bytes, step * a->row_bytes);
        const int64_t end = n + step < N ? n + step : N;
        for (int64_t r = 0; r < M; r += height) {
            const int64_t R = M - r < height ? M - r : height;
            for (int64_t j = n, W; j < end; j += W) {
                W = end - j < tile_weight_rows(R) ? end - j : tile_weight_rows(R);
                const float* xr = x + r * K;
                float* yr = y + r * N;
                /* One instance per format, so each inner loop knows its block layout. */
                switch (a->fmt) {
                    case Q4_0: tile_rows(Q4_0, a, j, xr, K, R, W, yr, N); break;
                    case Q4_1: tile_rows(Q4_1, a, j, xr, K, R, W, yr, N); break;
                    case Q8_0: tile_rows(Q8_0, a, j, xr, K, R, W, yr, N); break;
                    case I4: tile_rows(I4, a, j, xr, K, R, W, yr, N); break;
                    case I8: tile_rows(I8, a, j, xr, K, R, W, yr, N); break;
                    case I8M: tile_rows(I8M, a, j, xr, K, R, W, yr, N); break;
                    default: tile_rows(I8H, a, j, xr, K, R, W, yr, N); break;
                }
            }
        }
    }
    free(interleaved);
}
#else
static void qlinear_f32(const QMat* a, const float* x, int64_t M, int64_t K, int64_t N,
                        float* y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N * M * K >= 65536)
    for (int64_t n = 0; n < N; n += 2) {
        /* One instance per format, so each inner loop knows its block layout. */
        switch (a->fmt) {
            case Q4_0: row_tiles(Q4_0, a, n, x, M, K, N, y); break;
            case Q4_1: row_tiles(Q4_1, a, n, x, M, K, N, y); break;
            case Q8_0: row_tiles(Q8_0, a, n, x, M, K, N, y); break;
            case I4: row_tiles(I4, a, n, x, M, K, N, y); break;
            case I8: row_tiles(I8, a, n, x, M, K, N, y); break;
            case I8M: row_tiles(I8M, a, n, x, M, K, N, y); break;
            default: row_tiles(I8H, a, n, x, M, K, N, y); break;
        }
    }
}
#endif

static void qlinear_bf16(const QMat* a, const uint16_t* x, int64_t M, int64_t K, int64_t N,
                         uint16_t* y, int threads) {
    float* xf = (float*)malloc((size_t)(M * K + M * N) * sizeof(float));
    if (!xf) abort();
    float* yf = xf + M * K;
    widen_bf16(x, xf, M * K);
    qlinear_f32(a, xf, M, K, N, yf, threads);
    for (int64_t i = 0; i < M * N; i++) bf16_store(y, i, yf[i]);
    free(xf);
}

/* Rows `ids` of W as floats into out[n, K]: an embedding lookup, or a check of the blocks. */
static void dequant_rows(const QMat* a, int64_t K, const int64_t* ids, int64_t n, float* out) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t k = 0; k < K / QK; k++)
            dequant_block(a->fmt, block_at(a, ids[i], k), out + i * K + k * QK);
}

#define GGUF_FORMAT(name, fmt)                                                               \
    void rsgl_qlinear_##name##_f32(const float* x, int64_t M, int64_t K, const uint8_t* w,   \
                                   int64_t N, float* y, int threads) {                       \
        const QMat a = gguf_mat(fmt, w, K);                                                  \
        qlinear_f32(&a, x, M, K, N, y, threads);                                             \
    }                                                                                        \
    void rsgl_qlinear_##name##_bf16(const uint16_t* x, int64_t M, int64_t K,                 \
                                    const uint8_t* w, int64_t N, uint16_t* y, int threads) { \
        const QMat a = gguf_mat(fmt, w, K);                                                  \
        qlinear_bf16(&a, x, M, K, N, y, threads);                                            \
    }                                                                                        \
    void rsgl_dequant_rows_##name(const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, \
                                  float* out) {                                              \
        const QMat a = gguf_mat(fmt, w, K);                                                  \
        dequant_rows(&a, K, ids, n, out);                                                    \
    }

GGUF_FORMAT(q4_0, Q4_0)
GGUF_FORMAT(q4_1, Q4_1)
GGUF_FORMAT(q8_0, Q8_0)

void rsgl_qlinear_group_f32(int bits, const float* x, int64_t M, int64_t K, const uint8_t* w,
                            const float* scales, const float* mins, int64_t group, int64_t N,
                            float* y, int threads) {
    const QMat a = group_mat(bits, w, scales, mins, K, group);
    qlinear_f32(&a, x, M, K, N, y, threads);
}

void rsgl_qlinear_group_bf16(int bits, const uint16_t* x, int64_t M, int64_t K,
                             const uint8_t* w, const float* scales, const float* mins,
                             int64_t group, int64_t N, uint16_t* y, int threads) {
    const QMat a = group_mat(bits, w, scales, mins, K, group);
    qlinear_bf16(&a, x, M, K, N, y, threads);
}

void rsgl_dequant_rows_group(int bits, const uint8_t* w, const float* scales, const float* mins,
                             int64_t K, int64_t group, const int64_t* ids, int64_t n,
                             float* out) {
    const QMat a = group_mat(bits, w, scales, mins, K, group);
    dequant_rows(&a, K, ids, n, out);
}
