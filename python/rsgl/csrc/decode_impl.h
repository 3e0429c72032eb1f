/* The decode entry points over a batch (attention alone, and the fused decode layer step),
   written once over the activation (model) dtype and the KV element type. attention.c
   includes this file after each attention_impl.h instance (KV_* still defined), once per
   activation dtype, with ACT_BF16 defined: 1 for bfloat16 q/qkv/out rows, 0 for float32.
   Names carry both: rsgl_decode_layer_bf16_f16 takes bfloat16 rows over a float16 cache.
   Attention itself runs on float32 queries (FN(attend_one)); bfloat16 rows are widened on
   the way in and rounded to nearest even on the way out. Their queries hold bfloat16
   values, which ATTEND_Q16 (attention_impl.h) may use for the scores. */
#if ACT_BF16
#define ATTEND ATTEND_Q16
#define ACT_T uint16_t
#define ACT_LOAD(p, i) bf16_to_f32((p)[i])
#define ACT_ROUND(x) bf16_round(x)
#define ENTRY(name) FN_EXPAND(name, FN_EXPAND(bf16, KV_SUFFIX))
#else
#define ATTEND FN(attend_one)
#define ACT_T float
#define ACT_LOAD(p, i) ((p)[i])
#define ACT_ROUND(x) (x)
#define ENTRY(name) FN_EXPAND(name, FN_EXPAND(f32, KV_SUFFIX))
#endif

/* Extra scratch floats per work item for bfloat16 rows: the float32 output before it is
   rounded (the queries are widened once, for all requests). */
#define ACT_TMP(H, D) (ACT_BF16 ? (H) * (D) : 0)

/* Attention of request b's query heads for kv heads [j0, j1) into out (float32 query qf),
   with its own scratch; out rounded to the activation dtype for those heads only. */
static inline void ENTRY(attend_item)(
    const float* qf, const KV_T* kb, const KV_T* vb, const float* ks, const float* vs,
    const int32_t* r2t_row, int64_t len, ACT_T* out, int64_t H, int64_t Hkv, int64_t j0,
    int64_t j1, int64_t D, float scale) {
    const int64_t scratch = len * H + ATTEND_TMP(H, Hkv, D) + ACT_TMP(H, D);
    float* sc = (float*)malloc(sizeof(float) * (size_t)scratch);
    if (!sc) abort();
    float* tmp = sc + len * H;
#if ACT_BF16
    float* of = tmp + ATTEND_TMP(H, Hkv, D);
#else
    float* of = out;
#endif
    ATTEND(qf, kb, vb, ks, vs, r2t_row, len, H, Hkv, j0, j1, D, scale, sc, tmp, of);
#if ACT_BF16
    const int64_t G = H / Hkv;
    for (int64_t i = j0 * G * D; i < j1 * G * D; i++) bf16_store(out, i, of[i]);
#endif
    free(sc);
}

/* out[b, h] = softmax(q[b, h] . K[b]^T * scale) V[b] for one query per request, where the
   keys of request b are the rows kb[req_to_token[req_slots[b], 0:seq_lens[b]]]. */
void ENTRY(rsgl_decode_attention)(
    const ACT_T* q, const KV_T* kb, const KV_T* vb, const float* ks, const float* vs,
    const int32_t* req_to_token,
    int64_t r2t_stride, const int64_t* req_slots, const int64_t* seq_lens, ACT_T* out,
    int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    int64_t n;
    DecodeItem* items = decode_items(seq_lens, B, Hkv, nthreads, &n);
#if ACT_BF16
    /* The widened queries, one row per request. */
    float* qf = (float*)malloc(sizeof(float) * (size_t)(B * H * D));
    if (!qf) abort();
    widen_bf16(q, qf, B * H * D);
#else
    const float* qf = q;
#endif
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = items[i].b;
        ENTRY(attend_item)(qf + b * H * D, kb, vb, ks, vs, req_to_token + req_slots[b] * r2t_stride,
                           seq_lens[b], out + b * H * D, H, Hkv, items[i].j0, items[i].j1, D,
                           scale);
    }
    free(items);
#if ACT_BF16
    free(qf);
#endif
}

/* Request b's rotary and KV store of a decode-only layer step: q and k of row b of qkv
   rotated by cis[b] (rounded to the activation dtype first, as the eager rotary's output
   is), q into q ([H, D] float32), k and v stored at KV slot loc[b] (rounded to KV_T; an int8
   cache's scales stored too). */
static inline void ENTRY(rotate_store)(
    const ACT_T* x, const float* cs, int64_t slot, KV_T* kb, KV_T* vb, float* ks, float* vs,
    float* q, int64_t H, int64_t Hkv, int64_t D) {
    const int64_t row = Hkv * D;
    for (int64_t h = 0; h < H; h++) {
        const ACT_T* xh = x + h * D;
        float* dst = q + h * D;
        for (int64_t i = 0; i < D / 2; i++) {
            const float c = cs[2 * i], s = cs[2 * i + 1];
            const float x0 = ACT_LOAD(xh, 2 * i), x1 = ACT_LOAD(xh, 2 * i + 1);
            dst[2 * i] = ACT_ROUND(x0 * c - x1 * s);
            dst[2 * i + 1] = ACT_ROUND(x0 * s + x1 * c);
        }
    }
    /* Each kv head's rotated key, then its value, as floats in tmp, then stored. */
    float tmp[512];
    float* t = D <= 512 ? tmp : (float*)malloc(sizeof(float) * (size_t)D);
    if (!t) abort();
    KV_T* k = kb + slot * row;
    KV_T* vdst = vb + slot * row;
    const ACT_T* v = x + (H + Hkv) * D;
    for (int64_t h = 0; h < Hkv; h++) {
        const ACT_T* xh = x + (H + h) * D;
        for (int64_t i = 0; i < D / 2; i++) {
            const float c = cs[2 * i], s = cs[2 * i + 1];
            const float x0 = ACT_LOAD(xh, 2 * i), x1 = ACT_LOAD(xh, 2 * i + 1);
            t[2 * i] = ACT_ROUND(x0 * c - x1 * s);
            t[2 * i + 1] = ACT_ROUND(x0 * s + x1 * c);
        }
        FN(store_head)(k + h * D, KV_SCALED ? ks + slot * Hkv + h : NULL, t, D);
        for (int64_t i = 0; i < D; i++) t[i] = ACT_LOAD(v, h * D + i);
        FN(store_head)(vdst + h * D, KV_SCALED ? vs + slot * Hkv + h : NULL, t, D);
    }
    if (t != tmp) free(t);
}

/* A decode-only layer step after the QKV projection, per request b: rotate q and k of row b
   of qkv ([B, (H + 2 Hkv) D], pair-interleaved rotary layout) by cis[b] ([D / 2] (cos, sin)
   pairs, float32), store the rotated k and v at KV slot loc[b] (rounded to KV_T), then
   attend as rsgl_decode_attention. The rotated q and k are rounded to the activation dtype
   first, as the eager rotary's output is. Request b's own key is among those it reads
   (req_to_token already maps position seq_lens[b] - 1 to loc[b]).

   Rows may also be the positions of one request (a verify step's last token and drafts, each
   its own row with seq_lens its position + 1, as the decode step at that position would
   be): every row's key is stored before any row attends, so a row reads the keys of the
   rows before it, and a row gets the bits it gets as a decode row. */
void ENTRY(rsgl_decode_layer)(
    const ACT_T* qkv, const float* cis, const int64_t* loc, KV_T* kb, KV_T* vb, float* ks,
    float* vs, const int32_t* req_to_token, int64_t r2t_stride, const int64_t* req_slots,
    const int64_t* seq_lens, ACT_T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
    float scale, int nthreads) {
    const int64_t width = (H + 2 * Hkv) * D;
    float* q = (float*)malloc(sizeof(float) * (size_t)(B * H * D));
    if (!q) abort();
    /* A row's rotary and store are a few hundred operations: in one loop, before the
       parallel attention. */
    for (int64_t b = 0; b < B; b++)
        ENTRY(rotate_store)(qkv + b * width, cis + b * D, loc[b], kb, vb, ks, vs,
                            q + b * H * D, H, Hkv, D);
    int64_t n;
    DecodeItem* items = decode_items(seq_lens, B, Hkv, nthreads, &n);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = items[i].b;
        ENTRY(attend_item)(q + b * H * D, kb, vb, ks, vs,
                           req_to_token + req_slots[b] * r2t_stride, seq_lens[b],
                           out + b * H * D, H, Hkv, items[i].j0, items[i].j1, D, scale);
    }
    free(items);
    free(q);
}

#undef ATTEND
#undef ACT_T
#undef ACT_LOAD
#undef ACT_ROUND
#undef ENTRY
#undef ACT_TMP
