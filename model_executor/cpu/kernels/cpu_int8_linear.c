/* W8A8 int8 linear layers (--quantization w8a8_int8): AMX int8 tiles where this process was granted
 * them (cpu_amx.c), else AVX-512 VNNI (vpdpbusd: AMD Zen 4 and 5, Intel Ice Lake and later).
 *
 * Weights are int8 with one fp32 scale per output (symmetric, absmax / 127), packed by packing.int8_pack
 * as [n/16][k/64][16 (k quads)][16 (n)][4]: for each block of 16 outputs, k in quads, each quad's
 * 16 outputs x 4 values one 64-byte line (an AMX B tile is 16 such lines). Each row of x is
 * quantized the same way per call (one scale per row). The products are exact int32 sums; the
 * epilogue applies both scales (and the bias) in fp32 before rounding to bf16, the same operations
 * in the same order on both paths, so they give the same bits.
 *
 * vpdpbusd multiplies unsigned by signed bytes. The VNNI path stores each weight plus 128 as an
 * unsigned byte (int8_pack does, where AMX is not granted) and x signed, then subtracts 128 x the
 * row's sum of its int8 values: sum((w + 128) x) - 128 sum(x) = sum(w x), exactly. Its register
 * tile and task split are those of cpu_bf16_linear.c (6 rows x four 16-output blocks, the next
 * group prefetched into L2), over rows in chunks that stay in L2 while every group passes over them.
 */
#include <stdint.h>
#include <stdlib.h>

#include "srt_kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "simd_bf16.h"

/* x rows -> int8 rows q (row stride k) and their scales, and with `sums` each row's sum of its
 * int8 values */
void srt_quantize_rows(const bf16 *x, int64_t m, int64_t k, int8_t *q, float *scales, int32_t *sums) {
#pragma omp parallel for if (m * k >= 65536) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const bf16 *xr = x + r * k;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(xr + j)));
        const float a = _mm512_reduce_max_ps(amax), scale = a > 0.0f ? a / 127.0f : 1.0f;
        const __m512 inv = _mm512_set1_ps(1.0f / scale);
        __m512i sum = _mm512_setzero_si512();
        for (int64_t j = 0; j < k; j += 16) {
            const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xr + j), inv)); /* round to nearest even */
            _mm_storeu_si128((__m128i *)(q + r * k + j), _mm512_cvtsepi32_epi8(n));
            sum = _mm512_add_epi32(sum, n);
        }
        scales[r] = scale;
        if (sums) sums[r] = _mm512_reduce_add_epi32(sum);
    }
}
#else
void srt_quantize_rows(const bf16 *x, int64_t m, int64_t k, int8_t *q, float *scales, int32_t *sums) {
    (void)x, (void)m, (void)k, (void)q, (void)scales, (void)sums;
    abort(); /* never called: without AVX-512 BF16 neither int8 path is built (srt_vnni_linear_available,
              * srt_amx_has_int8 answer 0) */
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define ROWS 6
#define GROUP 4
#define CHUNK_ROWS 192 /* rows of x per pass over the weight: 192 x 1536 int8 values stay in L2 */
#define PARALLEL_MIN 65536

int64_t srt_vnni_linear_available(void) { return 1; }

/* acc[r][b] = sum over k of row r of xq (int8, rows k apart) times weight block wb[b] (bytes w +
 * 128), minus 128 x the row's sum: the exact int8 product. Meanwhile one line per quad of each
 * block pf[pf0 .. pf1) is prefetched into L2 (a block is k/4 lines).
 * The sums are __v16si, vpdpbusd's own type: held as __m512i (64-bit lanes, cast to 32-bit ones for
 * every vpdpbusd), gcc 12 kept half of the 6 x 4 tile's sums on the stack, loading and storing
 * them every k quad, and the kernel ran at about half the rate (docs/performance.md). */
static inline __attribute__((always_inline)) void vnni_tile(const int8_t *xq, const int32_t *row_sums, int64_t k,
                                                            const uint8_t *const *wb, const int R, const int NB,
                                                            __v16si acc[ROWS][GROUP], const uint8_t *const *pf,
                                                            int64_t pf0, int64_t pf1) {
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = (__v16si)_mm512_setzero_si512();
    const int32_t *xp = (const int32_t *)xq; /* four int8 x values as one 32-bit lane */
    const int64_t quads = k / 4;
    for (int64_t p = 0; p < quads; p++) {
        __m512i w[GROUP];
        for (int b = 0; b < NB; b++) w[b] = _mm512_loadu_si512(wb[b] + p * 64);
        for (int64_t b = pf0; b < pf1; b++) _mm_prefetch((const char *)(pf[b] + p * 64), _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            const __m512i xv = _mm512_set1_epi32(xp[r * quads + p]);
            for (int b = 0; b < NB; b++) acc[r][b] = (__v16si)_mm512_dpbusd_epi32((__m512i)acc[r][b], w[b], xv);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512i offset = _mm512_set1_epi32(128 * row_sums[r]);
        for (int b = 0; b < NB; b++) acc[r][b] -= (__v16si)offset;
    }
}

/* R rows of int32 sums -> out (row stride n, its first column at `out`) in bf16: (sum * x scale) *
 * w scale (+ bias), as cpu_amx.c's store_block_i8; with silu, blocks [0, NB/2) are the gate's and
 * [NB/2, NB) the up projection's, each scaled and rounded to bf16, then silu(gate) * up. */
static inline __attribute__((always_inline)) void vnni_store(__v16si acc[ROWS][GROUP], const int R, const int NB,
                                                             const float *xs, const float *const *ws,
                                                             const bf16 *bias, bf16 *out, int64_t n, const int silu) {
    for (int r = 0; r < R; r++) {
        const __m512 x = _mm512_set1_ps(xs[r]);
        if (silu) {
            for (int b = 0; b < NB / 2; b++) {
                const __m512 g = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps((__m512i)acc[r][b]), x), _mm512_loadu_ps(ws[b]));
                const __m512 u = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps((__m512i)acc[r][b + NB / 2]), x),
                                               _mm512_loadu_ps(ws[b + NB / 2]));
                store16(out + r * n + 16 * b, silu_mul16(round16(g), round16(u)));
            }
            continue;
        }
        for (int b = 0; b < NB; b++) {
            const __m512 bv = bias ? load16(bias + 16 * b) : _mm512_setzero_ps();
            const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps((__m512i)acc[r][b]), x), _mm512_loadu_ps(ws[b]), bv);
            store16(out + r * n + 16 * b, y);
        }
    }
}

/* Every row of xq against the NB blocks wb (scales ws) -> out's columns from `out` on; with `next`
 * (the next task's blocks), row tile i >= 1 prefetches its share of them */
static inline __attribute__((always_inline)) void vnni_group(const int8_t *xq, const float *xs, const int32_t *sums,
                                                             int64_t m, int64_t k, const uint8_t *const *wb,
                                                             const float *const *ws, const int NB, const bf16 *bias,
                                                             bf16 *out, int64_t n, const int silu,
                                                             const uint8_t *const *next) {
    const int64_t tiles = (m + ROWS - 1) / ROWS;
    const int64_t share = next && tiles > 1 ? (NB + tiles - 2) / (tiles - 1) : 0; /* blocks per tile */
    __v16si acc[ROWS][GROUP];
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t r0 = i * ROWS, lo = i ? (i - 1) * share : 0, hi = i ? i * share : 0;
        const int64_t pf0 = lo < NB ? lo : NB, pf1 = hi < NB ? hi : NB;
        switch (m - r0 < ROWS ? m - r0 : ROWS) {
#define TILE(R)                                                                                 \
    case R:                                                                                     \
        vnni_tile(xq + r0 * k, sums + r0, k, wb, R, NB, acc, next, pf0, pf1);                   \
        vnni_store(acc, R, NB, xs + r0, ws, bias, out + r0 * n, n, silu);                       \
        break;
            TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#undef TILE
        default: break;
        }
    }
}

/* out[m][n] = x @ (w * w_scale).T (+ bias), or with silu silu(gate) * up of the gate_up weight into
 * out[m][d] (n = d): each thread a contiguous run of 16-output blocks, GROUP at a time (silu: two
 * gate blocks with their up blocks), for each chunk of rows in turn */
static void vnni_linear(const bf16 *x, int64_t m, const uint8_t *packed, const float *w_scale, const bf16 *bias,
                        bf16 *out, int64_t n, int64_t k, const int silu) {
    const int64_t block = 16 * k, units = n / 16, step = silu ? GROUP / 2 : GROUP;
    int8_t *xq = malloc((size_t)(m * k));
    float *xs = malloc((size_t)m * sizeof(float));
    int32_t *sums = malloc((size_t)m * sizeof(int32_t));
    srt_quantize_rows(x, m, k, xq, xs, sums);
#pragma omp parallel if (units * k * (m + 8) >= PARALLEL_MIN)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u1 = units * (t + 1) / threads;
        for (int64_t c0 = 0; c0 < m; c0 += CHUNK_ROWS) {
            const int64_t rows = m - c0 < CHUNK_ROWS ? m - c0 : CHUNK_ROWS;
            for (int64_t u = units * t / threads; u < u1; u += step) {
                const int64_t left = u1 - u < step ? u1 - u : step;
                const uint8_t *wb[GROUP] = {0}, *pf[GROUP];
                const float *ws[GROUP];
                int nb = 0;
                for (int64_t i = 0; i < left; i++, nb++) wb[nb] = packed + (u + i) * block, ws[nb] = w_scale + 16 * (u + i);
                if (silu)
                    for (int64_t i = 0; i < left; i++, nb++)
                        wb[nb] = packed + (units + u + i) * block, ws[nb] = w_scale + 16 * (units + u + i);
                for (int i = 0; i < nb; i++) pf[i] = wb[i] + step * block;
                const uint8_t *const *next = u + step < u1 ? pf : NULL;
                const int8_t *xc = xq + c0 * k;
                bf16 *o = out + c0 * n + 16 * u;
                const bf16 *b = bias ? bias + 16 * u : NULL;
                switch (nb) { /* a constant block count for each instance */
                case 4: vnni_group(xc, xs + c0, sums + c0, rows, k, wb, ws, 4, b, o, n, silu, next); break;
                case 3: vnni_group(xc, xs + c0, sums + c0, rows, k, wb, ws, 3, b, o, n, silu, next); break;
                case 2: vnni_group(xc, xs + c0, sums + c0, rows, k, wb, ws, 2, b, o, n, silu, next); break;
                default: vnni_group(xc, xs + c0, sums + c0, rows, k, wb, ws, 1, b, o, n, silu, next); break;
                }
            }
        }
    }
    free(xq);
    free(xs);
    free(sums);
}

#define VNNI(...) vnni_linear(__VA_ARGS__)
#else
int64_t srt_vnni_linear_available(void) { return 0; }
#define VNNI(...) abort() /* never called: srt_vnni_linear_available() answered 0 */
#endif

/* out[m][n] = x[m][k] @ (w * w_scale).T (+ bias), x quantized per row; n % 32 == 0 and k % 64 == 0
 * (the caller checks), the weight packed for the path that runs (packing.int8_pack). */
void srt_int8_linear(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, const bf16 *bias,
                     bf16 *out, int64_t n, int64_t k) {
    if (srt_amx_granted())
        srt_amx_linear_i8(x, m, packed, w_scale, bias, out, n, k);
    else
        VNNI(x, m, (const uint8_t *)packed, w_scale, bias, out, n, k, 0);
}

/* act[m][d] = silu(gate) * up of the int8 gate_up weight [2d, k] (gate rows first), without the
 * [m][2d] product: the same values as srt_int8_linear then srt_silu_mul. d % 16 == 0. */
void srt_int8_linear_silu(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, bf16 *act,
                          int64_t d, int64_t k) {
    if (srt_amx_granted())
        srt_amx_linear_i8_silu(x, m, packed, w_scale, act, d, k);
    else
        VNNI(x, m, (const uint8_t *)packed, w_scale, NULL, act, d, k, 1);
}
