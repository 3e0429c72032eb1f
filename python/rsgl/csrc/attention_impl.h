/* Paged decode attention of one request over float32 queries, written once over the KV
   element type (the entry points over the batch are in decode_impl.h). attention.c
   includes this file once per KV cache dtype with these defined:
     KV_T            the element type
     KV_SUFFIX       the instance names' suffix (FN(attend_one) -> attend_one_f16)
     KV_STORE(p,i,x) element i of p = x, rounded to nearest even
     KV_LOAD16(p)    (AVX-512 only) elements p[0:16] as a __m512 of floats
     KV_AVX512       1 to attend with the AVX-512 intrinsics path when the CPU has it
     KV_SCALED       1 for int8: each (slot, kv head) has a float32 scale in ks / vs
                     ([slots, Hkv]); 0: ks and vs are unused (NULL)

   Every function takes the kv heads [j0, j1) it works on (and their query heads j0 G ..
   j1 G - 1, G = H / Hkv; buffers stay indexed by absolute head): a request's heads can be
   split among threads, and each head's arithmetic is the same whichever range it is in. */

/* With KV_SCALED, row h of sc ([H, len]) times the scale kept at each position's slot for
   kv head h / G: a key's scale on its scores before the softmax, a value's on its
   probabilities after it, so the loops over K and V read the stored integers as they are.
   (FN(attend_impl)'s; the AVX-512 path applies the same products as it reads the rows.) */
static inline void FN(scale_scores)(float* sc, const float* scales, const int32_t* slots,
                                    int64_t len, int64_t H, int64_t Hkv, int64_t j0,
                                    int64_t j1) {
#if KV_SCALED
    const int64_t G = H / Hkv;
    int64_t s0 = 0;
#if defined(__AVX512F__)
    /* 16 positions at a time: one gather of their scales per kv head (32-bit offsets: the
       caller keeps the scales below 2^31 elements) */
    for (; s0 + 16 <= len; s0 += 16) {
        const __m512i at = _mm512_mullo_epi32(
            _mm512_loadu_si512(slots + s0), _mm512_set1_epi32((int32_t)Hkv));
        for (int64_t j = j0; j < j1; j++) {
            const __m512 f = _mm512_i32gather_ps(
                _mm512_add_epi32(at, _mm512_set1_epi32((int32_t)j)), scales, 4);
            for (int64_t h = j * G; h < (j + 1) * G; h++) {
                float* row = sc + h * len + s0;
                _mm512_storeu_ps(row, _mm512_mul_ps(_mm512_loadu_ps(row), f));
            }
        }
    }
#endif
    for (int64_t s = s0; s < len; s++) {
        const float* at = scales + (int64_t)slots[s] * Hkv;
        for (int64_t j = j0; j < j1; j++)
            for (int64_t h = j * G; h < (j + 1) * G; h++) sc[h * len + s] *= at[j];
    }
#else
    (void)sc, (void)scales, (void)slots, (void)len, (void)H, (void)Hkv, (void)j0, (void)j1;
#endif
}

/* One kv head's n values x stored at dst (with its scale at *scale when KV_SCALED). */
static inline void FN(store_head)(KV_T* dst, float* scale, const float* x, int64_t n) {
#if KV_SCALED
    i8_store_head(dst, scale, x, n);
#else
    (void)scale;
    for (int64_t i = 0; i < n; i++) KV_STORE(dst, i, x[i]);
#endif
}

/* Attention of one decode query (all H heads, qb) over the request's keys and values, read
   through its req_to_token row: scores for every head from one pass over the K rows, softmax,
   then one pass over the V rows. Query heads jG .. jG + G - 1 read kv head j (G = H / Hkv).
   K/V elements are KV_T, read as floats through FN(widen).
   Always inlined, so callers passing a constant D get fully unrolled inner loops. */
static inline __attribute__((always_inline)) void FN(attend_impl)(
    const float* qb, const KV_T* kb, const KV_T* vb, const float* ks, const float* vs,
    const int32_t* slots, int64_t len,
    int64_t H, int64_t Hkv, int64_t j0, int64_t j1, const int64_t D, float scale, float* sc,
    float* row_tmp, float* ob) {
    const int64_t G = H / Hkv;
    const int64_t row = Hkv * D, first = j0 * D, width = (j1 - j0) * D;
    const int64_t part_bytes = width * (int64_t)sizeof(KV_T);
    for (int64_t s = 0; s < len; s++) {
        if (s + PREFETCH_AHEAD < len)
            prefetch_bytes(kb + (int64_t)slots[s + PREFETCH_AHEAD] * row + first, part_bytes);
        const float* k = FN(widen)(kb + (int64_t)slots[s] * row + first, row_tmp, width);
        for (int64_t j = j0; j < j1; j++) {
            const float* kh = k + (j - j0) * D;
            for (int64_t h = j * G; h < (j + 1) * G; h++) {
                const float* qh = qb + h * D;
                float acc = 0.f;
                #pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < D; d++) acc += qh[d] * kh[d];
                sc[h * len + s] = acc * scale;
            }
        }
    }
    FN(scale_scores)(sc, ks, slots, len, H, Hkv, j0, j1);
    softmax_rows(sc + j0 * G * len, (j1 - j0) * G, len);
    FN(scale_scores)(sc, vs, slots, len, H, Hkv, j0, j1);
    for (int64_t i = j0 * G * D; i < j1 * G * D; i++) ob[i] = 0.f;
    for (int64_t s = 0; s < len; s++) {
        if (s + PREFETCH_AHEAD < len)
            prefetch_bytes(vb + (int64_t)slots[s + PREFETCH_AHEAD] * row + first, part_bytes);
        const float* v = FN(widen)(vb + (int64_t)slots[s] * row + first, row_tmp, width);
        for (int64_t j = j0; j < j1; j++) {
            const float* vh = v + (j - j0) * D;
            for (int64_t h = j * G; h < (j + 1) * G; h++) {
                float* oh = ob + h * D;
                const float p = sc[h * len + s];
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) oh[d] += p * vh[d];
            }
        }
    }
}

#if defined(__AVX512F__)
/* The same attention with AVX-512 intrinsics, for D a multiple of 16 up to 256 (C = D / 16
   vectors per head), used for 16-bit caches (see attend_one). Two things the compiler does
   not do on its own:
   - a score's 16-lane partial sum is parked until 16 positions are done, then one
     transposing reduction (45 shuffles and adds) finishes 16 scores instead of a horizontal
     sum per score;
   - V accumulates in registers: per kv head, up to 16 vectors of its query heads' outputs
     over all positions, so each V element is widened once per group of (up to 4) heads
     that share it.
   K rows are read whole and in order: within a row the hardware prefetcher follows; across
   rows (indirect slots) software prefetch does. */

/* lane t of the result = the sum of the 16 lanes of v[t] */
static inline __m512 FN(sum16)(const __m512* v) {
    __m512 x[4];
    for (int i = 0; i < 4; i++) {
        const __m512* w = v + 4 * i;
        const __m512 a =
            _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
        const __m512 b =
            _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
        /* per 128-bit lane: [w0, w1, w2, w3] partial sums */
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The scores of 16 positions for heads h0 .. h1 - 1, from their parked 16-lane partial sums
   (part: H x 16 vectors): out[h * stride + t] = scale * (the lanes of part[h][t] summed).
   With KV_SCALED, times the keys' scales too, in that order (as FN(scale_scores) would):
   kscl[(h / G - h0 / G) * 16 + t], those 16 positions' scales for head h's kv head. */
static inline void FN(finish16)(const float* part, int64_t h0, int64_t h1, __m512 vscale,
                                const float* kscl, int64_t G, float* out, int64_t stride) {
    for (int64_t h = h0; h < h1; h++) {
        __m512 v[16];
        for (int64_t t = 0; t < 16; t++) v[t] = _mm512_loadu_ps(part + (h * 16 + t) * 16);
        __m512 scores = _mm512_mul_ps(FN(sum16)(v), vscale);
#if KV_SCALED
        scores = _mm512_mul_ps(scores, _mm512_loadu_ps(kscl + (h / G - h0 / G) * 16));
#else
        (void)kscl, (void)G;
#endif
        _mm512_storeu_ps(out + h * stride, scores);
    }
}

/* ob[h0 .. h0 + ng - 1] = the probabilities sc of those heads times V (kv head offset jD).
   The first group of a request prefetches whole V rows, so later groups find them cached.
   With KV_SCALED, each probability is multiplied by its value's scale (vsj[slot * Hkv]: kv
   head j's) as it is read, the product FN(scale_scores) would have stored. */
static inline __attribute__((always_inline)) void FN(v_group)(
    const float* sc, const KV_T* vb, const float* vsj, int64_t Hkv, const int32_t* slots,
    int64_t len, int64_t row, int64_t jD, const int64_t C, const int64_t ng, int64_t h0,
    int prefetch, float* ob) {
    const int64_t row_bytes = row * (int64_t)sizeof(KV_T);
    const int64_t D = 16 * C;
    __m512 acc[64]; /* ng * C <= 16 are used; the bound covers every ng, C pair */
    for (int64_t i = 0; i < ng * C; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < len; s++) {
        if (prefetch && s + PREFETCH_AHEAD < len)
            prefetch_bytes(vb + (int64_t)slots[s + PREFETCH_AHEAD] * row, row_bytes);
        const KV_T* v = vb + (int64_t)slots[s] * row + jD;
        __m512 p[4]; /* ng <= 4 */
#if KV_SCALED
        const float f = vsj[(int64_t)slots[s] * Hkv];
        for (int64_t g = 0; g < ng; g++) p[g] = _mm512_set1_ps(sc[(h0 + g) * len + s] * f);
#else
        (void)vsj, (void)Hkv;
        for (int64_t g = 0; g < ng; g++) p[g] = _mm512_set1_ps(sc[(h0 + g) * len + s]);
#endif
        for (int64_t c = 0; c < C; c++) {
            const __m512 vc = KV_LOAD16(v + 16 * c);
            for (int64_t g = 0; g < ng; g++)
                acc[g * C + c] = _mm512_fmadd_ps(p[g], vc, acc[g * C + c]);
        }
    }
    for (int64_t g = 0; g < ng; g++)
        for (int64_t c = 0; c < C; c++)
            _mm512_storeu_ps(ob + (h0 + g) * D + 16 * c, acc[g * C + c]);
}

/* ob = the probabilities sc ([H, len]) times V (times the values' scales vs with
   KV_SCALED): per kv head, its query heads in groups of up to 4 (and 16 / C), so the group's
   accumulators stay in registers over all positions. */
static inline __attribute__((always_inline)) void FN(v_pass)(
    const float* sc, const KV_T* vb, const float* vs, const int32_t* slots, int64_t len,
    int64_t H, int64_t Hkv, int64_t j0, int64_t j1, const int64_t D, float* ob) {
    const int64_t G = H / Hkv, C = D / 16, row = Hkv * D;
    const int64_t NG = C >= 16 ? 1 : (16 / C < 4 ? 16 / C : 4);
    for (int64_t j = j0; j < j1; j++) {
        for (int64_t g0 = 0; g0 < G; g0 += NG) {
            const int64_t h0 = j * G + g0;
            const int pf = j == j0 && g0 == 0;
            const float* vsj = KV_SCALED ? vs + j : NULL;
#define V_GROUP(ng) FN(v_group)(sc, vb, vsj, Hkv, slots, len, row, j * D, C, ng, h0, pf, ob)
            switch (G - g0 < NG ? G - g0 : NG) {
                case 1: V_GROUP(1); break;
                case 2: V_GROUP(2); break;
                case 3: V_GROUP(3); break;
                default: V_GROUP(4); break;
            }
#undef V_GROUP
        }
    }
}

static inline __attribute__((always_inline)) void FN(attend_avx512_impl)(
    const float* qb, const KV_T* kb, const KV_T* vb, const float* ks, const float* vs,
    const int32_t* slots, int64_t len, int64_t H, int64_t Hkv, int64_t j0, int64_t j1,
    const int64_t D, float scale, float* sc, float* tmp, float* ob) {
    const int64_t G = H / Hkv, C = D / 16, row = Hkv * D, first = j0 * D;
    float* part = tmp + row;  /* H x 16 partial-sum vectors */
    /* With KV_SCALED: the keys' scales of 16 positions, 16 per kv head (in tmp's first
       Hkv * D floats, which this path does not widen rows into), read with the rows.
       FN(scale_scores)' two passes of gathers over the scores took ~15% of an int8
       attention at batch 64 x 1,024 positions on a 2-core Zen 4 (left out to measure);
       applying the scales as the rows are read gives the same products in 1-9% less time. */
    float* kscl = tmp;
    const int64_t part_bytes = (j1 - j0) * D * (int64_t)sizeof(KV_T);
    const __m512 vscale = _mm512_set1_ps(scale);
    /* Whole K rows in order, prefetched PREFETCH_AHEAD rows ahead; each
       score's 16-lane partial sum waits in part (H x 16 vectors) until 16 positions are
       done, then one transposing reduction per head finishes them. */
    int64_t s0 = 0;
    for (; s0 + 16 <= len; s0 += 16) {
        for (int64_t t = 0; t < 16; t++) {
            const int64_t s = s0 + t;
            if (s + PREFETCH_AHEAD < len)
                prefetch_bytes(kb + (int64_t)slots[s + PREFETCH_AHEAD] * row + first,
                               part_bytes);
            const KV_T* k = kb + (int64_t)slots[s] * row;
#if KV_SCALED
            for (int64_t j = j0; j < j1; j++)
                kscl[(j - j0) * 16 + t] = ks[(int64_t)slots[s] * Hkv + j];
#endif
            for (int64_t j = j0; j < j1; j++) {
                /* kv head j widened once, into registers, for its G query heads */
                __m512 kc[16];
                for (int64_t c = 0; c < C; c++) kc[c] = KV_LOAD16(k + j * D + 16 * c);
                for (int64_t h = j * G; h < (j + 1) * G; h++) {
                    const float* qh = qb + h * D;
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), kc[0]);
                    for (int64_t c = 1; c < C; c++)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kc[c], a);
                    _mm512_storeu_ps(part + (h * 16 + t) * 16, a);
                }
            }
        }
        FN(finish16)(part, j0 * G, j1 * G, vscale, kscl, G, sc + s0, len);
    }
    for (int64_t s = s0; s < len; s++) {
        const KV_T* k = kb + (int64_t)slots[s] * row;
        for (int64_t h = j0 * G; h < j1 * G; h++) {
            const KV_T* kh = k + (h / G) * D;
            const float* qh = qb + h * D;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), KV_LOAD16(kh));
            for (int64_t c = 1; c < C; c++)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), KV_LOAD16(kh + 16 * c), a);
            float score = _mm512_reduce_add_ps(a) * scale;
#if KV_SCALED
            score *= ks[(int64_t)slots[s] * Hkv + h / G];
#endif
            sc[h * len + s] = score;
        }
    }
    softmax_rows(sc + j0 * G * len, (j1 - j0) * G, len);
    FN(v_pass)(sc, vb, vs, slots, len, H, Hkv, j0, j1, D, ob);
}
#endif

#if KV_SCALED && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#ifndef RSGL_TRANSPOSE16
#define RSGL_TRANSPOSE16
/* r[t] (16 dwords each) becomes r[d] whose lane t is dword d of the old r[t]. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + m], 128-bit lane k: rows 4g .. 4g + 3 of dword 4k + m */
    __m512i u[16];
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int m = 0; m < 4; m++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], _MM_SHUFFLE(3, 2, 3, 2));
        r[m] = _mm512_shuffle_i32x4(v0, v2, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + m] = _mm512_shuffle_i32x4(v0, v2, _MM_SHUFFLE(3, 1, 3, 1));
        r[8 + m] = _mm512_shuffle_i32x4(v1, v3, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + m] = _mm512_shuffle_i32x4(v1, v3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}
#endif

/* An int8 cache scored through AVX512-VNNI's VPDPBUSD (in each of 16 int32 lanes, the sum
   of 4 unsigned-by-signed byte products), 16 positions at a time, with no key widened to
   floats and no 16-lane sum left to reduce:
   - 16 positions' keys (one 64-byte chunk of a kv head each) are read as k + 128 (sign bit
     flipped: unsigned) and transposed as 16 x 16 dwords, so that vector d holds dims
     4d .. 4d + 3 of every position, lane t position t;
   - the query is rounded to 16-bit integers per head (q16_split: 1 / 65,278 of the head's
     largest value at worst, finer than a bfloat16 query) in two signed bytes, and each
     byte's 4 dims are broadcast: 2 VPDPBUSD per 4 dims give 16 positions' partial dot
     products, for every query head of the kv head (the transpose is shared);
   - a score is (256 x hi's sum + lo's sum - 128 x the query's integers' sum), exact in
     int32 (D <= 128), times the query's scale, `scale` and the key's scale.
   The softmax and the V pass are the float path's. D: 64 or 128.
   Not inlined: an earlier form of it, inlined into attend_one, made GCC 12 leave out every
   software prefetch of attend_one (all 15), and streaming from memory its V pass took 2.5x
   as long. */
static __attribute__((noinline)) void FN(attend_vnni_impl)(
    const float* qb, const KV_T* kb, const KV_T* vb, const float* ks, const float* vs,
    const int32_t* slots, int64_t len, int64_t H, int64_t Hkv, int64_t j0, int64_t j1,
    const int64_t D, float scale, float* sc, float* tmp, float* ob) {
    const int64_t G = H / Hkv, C4 = D / 64, row = Hkv * D, first = j0 * D;
    const int64_t part_bytes = (j1 - j0) * D * (int64_t)sizeof(KV_T);
    (void)tmp;
    /* The query's two bytes per dim (hi, lo: H x D each, read 4 at a time), each head's
       scale times `scale`, and 128 x the sum of its integers. */
    int8_t qhi[H * D], qlo[H * D];
    float qscale[H];
    int32_t qbias[H];
    for (int64_t h = j0 * G; h < j1 * G; h++) {
        qscale[h] = q16_split(qb + h * D, D, qhi + h * D, qlo + h * D) * scale;
        int32_t sum = 0;
        for (int64_t d = 0; d < D; d++) sum += 256 * qhi[h * D + d] + qlo[h * D + d];
        qbias[h] = 128 * sum;
    }
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t s0 = 0; s0 < len; s0 += 16) {
        const int64_t n = len - s0 < 16 ? len - s0 : 16;
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        for (int64_t t = 0; t < n; t++)
            if (s0 + 16 + t < len)
                prefetch_bytes(kb + (int64_t)slots[s0 + 16 + t] * row + first, part_bytes);
        for (int64_t j = j0; j < j1; j++) {
            float kscl[16];
            for (int64_t t = 0; t < n; t++) kscl[t] = ks[(int64_t)slots[s0 + t] * Hkv + j];
            for (int64_t g0 = j * G; g0 < (j + 1) * G; g0 += 4) {
                const int64_t ng = (j + 1) * G - g0 < 4 ? (j + 1) * G - g0 : 4;
                __m512i ah[4], al[4];
                for (int64_t g = 0; g < ng; g++) ah[g] = al[g] = _mm512_setzero_si512();
                for (int64_t c = 0; c < C4; c++) {
                    __m512i kt[16];
                    for (int64_t t = 0; t < 16; t++)
                        kt[t] = t < n ? _mm512_xor_si512(
                                            _mm512_loadu_si512(kb + (int64_t)slots[s0 + t] * row +
                                                               j * D + 64 * c),
                                            flip)
                                      : _mm512_setzero_si512();
                    transpose16_epi32(kt);
                    for (int64_t g = 0; g < ng; g++) {
                        const int8_t* hi = qhi + (g0 + g) * D + 64 * c;
                        const int8_t* lo = qlo + (g0 + g) * D + 64 * c;
                        for (int64_t d = 0; d < 16; d++) {
                            int32_t h4, l4;
                            memcpy(&h4, hi + 4 * d, 4);
                            memcpy(&l4, lo + 4 * d, 4);
                            ah[g] = _mm512_dpbusd_epi32(ah[g], kt[d], _mm512_set1_epi32(h4));
                            al[g] = _mm512_dpbusd_epi32(al[g], kt[d], _mm512_set1_epi32(l4));
                        }
                    }
                }
                const __m512 kv = _mm512_maskz_loadu_ps(valid, kscl);
                for (int64_t g = 0; g < ng; g++) {
                    const int64_t h = g0 + g;
                    const __m512i dot = _mm512_sub_epi32(
                        _mm512_add_epi32(_mm512_slli_epi32(ah[g], 8), al[g]),
                        _mm512_set1_epi32(qbias[h]));
                    __m512 scores = _mm512_mul_ps(_mm512_cvtepi32_ps(dot),
                                                  _mm512_set1_ps(qscale[h]));
                    scores = _mm512_mul_ps(scores, kv);
                    _mm512_mask_storeu_ps(sc + h * len + s0, valid, scores);
                }
            }
        }
    }
    softmax_rows(sc + j0 * G * len, (j1 - j0) * G, len);
    FN(v_pass)(sc, vb, vs, slots, len, H, Hkv, j0, j1, D, ob);
}
#endif

/* sc: len * H scores, tmp: ATTEND_TMP(H, Hkv, D) floats of scratch. */
static void FN(attend_one)(const float* qb, const KV_T* kb, const KV_T* vb,
                           const float* ks, const float* vs, const int32_t* slots,
                           int64_t len, int64_t H, int64_t Hkv, int64_t j0, int64_t j1,
                           int64_t D, float scale, float* sc, float* tmp, float* ob) {
#if KV_SCALED && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (D == 64)
        return FN(attend_vnni_impl)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, 64,
                                    scale, sc, tmp, ob);
    if (D == 128)
        return FN(attend_vnni_impl)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, 128,
                                    scale, sc, tmp, ob);
#endif
#if KV_SCALED
    /* Every other path scores an int8 cache against the same rounded query, in floats
       (its integers times its scale): the same scores, to float rounding, on every CPU. */
    float qr[H * D];
    {
        const int64_t G = H / Hkv;
        int8_t hi[D], lo[D];
        for (int64_t h = j0 * G; h < j1 * G; h++) {
            const float s = q16_split(qb + h * D, D, hi, lo);
            for (int64_t d = 0; d < D; d++) qr[h * D + d] = (float)(256 * hi[d] + lo[d]) * s;
        }
        qb = qr;
    }
#endif
#if defined(__AVX512F__)
    /* Measured per element type (decode at batch 64, ~165 positions): for 16-bit caches the
       intrinsics path is ~20% faster on contiguous rows and equal on scattered ones; for
       float32 the compiler's loops below are ~15% faster on contiguous rows (equal on
       scattered), so float32 stays on them. */
    if (KV_AVX512 && D == 64)
        return FN(attend_avx512_impl)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, 64,
                                      scale, sc, tmp, ob);
    if (KV_AVX512 && D == 128)
        return FN(attend_avx512_impl)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, 128,
                                      scale, sc, tmp, ob);
    if (KV_AVX512 && D % 16 == 0 && D <= 256)
        return FN(attend_avx512_impl)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, D,
                                      scale, sc, tmp, ob);
#endif
    if (D == 64)
        FN(attend_impl)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, 64, scale, sc, tmp, ob);
    else if (D == 128)
        FN(attend_impl)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, 128, scale, sc, tmp, ob);
    else
        FN(attend_impl)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, D, scale, sc, tmp, ob);
}

#if defined(KV_DPBF16) && defined(__AVX512BF16__)
/* bfloat16 queries over a bfloat16 cache, for D a multiple of 32 up to 256: the scores
   through AVX512-BF16's dot product (VDPBF16PS: 32 bfloat16 pairs per instruction, each
   product exact, summed into 16 float32 lanes), so no K row is widened and a score takes
   half the instructions. The query must hold bfloat16 values (it does for bfloat16
   activations: decode_impl rounds it), so packing it is exact and the scores differ from
   the widened path's only in summation order. The softmax and the V pass are the AVX-512
   path's. Measured on one Xeon core (AMX, AVX512-BF16), SmolLM2's shapes (9 query heads,
   3 KV heads, D 64) at batch 64 x 164 positions: see attend_one. */
static inline __attribute__((always_inline)) void FN(attend_dp_impl)(
    const float* qb, const KV_T* kb, const KV_T* vb, const float* ks, const float* vs,
    const int32_t* slots, int64_t len, int64_t H, int64_t Hkv, int64_t j0, int64_t j1,
    const int64_t D, float scale, float* sc, float* tmp, float* ob) {
    const int64_t G = H / Hkv, C2 = D / 32, row = Hkv * D, first = j0 * D;
    const int64_t part_bytes = (j1 - j0) * D * (int64_t)sizeof(KV_T);
    const __m512 vscale = _mm512_set1_ps(scale);
    /* The packed query: H x C2 vectors of 32 bfloat16. tmp holds the parked partial sums
       (H x 16 vectors), as in attend_avx512_impl. */
    __m512bh qv[H * C2];
    float* part = tmp + row;
    for (int64_t h = j0 * G; h < j1 * G; h++)
        for (int64_t c = 0; c < C2; c++) {
            const float* q = qb + h * D + 32 * c;
            qv[h * C2 + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q));
        }
    int64_t s0 = 0;
    for (; s0 + 16 <= len; s0 += 16) {
        for (int64_t t = 0; t < 16; t++) {
            const int64_t s = s0 + t;
            if (s + PREFETCH_AHEAD < len)
                prefetch_bytes(kb + (int64_t)slots[s + PREFETCH_AHEAD] * row + first,
                               part_bytes);
            const KV_T* k = kb + (int64_t)slots[s] * row;
            for (int64_t j = j0; j < j1; j++) {
                __m512bh kc[8];
                for (int64_t c = 0; c < C2; c++)
                    kc[c] = (__m512bh)_mm512_loadu_si512(k + j * D + 32 * c);
                for (int64_t h = j * G; h < (j + 1) * G; h++) {
                    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[h * C2], kc[0]);
                    for (int64_t c = 1; c < C2; c++) a = _mm512_dpbf16_ps(a, qv[h * C2 + c], kc[c]);
                    _mm512_storeu_ps(part + (h * 16 + t) * 16, a);
                }
            }
        }
        FN(finish16)(part, j0 * G, j1 * G, vscale, NULL, G, sc + s0, len);
    }
    for (int64_t s = s0; s < len; s++) {
        const KV_T* k = kb + (int64_t)slots[s] * row;
        for (int64_t h = j0 * G; h < j1 * G; h++) {
            const KV_T* kh = k + (h / G) * D;
            __m512 a = _mm512_setzero_ps();
            for (int64_t c = 0; c < C2; c++)
                a = _mm512_dpbf16_ps(a, qv[h * C2 + c], (__m512bh)_mm512_loadu_si512(kh + 32 * c));
            sc[h * len + s] = _mm512_reduce_add_ps(a) * scale;
        }
    }
    softmax_rows(sc + j0 * G * len, (j1 - j0) * G, len);
    FN(v_pass)(sc, vb, vs, slots, len, H, Hkv, j0, j1, D, ob);
}

/* attend_one for queries that hold bfloat16 values (see attend_dp_impl). */
static void FN(attend_one_q16)(const float* qb, const KV_T* kb, const KV_T* vb,
                               const float* ks, const float* vs, const int32_t* slots,
                               int64_t len, int64_t H, int64_t Hkv, int64_t j0, int64_t j1,
                               int64_t D, float scale, float* sc, float* tmp, float* ob) {
    if (D == 64)
        return FN(attend_dp_impl)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, 64,
                                  scale, sc, tmp, ob);
    if (D == 128)
        return FN(attend_dp_impl)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, 128,
                                  scale, sc, tmp, ob);
    if (D % 32 == 0 && D <= 256)
        return FN(attend_dp_impl)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, D,
                                  scale, sc, tmp, ob);
    FN(attend_one)(qb, kb, vb, ks, vs, slots, len, H, Hkv, j0, j1, D, scale, sc, tmp, ob);
}
#define ATTEND_Q16 FN(attend_one_q16)
#else
#define ATTEND_Q16 FN(attend_one)
#endif
