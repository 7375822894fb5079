/* bf16 linears on bf16_pack's layout for CPUs with AVX2 and FMA but no AVX-512 BF16 (AMD Zen 2 and
 * 3, Intel Haswell to Alder Lake): srt_bf16_linear and its two siblings (cpu_bf16_linear.c) come
 * here where neither AMX nor vdpbf16ps runs.
 *
 * The layout is cpu_bf16_linear.c's: per block of 16 outputs, per k pair, one 64-byte line whose
 * 32-bit lane j holds output j's two values (k = 2p in the low half, 2p + 1 in the high). A
 * 256-bit load is eight such lanes; shifted left 16 it is the eight k = 2p weights in fp32, masked
 * to its high halves the eight k = 2p + 1 ones (both exact). Each row's x is widened to fp32 once
 * per call, and each x value is broadcast into an FMA with its eight weights.
 *
 * The register tile is ROWS rows x GROUP blocks: 12 accumulators of eight outputs. A task is a
 * group of blocks for every row of x: the group streams from memory for the first row tile and
 * comes from L2 for the others. Each output's sum is one chain of FMAs over k in order, the same
 * whatever the row count, tiling or thread split (batch-invariant).
 */
#include <stdint.h>
#include <stdlib.h>

#include "srt_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include "simd_avx2.h"

#define ROWS 3  /* rows per register tile: 3 x 4 sums + 2 weights + broadcasts of 16 registers */
#define GROUP 2 /* 16-output blocks per tile */
#define PARALLEL_MIN 65536

enum { OUT_BF16, OUT_F32, OUT_SILU };

int64_t srt_avx2_linear_available(void) { return 1; }

/* R rows of x (fp32, rows k apart) times the NB blocks wb -> out (row stride n, its first column
 * at `out`) in `mode`'s form. acc[r][2b + h] sums outputs 8h .. 8h + 7 of block b. OUT_SILU: the first NB of the 2 NB eight-output sums
 * are the gate's, the others the up projection's same outputs. */
static inline __attribute__((always_inline)) void av_tile(const float *x, int64_t k, const bf16 *const *wb,
                                                          const int R, const int NB, const bf16 *bias, void *out,
                                                          int64_t n, const int mode) {
    __m256 acc[ROWS][2 * GROUP];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 2 * NB; j++) acc[r][j] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t p = 0; p < k / 2; p++) {
        for (int b = 0; b < NB; b++)
            for (int h = 0; h < 2; h++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wb[b] + 32 * p + 16 * h));
                const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
                const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, high));
                for (int r = 0; r < R; r++) {
                    const float *xr = x + r * k + 2 * p;
                    const __m256 a = _mm256_fmadd_ps(even, _mm256_broadcast_ss(xr), acc[r][2 * b + h]);
                    acc[r][2 * b + h] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(xr + 1), a);
                }
            }
    }
    for (int r = 0; r < R; r++) {
        if (mode == OUT_SILU) {
            for (int j = 0; j < NB; j++)
                store8((bf16 *)out + r * n + 8 * j, silu_mul8(round8(acc[r][j]), round8(acc[r][j + NB])));
            continue;
        }
        for (int j = 0; j < 2 * NB; j++) {
            const __m256 v = bias ? _mm256_add_ps(acc[r][j], load8(bias + 8 * j)) : acc[r][j];
            if (mode == OUT_BF16)
                store8((bf16 *)out + r * n + 8 * j, v);
            else
                _mm256_storeu_ps((float *)out + r * n + 8 * j, v);
        }
    }
}

/* Every row of x against the NB blocks wb -> out's columns from `out` on */
static inline __attribute__((always_inline)) void av_group(const float *x, int64_t m, int64_t k,
                                                           const bf16 *const *wb, const int NB, const bf16 *bias,
                                                           void *out, int64_t n, const int mode) {
    const int64_t esize = mode == OUT_F32 ? 4 : 2;
    for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        const float *xr = x + r0 * k;
        void *o = (char *)out + r0 * n * esize;
        switch (m - r0 < ROWS ? m - r0 : ROWS) {
#define TILE(R) \
    case R: av_tile(xr, k, wb, R, NB, bias, o, n, mode); break;
            TILE(1) TILE(2) TILE(3)
#undef TILE
        default: break;
        }
    }
}

#define KEEP_MAX (1 << 16) /* widened values kept between calls (256 KiB a thread): decode steps */

/* x's count values widened to fp32: into this thread's buffer, kept between calls, for a decode
 * step's few rows; for more (a prefill chunk) into a new one, which the caller frees. */
static float *widen(const bf16 *x, int64_t count) {
    static __thread float *kept;
    float *buffer = kept;
    if (count > KEEP_MAX || !kept) {
        const int64_t size = count > KEEP_MAX ? (count + 15) / 16 * 16 : KEEP_MAX;
        buffer = aligned_alloc(64, (size_t)size * sizeof(float));
        if (!buffer) abort();
        if (count <= KEEP_MAX) kept = buffer;
    }
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) _mm256_store_ps(buffer + i, load8(x + i));
    for (; i < count; i++) {
        const uint32_t bits = (uint32_t)x[i] << 16;
        __builtin_memcpy(buffer + i, &bits, sizeof bits);
    }
    return buffer;
}

/* out[m][n] = x[m][k] @ w.T (+ bias) in `mode`'s form; with OUT_SILU n is d, the gate_up weight's
 * [2d, k] half. Each thread takes a contiguous run of 16-output blocks, GROUP (silu: one gate
 * block with its up block) at a time. */
static void av_linear(const bf16 *x16, int64_t m, const bf16 *packed, const bf16 *bias, void *out, int64_t n,
                      int64_t k, const int mode) {
    const int64_t block = 16 * k, units = n / 16, esize = mode == OUT_F32 ? 4 : 2;
    const int64_t step = mode == OUT_SILU ? GROUP / 2 : GROUP;
    float *x = widen(x16, m * k);
#pragma omp parallel if (units * k * (m + 8) >= PARALLEL_MIN)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u1 = units * (t + 1) / threads;
        for (int64_t u = units * t / threads; u < u1; u += step) {
            const int64_t left = u1 - u < step ? u1 - u : step;
            const bf16 *wb[GROUP];
            int nb = 0;
            for (int64_t i = 0; i < left; i++) wb[nb++] = packed + (u + i) * block;
            if (mode == OUT_SILU)
                for (int64_t i = 0; i < left; i++) wb[nb++] = packed + (units + u + i) * block;
            void *o = (char *)out + 16 * u * esize;
            const bf16 *b = bias ? bias + 16 * u : NULL;
            if (nb == 2)
                av_group(x, m, k, wb, 2, b, o, n, mode);
            else
                av_group(x, m, k, wb, 1, b, o, n, mode);
        }
    }
    if (m * k > KEEP_MAX) free(x);
}

void srt_avx2_linear(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, bf16 *out, int64_t n,
                     int64_t k) {
    av_linear(x, m, packed, bias, out, n, k, OUT_BF16);
}
void srt_avx2_linear_f32(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, float *out, int64_t n,
                         int64_t k) {
    av_linear(x, m, packed, bias, out, n, k, OUT_F32);
}
void srt_avx2_linear_silu(const bf16 *x, int64_t m, const bf16 *packed, bf16 *act, int64_t d, int64_t k) {
    av_linear(x, m, packed, NULL, act, d, k, OUT_SILU);
}
#else
int64_t srt_avx2_linear_available(void) { return 0; }

void srt_avx2_linear(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, bf16 *out, int64_t n,
                     int64_t k) {
    (void)x, (void)m, (void)packed, (void)bias, (void)out, (void)n, (void)k;
    abort(); /* never called: srt_avx2_linear_available() answered 0 */
}

void srt_avx2_linear_f32(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, float *out, int64_t n,
                         int64_t k) {
    (void)x, (void)m, (void)packed, (void)bias, (void)out, (void)n, (void)k;
    abort(); /* never called: srt_avx2_linear_available() answered 0 */
}

void srt_avx2_linear_silu(const bf16 *x, int64_t m, const bf16 *packed, bf16 *act, int64_t d, int64_t k) {
    (void)x, (void)m, (void)packed, (void)act, (void)d, (void)k;
    abort(); /* never called: srt_avx2_linear_available() answered 0 */
}
#endif
