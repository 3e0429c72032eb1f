/* GGUF's weight blocks as the projection kernels read them (quant.c, quant_a8.c): the
   formats, their sizes, and their fp16 headers converted to float32. */
#ifndef RSGL_GGUF_BLOCKS_H
#define RSGL_GGUF_BLOCKS_H
#include <string.h>

#include "common.h"

#define QK 32

/* ggml's type numbers for GGUF's formats; the load-time formats after them (I8H: int8 with
   a scale per 16 weights, two a block, as GGUF's Q6_K and Q3_K hold them; I8M: int8 with a
   scale and a minimum per 32, as GGUF's Q5_K holds them). */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, I4 = 100, I8 = 101, I8H = 102, I8M = 103 };

/* Whether `fmt` is a load-time format: its scales (and minimums) are arrays of their own. */
static inline int load_time(int fmt) { return fmt >= I4; }

/* Whether `fmt` holds a byte (int8) per weight rather than a nibble. */
static inline int int8_quants(int fmt) {
    return fmt == Q8_0 || fmt == I8 || fmt == I8H || fmt == I8M;
}

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

static inline int64_t block_bytes(int fmt) {
    switch (fmt) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q8_0: return 34;
        case I4: return 16;
        default: return 32; /* I8, I8H, I8M */
    }
}

/* A weight matrix: `w` holds N rows of `row_bytes`; the load-time formats add a scale (and
   a minimum) per group of `group` weights, `groups` per row. */
typedef struct {
    int fmt;
    const uint8_t* w;
    int64_t row_bytes;
    const float* scales;
    const float* mins;
    int64_t group;
    int64_t groups;
} QMat;

/* A load-time format's blocks per scale (a scale per 32 * per weights: group / 32), and the
   scales a block steps over (two for I8H's groups of 16). */
static inline int64_t blocks_per_scale(int fmt, const QMat* a) {
    return !load_time(fmt) || fmt == I8H ? 1 : a->group / QK;
}
static inline int64_t scales_per_block(int fmt) { return fmt == I8H ? 2 : 1; }

/* A GGUF format's matrix of K columns. */
static inline QMat gguf_mat(int fmt, const uint8_t* w, int64_t K) {
    const QMat a = {fmt, w, K / QK * block_bytes(fmt), NULL, NULL, K, 1};
    return a;
}

/* The load-time formats: `bits` 4 (I4, with mins) or 8 (I8; I8H for groups of 16; I8M with
   mins); `group` weights per scale. */
static inline QMat group_mat(int bits, const uint8_t* w, const float* scales,
                             const float* mins, int64_t K, int64_t group) {
    const int fmt = bits == 4 ? I4 : mins ? I8M : group == QK / 2 ? I8H : I8;
    const QMat a = {fmt, w, K / QK * block_bytes(fmt), scales, mins, group, K / group};
    return a;
}

/* The kernels' tiles (quant.c's AVX2 float32 rows, quant_a8.c's int8 rows over load-time
   groups; the interleaved GGUF blocks take X8_ROWS at a time instead): rows of x in
   tiles of equal height, up to X_ROWS (9 rows: 5 and 4, not 8 and a lone row that pays for a
   whole pass over the weights), each against a few weight rows at a time: a lone row of x
   four (more loads of x shared, fewer row setups), up to 4 rows two, taller tiles one (8
   sums a tile). */
#define X_ROWS 8
static inline int64_t tile_height(int64_t M) {
    const int64_t tiles = (M + X_ROWS - 1) / X_ROWS;
    return (M + tiles - 1) / tiles;
}
static inline int64_t tile_weight_rows(int64_t R) { return R == 1 ? 4 : R <= 4 ? 2 : 1; }

/* A switch that calls TILE(r, w), a macro of two constants, for each tile shape (R, W). */
#define TILE_SHAPES(R, W, TILE)                                 \
    do {                                                        \
        if ((R) == 1) {                                         \
            switch (W) {                                        \
                case 1: TILE(1, 1); break;                      \
                case 2: TILE(1, 2); break;                      \
                case 3: TILE(1, 3); break;                      \
                default: TILE(1, 4); break;                     \
            }                                                   \
            break;                                              \
        }                                                       \
        switch (R) {                                            \
            case 2: (W) == 1 ? TILE(2, 1) : TILE(2, 2); break;  \
            case 3: (W) == 1 ? TILE(3, 1) : TILE(3, 2); break;  \
            case 4: (W) == 1 ? TILE(4, 1) : TILE(4, 2); break;  \
            case 5: TILE(5, 1); break;                          \
            case 6: TILE(6, 1); break;                          \
            case 7: TILE(7, 1); break;                          \
            default: TILE(8, 1); break;                         \
        }                                                       \
    } while (0)

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The sum of v's 8 lanes in a fixed tree: the halves, pairs and neighbours. -ffast-math
   lets the compiler reassociate these adds, and each inlined copy its own way (one AVX2
   tile summed a row otherwise than the next did): the empty asm pins each partial sum,
   which costs nothing. */
static inline float hsum_lanes(__m256 v) {
    __asm__("" : "+x"(v));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __asm__("" : "+x"(h));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    __asm__("" : "+x"(h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* GGUF block headers are read this many blocks of a row at a time. */
#define HEADER_CHUNK 64

/* The headers of blocks b, b + 1, .. (up to four; the rest 0) as (d, m) float32 pairs, m = 0
   where the format has none. Each header is one 32-bit word (d in its low half, Q4_1's m in
   its high half). Four whole blocks: four 16-byte loads, each placing its block's word in
   its own lane, blended into one register (no scalar load, no move from a general
   register: moving four words in one at a time, `vmovd` and three `vpinsrd`, took a third
   of a batch-1 projection's time on a Zen 3). Fewer, at a row's end: one word at a time,
   never reading past the last block (stored to memory and read back as a vector, every
   conversion waited on a failed store forward). */
static inline __m256 header_pairs(const int fmt, const uint8_t* b, int64_t count) {
    const int64_t bb = block_bytes(fmt);
    __m128i h;
    if (count >= 4) {
        /* Block i's word at byte 4i of the load at b + i * bb - 4i, inside the four blocks
           (4 * bb >= 64 bytes). */
        const __m128i w0 = _mm_loadu_si128((const __m128i*)b);
        const __m128i w1 = _mm_loadu_si128((const __m128i*)(b + bb - 4));
        const __m128i w2 = _mm_loadu_si128((const __m128i*)(b + 2 * bb - 8));
        const __m128i w3 = _mm_loadu_si128((const __m128i*)(b + 3 * bb - 12));
        h = _mm_blend_epi32(_mm_blend_epi32(w0, w1, 2), _mm_blend_epi32(w2, w3, 8), 12);
        if (fmt != Q4_1) h = _mm_and_si128(h, _mm_set1_epi32(0xffff));
    } else {
        uint32_t v[4] = {0, 0, 0, 0};
        for (int64_t i = 0; i < count; i++) {
            if (fmt == Q4_1) memcpy(&v[i], b + i * bb, sizeof v[i]);
            else v[i] = load_u16(b + i * bb);
        }
        h = _mm_setr_epi32((int)v[0], (int)v[1], (int)v[2], (int)v[3]);
    }
    return _mm256_cvtph_ps(h);
}

/* The fp16 scale (and Q4_1's offset) of blocks k0 .. k0 + n - 1 of a GGUF row, as float32
   pairs dm[2i] = d, dm[2i + 1] = m (0 where the format has none; written up to a multiple
   of four blocks): four conversions per instruction instead of one per value in the block
   loop, and each block's d and m then broadcast straight from memory. */
static inline void gguf_headers(const int fmt, const uint8_t* row, int64_t k0, int64_t n,
                                float* dm) {
    const uint8_t* b = row + k0 * block_bytes(fmt);
    for (int64_t i = 0; i < n; i += 4)
        _mm256_storeu_ps(dm + 2 * i, header_pairs(fmt, b + i * block_bytes(fmt), n - i));
}

#endif
#endif
