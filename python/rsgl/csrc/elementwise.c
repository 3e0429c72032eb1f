/* add+RMSNorm, SiLU-and-multiply and rotary over float32 rows (..._f32) and bfloat16 rows
   (..._bf16). */
#include "common.h"

#define ACT_BF16 0
#include "elementwise_impl.h"
#undef ACT_BF16

#define ACT_BF16 1
#include "elementwise_impl.h"
#undef ACT_BF16

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
