/* bf16 linear layers on packed weights, for the row counts of decode steps (and short prefills):
 * AMX tiles where this process was granted them (cpu_amx.c), else AVX-512 BF16 dot products
 * (vdpbf16ps: AMD Zen 4 and 5, Intel Cooper Lake and later), else AVX2 and FMA (cpu_avx2_linear.c),
 * all on the one packed layout.
 *
 * The weight is packed once at load (model_executor/cpu/kernels/packing.py, bf16_pack) as
 * [n/16][k/32][16][16][2]: for each block of 16 outputs, k in pairs, each pair's 16 outputs x 2
 * values one 64-byte line. An AMX B tile is 16 such lines; for vdpbf16ps one line is one register,
 * and each 16-output block is one contiguous stream of k/2 lines.
 *
 * The AVX-512 kernel computes a tile of ROWS rows x up to four 16-output blocks in 24 fp32
 * registers: per k pair, four weight lines are loaded and each row's pair of x values broadcast.
 * A task is a group of four blocks (the gate's two and the up projection's two with silu) for
 * every row of x: the group's weights stream from memory for the first ROWS rows and come from L2
 * for the others, while the next group's lines are prefetched into L2. Each output's sum runs over
 * k in the same order whatever the row count or grouping (batch-invariant). Measured on SmolLM2's
 * 30 layers with cold weights on a 2-core AMD EPYC (Zen 4, no AMX), against oneDNN's packed bf16
 * GEMM in the same process: see docs/performance.md.
 *
 * Outputs: bf16 (+ bias; rounded to nearest even), fp32 (the sums unrounded: an LM head's logits),
 * or silu(gate) * up of a gate_up weight.
 */
#include <stdint.h>
#include <stdlib.h>

#include "srt_kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "simd_bf16.h"
#include "dp_bf16.h"
#include "gguf_widen.h"

#define ROWS DP_ROWS
#define GROUP DP_GROUP /* 16-output blocks per task */
#define PARALLEL_MIN 65536

enum { OUT_BF16, OUT_F32, OUT_SILU };

int64_t srt_dp_linear_available(void) { return 1; }

/* R rows of sums -> out (row stride n, its first column at `out`). OUT_SILU: blocks [0, NB/2) are
 * the gate's, [NB/2, NB) the up projection's same outputs. Aligned fp32 rows go out by
 * non-temporal stores (a whole line each; dp_linear fences them), as cpu_amx.c's LM head does. */
static inline __attribute__((always_inline)) void dp_store(__m512 acc[ROWS][GROUP], const int R, const int NB,
                                                           const bf16 *bias, void *out, int64_t n, const int mode) {
    for (int r = 0; r < R; r++) {
        if (mode == OUT_SILU) {
            for (int b = 0; b < NB / 2; b++)
                store16((bf16 *)out + r * n + 16 * b, silu_mul16(round16(acc[r][b]), round16(acc[r][b + NB / 2])));
            continue;
        }
        for (int b = 0; b < NB; b++) {
            const __m512 v = bias ? _mm512_add_ps(acc[r][b], load16(bias + 16 * b)) : acc[r][b];
            if (mode == OUT_BF16) {
                store16((bf16 *)out + r * n + 16 * b, v);
            } else {
                float *o = (float *)out + r * n + 16 * b;
                if (((uintptr_t)o & 63) == 0)
                    _mm512_stream_ps(o, v);
                else
                    _mm512_storeu_ps(o, v);
            }
        }
    }
}

/* Every row of x against the NB blocks wb -> out's columns from `out` on. With `next` (the next
 * task's blocks), row tile i >= 1 prefetches its share of them. */
static inline __attribute__((always_inline)) void dp_group(const bf16 *x, int64_t m, int64_t k, const bf16 *const *wb,
                                                           const int NB, const bf16 *bias, void *out, int64_t n,
                                                           const int mode, const bf16 *const *next) {
    const int64_t esize = mode == OUT_F32 ? 4 : 2, tiles = (m + ROWS - 1) / ROWS;
    const int64_t share = next && tiles > 1 ? (NB + tiles - 2) / (tiles - 1) : 0; /* blocks per tile */
    __m512 acc[ROWS][GROUP];
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t r0 = i * ROWS, lo = i ? (i - 1) * share : 0, hi = i ? i * share : 0;
        const int64_t pf0 = lo < NB ? lo : NB, pf1 = hi < NB ? hi : NB;
        const bf16 *xr = x + r0 * k;
        void *o = (char *)out + r0 * n * esize;
        switch (m - r0 < ROWS ? m - r0 : ROWS) {
#define TILE(R)                                                \
    case R:                                                    \
        dp_tile(xr, k, k / 2, wb, R, NB, acc, next, pf0, pf1); \
        dp_store(acc, R, NB, bias, o, n, mode);                \
        break;
            TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#undef TILE
        default: break;
        }
    }
}

/* out[m][n] = x[m][k] @ w.T (+ bias) in `mode`'s form; with OUT_SILU n is d, the gate_up weight's
 * [2d, k] half. Each thread takes a contiguous run of 16-output blocks, GROUP (silu: two gate
 * blocks with their up blocks) at a time. */
static void dp_linear(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, void *out, int64_t n, int64_t k,
                      const int mode) {
    const int64_t block = 16 * k, units = n / 16, esize = mode == OUT_F32 ? 4 : 2;
    const int64_t step = mode == OUT_SILU ? GROUP / 2 : GROUP;
#pragma omp parallel if (units * k * (m + 8) >= PARALLEL_MIN)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u1 = units * (t + 1) / threads;
        for (int64_t u = units * t / threads; u < u1; u += step) {
            const int64_t left = u1 - u < step ? u1 - u : step;
            const bf16 *wb[GROUP], *pf[GROUP];
            int nb = 0;
            for (int64_t i = 0; i < left; i++) wb[nb++] = packed + (u + i) * block;
            if (mode == OUT_SILU)
                for (int64_t i = 0; i < left; i++) wb[nb++] = packed + (units + u + i) * block;
            for (int i = 0; i < nb; i++) pf[i] = wb[i] + step * block;
            const bf16 *const *next = u + step < u1 ? pf : NULL;
            void *o = (char *)out + 16 * u * esize;
            const bf16 *b = bias ? bias + 16 * u : NULL;
            switch (nb) { /* a constant block count for each instance */
            case 4: dp_group(x, m, k, wb, 4, b, o, n, mode, next); break;
            case 3: dp_group(x, m, k, wb, 3, b, o, n, mode, next); break;
            case 2: dp_group(x, m, k, wb, 2, b, o, n, mode, next); break;
            default: dp_group(x, m, k, wb, 1, b, o, n, mode, next); break;
            }
        }
        if (mode == OUT_F32) _mm_sfence(); /* dp_store's non-temporal stores */
    }
}

/* GGUF blocks for any number of rows (srt_gguf_linear): each task's 16-output blocks widened to
 * bf16 in bf16_pack's order into a scratch of the thread's, then every row of x against them as
 * dp_linear runs a packed bf16 weight, so no bf16 copy of the weight is kept. A block widens each
 * weight as float32(d q + m) (or d q) rounded to nearest even: the bf16 copy's exact bits, and so
 * the same sums as srt_bf16_linear on it (without AMX; with AMX, cpu_amx.c's srt_amx_gguf_linear). */
static void gguf_linear(const bf16 *x, int64_t m, const uint8_t *packed, const int64_t kind, const bf16 *bias,
                        void *out, int64_t n, int64_t k, const int mode) {
    const int64_t stride = (k / 32) * gguf_block_bytes(kind), units = n / 16, esize = mode == OUT_F32 ? 4 : 2;
    const int64_t step = mode == OUT_SILU ? GROUP / 2 : GROUP;
#pragma omp parallel if (units * k * (m + 8) >= PARALLEL_MIN)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u1 = units * (t + 1) / threads;
        bf16 *scratch = aligned_alloc(64, (size_t)(GROUP * 16 * k) * sizeof(bf16));
        for (int64_t u = units * t / threads; u < u1; u += step) {
            const int64_t left = u1 - u < step ? u1 - u : step;
            const bf16 *wb[GROUP];
            int nb = 0;
            for (int64_t i = 0; i < (mode == OUT_SILU ? 2 : 1) * left; i++, nb++) wb[nb] = scratch + nb * 16 * k;
            for (int i = 0; i < nb; i++) {
                const int64_t unit = u + (mode == OUT_SILU && i >= left ? units + i - left : i);
                gguf_widen(packed + unit * stride, kind, (bf16 *)wb[i], k);
            }
            void *o = (char *)out + 16 * u * esize;
            const bf16 *b = bias ? bias + 16 * u : NULL;
            switch (nb) {
            case 4: dp_group(x, m, k, wb, 4, b, o, n, mode, NULL); break;
            case 3: dp_group(x, m, k, wb, 3, b, o, n, mode, NULL); break;
            case 2: dp_group(x, m, k, wb, 2, b, o, n, mode, NULL); break;
            default: dp_group(x, m, k, wb, 1, b, o, n, mode, NULL); break;
            }
        }
        free(scratch);
        if (mode == OUT_F32) _mm_sfence();
    }
}

int64_t srt_gguf_linear_available(void) { return 1; }

/* out[m][n] = x[m][k] @ w.T (+ bias) for a GGUF weight's blocks in q4_pack's, q5k_pack's or q8_pack's
 * layout (`kind`: gguf_layouts.h's GGUF_*), any m: bf16 out (mode 0), float32 sums
 * (mode 1), or silu(gate) * up of a [2n, k] gate_up weight into out[m][n] (mode 2). n % 32 == 0
 * (bf16_packable's) and k % 32 == 0. */
void srt_gguf_linear(const bf16 *x, int64_t m, const uint8_t *packed, int64_t kind, const bf16 *bias, void *out,
                     int64_t n, int64_t k, int64_t mode) {
    if (srt_amx_granted())
        srt_amx_gguf_linear(x, m, packed, kind, bias, out, n, k, mode);
    else
        gguf_linear(x, m, packed, kind, bias, out, n, k, mode == 2 ? OUT_SILU : mode == 1 ? OUT_F32 : OUT_BF16);
}

#define DP(mode, ...) dp_linear(__VA_ARGS__, mode)
#else
int64_t srt_gguf_linear_available(void) { return 0; }
void srt_gguf_linear(const bf16 *x, int64_t m, const uint8_t *packed, int64_t kind, const bf16 *bias, void *out,
                     int64_t n, int64_t k, int64_t mode) {
    (void)x, (void)m, (void)packed, (void)kind, (void)bias, (void)out, (void)n, (void)k, (void)mode;
    abort(); /* never called: srt_gguf_linear_available() answered 0 */
}
int64_t srt_dp_linear_available(void) { return 0; }
#define DP(mode, ...) abort() /* never called: srt_dp_linear_available() answered 0 */
#endif

/* Neither AMX nor AVX-512 BF16 here: AVX2 and FMA (a CPU with neither has no packed weights) */
#define NO_DP (!srt_dp_linear_available())

/* out[m][n] = x[m][k] @ w.T (+ bias[n]) for the packed weight; x rows contiguous; n % 32 == 0 and
 * k % 32 == 0 (the caller checks). */
void srt_bf16_linear(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, bf16 *out, int64_t n,
                     int64_t k) {
    if (srt_amx_granted())
        srt_amx_linear(x, m, packed, bias, out, n, k);
    else if (NO_DP)
        srt_avx2_linear(x, m, packed, bias, out, n, k);
    else
        DP(OUT_BF16, x, m, packed, bias, out, n, k);
}

/* The same with fp32 outputs, unrounded (an LM head's logits) */
void srt_bf16_linear_f32(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, float *out, int64_t n,
                         int64_t k) {
    if (srt_amx_granted())
        srt_amx_linear_f32(x, m, packed, bias, out, n, k);
    else if (NO_DP)
        srt_avx2_linear_f32(x, m, packed, bias, out, n, k);
    else
        DP(OUT_F32, x, m, packed, bias, out, n, k);
}

/* act[m][d] = silu(x @ w_gate.T) * (x @ w_up.T) for the packed [2d, k] gate_up weight (gate rows
 * first, then up, as MergedColumnParallelLinear holds them), without the [m][2d] gate_up output:
 * the same values as srt_bf16_linear then srt_silu_mul. d % 16 == 0 and k % 32 == 0. */
void srt_bf16_linear_silu(const bf16 *x, int64_t m, const bf16 *packed, bf16 *act, int64_t d, int64_t k) {
    if (srt_amx_granted())
        srt_amx_linear_silu(x, m, packed, act, d, k);
    else if (NO_DP)
        srt_avx2_linear_silu(x, m, packed, act, d, k);
    else
        DP(OUT_SILU, x, m, packed, NULL, act, d, k);
}
