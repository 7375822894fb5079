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
 * A task is a group of GROUP blocks (silu: a gate block and its up block) for every row of x. Up to
 * MANY_ROWS rows (decode) the register tile is ROWS rows x GROUP blocks, 12 accumulators of eight
 * outputs, widening each weight load as it goes: the group streams from memory for the first row
 * tile and comes from L2 for the others. Past MANY_ROWS (prefill) the widening would cost an ALU
 * op per two FMAs for every row tile, so the group is widened once into the thread's fp32 panel
 * (16 weights per k per slice, 128 k bytes: in L2 up to k = 4096, and measured as fast past it)
 * and the tile is PANEL_ROWS rows x one 16-weight slice: 12 accumulators, two weight loads and a
 * broadcast a row per k, nothing but loads and FMAs.
 *
 * Either way each output's sum is one chain of FMAs over k in order from zero (the panel holds the
 * same fp32 weights), then the bias and the same epilogue: a row's bits are the same whatever the
 * row count, path, tiling or thread split (batch-invariant).
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

/* One row's 2 NB eight-output sums acc -> out in `mode`'s form: + bias, then bf16 or fp32; with
 * OUT_SILU acc[j] is the gate's and acc[j + NB] the up projection's eight outputs j (j < NB). */
static inline __attribute__((always_inline)) void av_row_out(const __m256 *acc, const int NB, const bf16 *bias,
                                                             void *out, const int mode) {
    if (mode == OUT_SILU) {
#pragma GCC unroll 2
        for (int j = 0; j < NB; j++) store8((bf16 *)out + 8 * j, silu_mul8(round8(acc[j]), round8(acc[j + NB])));
        return;
    }
#pragma GCC unroll 4
    for (int j = 0; j < 2 * NB; j++) {
        const __m256 v = bias ? _mm256_add_ps(acc[j], load8(bias + 8 * j)) : acc[j];
        if (mode == OUT_BF16)
            store8((bf16 *)out + 8 * j, v);
        else
            _mm256_storeu_ps((float *)out + 8 * j, v);
    }
}

/* R rows of x (fp32, rows k apart) times the NB blocks wb -> out (row stride n, its first column
 * at `out`) in `mode`'s form. acc[r][2b + h] sums outputs 8h .. 8h + 7 of block b. OUT_SILU: the
 * first NB of the 2 NB eight-output sums are the gate's, the others the up projection's same
 * outputs. */
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
    const int64_t esize = mode == OUT_F32 ? 4 : 2;
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) av_row_out(acc[r], NB, bias, (char *)out + r * n * esize, mode);
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

/* More rows than MANY_ROWS (a prefill chunk, a large batch): the group widened once into a panel */
#define MANY_ROWS 8  /* measured on Zen 3: the panel path is as fast at 6 rows, faster from 12 */
#define PANEL_ROWS 6 /* rows per panel tile: 6 x 2 sums + 2 weights + a broadcast of 16 registers */

/* The group wb as fp32 slices of 16 weights per k (slice s at panel + 16 s k): linear's slice s is
 * block s; OUT_SILU's is the gate's (wb[0]) outputs 8s .. 8s + 7, then the up projection's
 * (wb[1]) same outputs. Returns the slice count. */
static int av_widen_panel(float *panel, const bf16 *const *wb, const int nb, int64_t k, const int mode) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    const int slices = mode == OUT_SILU ? 2 : nb;
    for (int s = 0; s < slices; s++)
        for (int64_t p = 0; p < k / 2; p++)
            for (int h = 0; h < 2; h++) {
                const bf16 *src = mode == OUT_SILU ? wb[h] + 32 * p + 16 * s : wb[s] + 32 * p + 16 * h;
                const __m256i w = _mm256_loadu_si256((const __m256i *)src);
                float *dst = panel + 16 * (s * k + 2 * p) + 8 * h;
                _mm256_store_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
                _mm256_store_ps(dst + 16, _mm256_castsi256_ps(_mm256_and_si256(w, high)));
            }
    return slices;
}

/* R rows of x times one panel slice w -> out (row stride n) in `mode`'s form: av_tile's sums for
 * NB = 1, over fp32 weights. */
static inline __attribute__((always_inline)) void av_panel_tile(const float *x, int64_t k, const float *w,
                                                                const int R, const bf16 *bias, void *out,
                                                                int64_t n, const int mode) {
    __m256 acc[PANEL_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const __m256 w0 = _mm256_load_ps(w + 16 * i), w1 = _mm256_load_ps(w + 16 * i + 8);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * k + i);
            acc[r][0] = _mm256_fmadd_ps(w0, a, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, a, acc[r][1]);
        }
    }
    const int64_t esize = mode == OUT_F32 ? 4 : 2;
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) av_row_out(acc[r], 1, bias, (char *)out + r * n * esize, mode);
}

/* Every row of x against the panel's slices -> out's columns from `out` on */
static inline __attribute__((always_inline)) void av_panel_group(const float *x, int64_t m, int64_t k,
                                                                 const float *panel, const int slices,
                                                                 const bf16 *bias, void *out, int64_t n,
                                                                 const int mode) {
    const int64_t esize = mode == OUT_F32 ? 4 : 2, width = mode == OUT_SILU ? 8 : 16;
    for (int64_t r0 = 0; r0 < m; r0 += PANEL_ROWS)
        for (int s = 0; s < slices; s++) {
            const float *xr = x + r0 * k, *w = panel + 16 * s * k;
            const bf16 *b = bias ? bias + 16 * s : NULL;
            void *o = (char *)out + (r0 * n + width * s) * esize;
            switch (m - r0 < PANEL_ROWS ? m - r0 : PANEL_ROWS) {
#define TILE(R) \
    case R: av_panel_tile(xr, k, w, R, b, o, n, mode); break;
                TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#undef TILE
            default: break;
            }
        }
}

/* This thread's panel of at least `floats` values (64-byte aligned), kept between calls */
static float *panel_buffer(int64_t floats) {
    static __thread float *buffer;
    static __thread int64_t size;
    if (floats > size) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)floats * sizeof(float));
        if (!buffer) abort();
        size = floats;
    }
    return buffer;
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
        float *panel = m > MANY_ROWS ? panel_buffer(2 * 16 * k) : NULL;
        for (int64_t u = units * t / threads; u < u1; u += step) {
            const int64_t left = u1 - u < step ? u1 - u : step;
            const bf16 *wb[GROUP];
            int nb = 0;
            for (int64_t i = 0; i < left; i++) wb[nb++] = packed + (u + i) * block;
            if (mode == OUT_SILU)
                for (int64_t i = 0; i < left; i++) wb[nb++] = packed + (units + u + i) * block;
            void *o = (char *)out + 16 * u * esize;
            const bf16 *b = bias ? bias + 16 * u : NULL;
            if (m > MANY_ROWS)
                av_panel_group(x, m, k, panel, av_widen_panel(panel, wb, nb, k, mode), b, o, n, mode);
            else if (nb == 2)
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
