/* The attention kernels, one instance per KV cache element type, each with entry points
   for float32 and bfloat16 activations. */
#include "common.h"
#include "kv8.h"

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
