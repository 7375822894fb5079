/* Linear layers on GGUF Q4_1 weights (--quantization gguf), for decode steps of a few rows, with
 * AVX-512 BF16 dot products (vdpbf16ps), or else AVX2 FMAs (the second half). Both also take GGUF
 * Q4_K's sub-blocks (srt_q4k_linear), whose d and m are fp32, and Q5_K's (srt_q5k_linear).
 * Q4_1 stores each run of 32 weights along k as 4-bit q with an fp16 scale d and minimum m: w = d q + m. A decode step at batch 1 streams every weight once,
 * and these are 0.625 bytes a weight against bf16's 2.
 *
 * Packed by packing.q4_pack as [n/16][k/32][320 bytes]: for each block of 16 outputs and 32 k, the 16
 * d then the 16 m (fp16), then 8 chunks of 32 bytes, chunk c holding k 4c .. 4c+3: byte 2j is
 * q[j][4c] | q[j][4c+2] << 4, byte 2j+1 is q[j][4c+1] | q[j][4c+3] << 4. Widened to 16-bit words,
 * chunk c is 16 lanes of (byte 2j, byte 2j+1): its low nibbles are k pair 2c of the 16 outputs,
 * its high nibbles pair 2c+1, each a vdpbf16ps operand after one mask and OR: a nibble q under
 * the bits 0x4300 is the bf16 number 128 + q, exactly.
 *
 * So per 32 k the dot products give sum x (128 + q) in fp32 and the block adds
 * d * that + (m - 128 d) * sum x = d sum x q + m sum x, the sum over the block of x w with every w
 * exact (a bf16 weight would round d q + m to 8 bits). Rows go in tiles of four against two
 * 16-output blocks, the rest in tiles of two (or one) against four (16 sums, 16 block sums, two
 * weight lines, four broadcasts of 32 registers); each widened weight serves every row of its
 * tile, and a task's weights come from memory for its first tile and from L1/L2 for the others.
 * Four-row tiles took less time than two-row ones on SmolLM2's 30 layers, with the same bits
 * (docs/performance.md, "Four-row tiles").
 * A call of WIDE_MIN_ROWS rows or more (a prefill, a big batch) widens each task's blocks once
 * into a scratch, to the very bf16 operands the tiles build, and runs tiles of up to six rows on
 * them with the same per-block sums and FMAs (q4_wide_group): a row's outputs are the same bits at
 * any row count, so --quantization gguf is batch-invariant here (ops.gguf_rows_exact).
 *
 * GGUF Q5_K (srt_q5k_linear) is Q4_K with a fifth bit on each q (0..31): packing.q5k_pack writes
 * Q4_K's 384 bytes of the low four bits, then 64 bytes, two 32-bit words per chunk c: word p holds
 * the fifth bits of q[j][4c + 2p] and q[j][4c + 2p + 1] at bits (4 + j) % 32 and (20 + j) % 32, so
 * that broadcast and rotated right by j in output j's 32-bit lane they sit at bits 4 and 20: 16 in
 * each of its two 16-bit halves. One ternary-logic op keeps those bits and sets 0x4300, and the
 * nibbles' own one ORs them in: 128 + q, exact in bf16 up to 255.
 *
 * GGUF Q4_K as the file holds its scales (srt_q4ks_linear, packing.q4ks_pack) takes 0.59 bytes a
 * weight against the fp32 d and m's 0.75: per 16 outputs and 256 k (a K-quant super-block), the
 * 16 fp32 D, the 16 fp32 M, then for each run of 32 k its 16 six-bit sc and 16 mn (a byte each)
 * and the nibbles as above. A run's d is D sc and its m M mn, each exact in fp32 (an fp16 times six
 * bits), so the sums are srt_q4k_linear's to the bit.
 */
#include <stdint.h>
#include <stdlib.h>

#include "gguf_layouts.h"
#include "srt_kernels.h"

/* the block kinds, 16 outputs x 32 k each: Q4_1 (fp16 d and m), Q4_K (fp32), Q5_K (Q4_K's, then the
 * fifth bits), Q4_KS (Q4_K's six-bit scales, 304 bytes a block on average) */
enum { Q4_1 = GGUF_Q4_1, Q4_K = GGUF_Q4_K, Q5_K = GGUF_Q5_K, Q4_KS = GGUF_Q4_KS };
static inline int kind_bytes(const int kind) { return (int)gguf_block_bytes(kind); }
/* block kb of a 16-output stream */
static inline const uint8_t *q4_block(const uint8_t *w, const int64_t kb, const int kind) {
    return kind == Q4_KS ? q4ks_run(w, kb) : w + kb * kind_bytes(kind);
}
/* where a block's nibbles start: after its d and m (fp16 or fp32), or Q4_KS's sc and mn */
static inline int nibbles_at(const int kind) { return kind == Q4_KS ? 32 : kind == Q4_1 ? 64 : 128; }
/* out's element i: float32 with OUT_F32, else bf16 */
#define OUT_AT(out, i, mode) ((void *)((char *)(out) + (i) * ((mode) == OUT_F32 ? 4 : 2)))

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "simd_bf16.h"
#include "dp_bf16.h"

#define ROWS 4
#define GROUP 4
#define PARALLEL_MIN 65536
/* From this many rows on a call widens each task's blocks once (q4_wide_group) instead of again for
 * every tile of rows; the sums are the same to the bit either way. */
#define WIDE_MIN_ROWS 16
/* Each k block's lines are prefetched into L2 this many k blocks (20 KB) ahead: a core spends
 * ~40 cycles on a block's 320 bytes, too few loads in flight for the hardware prefetchers alone.
 * 2.5 and 5 KB ahead, or into L1, gained less (docs/performance.md). */
#define PREFETCH_BLOCKS 64

enum { OUT_BF16, OUT_F32, OUT_SILU };

int64_t srt_q4_linear_available(void) { return 1; }
int64_t srt_q4k_linear_available(void) { return 1; }
int64_t srt_q5k_linear_available(void) { return 1; }

/* d (which 0) or m (1) of block kb's 16 outputs: fp16 (Q4_1), fp32 (Q4_K, Q5_K), or Q4_KS's D sc
 * (M mn) */
static inline __attribute__((always_inline)) __m512 q4_scale(const uint8_t *w, const int64_t kb, const int which,
                                                             const int kind) {
    const uint8_t *p = q4_block(w, kb, kind);
    if (kind == Q4_KS) {
        const __m512 six = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * which))));
        return _mm512_mul_ps(_mm512_loadu_ps(q4ks_head(w, kb) + 16 * which), six);
    }
    if (kind == Q4_1) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * which)));
    return _mm512_loadu_ps((const float *)(p + 64 * which));
}

/* Chunk c (k 4c .. 4c + 3) of block kb of stream w as two vdpbf16ps operands, 128 + q in bf16
 * (Q5_K: + 16 for the fifth bit), exact: pair[0] k pair 2c of the 16 outputs, pair[1] pair 2c + 1.
 * What q4_tile multiplies and q4_widen_exact stores. */
static inline __attribute__((always_inline)) void q4_operands(const uint8_t *w, const int64_t kb, const int c,
                                                              const int kind, __m512i pair[2]) {
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F), magic = _mm512_set1_epi32(0x43004300);
    const __m512i raw =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q4_block(w, kb, kind) + nibbles_at(kind) + 32 * c)));
    __m512i top[2] = {magic, magic}; /* the bits above each lane's nibble: 128, and Q5_K's 16 */
    if (kind == Q5_K) { /* rotated right by its output's index, a fifth-bit word holds them at bits 4 and 20 */
        const __m512i turn = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const int32_t *bits = (const int32_t *)(w + kb * kind_bytes(kind) + 384) + 2 * c;
        for (int p = 0; p < 2; p++)
            top[p] = _mm512_ternarylogic_epi32(_mm512_rorv_epi32(_mm512_set1_epi32(bits[p]), turn),
                                               _mm512_set1_epi32(0x00100010), magic, 0xEA);
    }
    pair[0] = _mm512_ternarylogic_epi32(raw, nibbles, top[0], 0xEA); /* a & b | c */
    pair[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(raw, 4), nibbles, top[1], 0xEA);
}

/* acc[r][b] = row r of x (rows k apart) times block wb[b] (a 16-output stream of k/32 blocks of
 * 320 bytes (kind Q4_1), Q4_K's 384 (fp32 d and m) or Q5_K's 448 (then the fifth bits));
 * xsum[r * kb_count + kb]: row r's sum of x over k block kb */
static inline __attribute__((always_inline)) void q4_tile(const bf16 *x, int64_t k, const float *xsum,
                                                          const uint8_t *const *wb, const int R, const int NB,
                                                          const int kind, __m512 acc[ROWS][GROUP]) {
    const int64_t blocks = k / 32;
    const int bytes = kind_bytes(kind); /* d, m, nibbles(, bits) */
    const int32_t *xp = (const int32_t *)x; /* a pair of bf16 x values as one 32-bit lane */
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < blocks; kb++) {
        __m512 blk[ROWS][GROUP];
        for (int r = 0; r < R; r++)
            for (int b = 0; b < NB; b++) blk[r][b] = _mm512_setzero_ps();
        for (int b = 0; b < NB; b++) /* past a block's end: the next block's start, or nothing we need */
            for (int l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)(q4_block(wb[b], kb, kind) + PREFETCH_BLOCKS * bytes + l), _MM_HINT_T1);
        for (int c = 0; c < 8; c++) {
            __m512bh xa[ROWS], xb[ROWS];
            for (int r = 0; r < R; r++) {
                xa[r] = (__m512bh)_mm512_set1_epi32(xp[r * (k / 2) + kb * 16 + 2 * c]);
                xb[r] = (__m512bh)_mm512_set1_epi32(xp[r * (k / 2) + kb * 16 + 2 * c + 1]);
            }
            for (int b = 0; b < NB; b++) {
                __m512i pair[2];
                q4_operands(wb[b], kb, c, kind, pair);
                const __m512bh wa = (__m512bh)pair[0], wbh = (__m512bh)pair[1];
                for (int r = 0; r < R; r++) {
                    blk[r][b] = _mm512_dpbf16_ps(blk[r][b], wa, xa[r]);
                    blk[r][b] = _mm512_dpbf16_ps(blk[r][b], wbh, xb[r]);
                }
            }
        }
        for (int b = 0; b < NB; b++) {
            const __m512 d = q4_scale(wb[b], kb, 0, kind), m = q4_scale(wb[b], kb, 1, kind);
            const __m512 m128 = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d, m); /* m - 128 d */
            for (int r = 0; r < R; r++) {
                acc[r][b] = _mm512_fmadd_ps(blk[r][b], d, acc[r][b]);
                acc[r][b] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * blocks + kb]), m128, acc[r][b]);
            }
        }
    }
}

/* R rows of sums -> out (row stride n, its first column at `out`) in bf16 (+ bias), or float32
 * with OUT_F32; OUT_SILU: blocks [0, NB/2) are the gate's and [NB/2, NB) the up projection's, each
 * rounded to bf16 first */
static inline __attribute__((always_inline)) void q4_store(__m512 acc[ROWS][GROUP], const int R, const int NB,
                                                           const bf16 *bias, void *out, int64_t n, const int mode) {
    for (int r = 0; r < R; r++) {
        if (mode == OUT_SILU) {
            for (int b = 0; b < NB / 2; b++)
                store16((bf16 *)out + r * n + 16 * b, silu_mul16(round16(acc[r][b]), round16(acc[r][b + NB / 2])));
            continue;
        }
        for (int b = 0; b < NB; b++) {
            const __m512 v = bias ? _mm512_add_ps(acc[r][b], load16(bias + 16 * b)) : acc[r][b];
            if (mode == OUT_F32)
                _mm512_storeu_ps((float *)out + r * n + 16 * b, v);
            else
                store16((bf16 *)out + r * n + 16 * b, v);
        }
    }
}

static inline __attribute__((always_inline)) void q4_group(const bf16 *x, int64_t m, int64_t k, const float *xsum,
                                                           const uint8_t *const *wb, const int NB, const bf16 *bias,
                                                           void *out, int64_t n, const int mode, const int kind) {
    __m512 acc[ROWS][GROUP];
    int64_t r0 = 0;
    for (; m - r0 >= 4; r0 += 4) {
        const bf16 *xr = x + r0 * k;
        const float *sr = xsum + r0 * (k / 32);
        if (mode == OUT_SILU) {
            for (int h = 0; h < NB / 2; h++) {
                const uint8_t *sub[2] = {wb[h], wb[h + NB / 2]};
                q4_tile(xr, k, sr, sub, 4, 2, kind, acc);
                q4_store(acc, 4, 2, NULL, OUT_AT(out, r0 * n + 16 * h, mode), n, mode);
            }
        } else {
            for (int h = 0; h < NB; h += 2) {
                if (NB - h >= 2) {
                    q4_tile(xr, k, sr, wb + h, 4, 2, kind, acc);
                    q4_store(acc, 4, 2, bias ? bias + 16 * h : NULL, OUT_AT(out, r0 * n + 16 * h, mode), n, mode);
                } else {
                    q4_tile(xr, k, sr, wb + h, 4, 1, kind, acc);
                    q4_store(acc, 4, 1, bias ? bias + 16 * h : NULL, OUT_AT(out, r0 * n + 16 * h, mode), n, mode);
                }
            }
        }
    }
    for (; r0 < m; r0 += 2) {
        const bf16 *xr = x + r0 * k;
        const float *sr = xsum + r0 * (k / 32);
        if (m - r0 >= 2) {
            q4_tile(xr, k, sr, wb, 2, NB, kind, acc);
            q4_store(acc, 2, NB, bias, OUT_AT(out, r0 * n, mode), n, mode);
        } else {
            q4_tile(xr, k, sr, wb, 1, NB, kind, acc);
            q4_store(acc, 1, NB, bias, OUT_AT(out, r0 * n, mode), n, mode);
        }
    }
}

/* One 16-output stream's blocks -> dst as bf16 128 + q (Q5_K: + 16 for the fifth bit), exact, in
 * bf16_pack's order per 32-k block (16 pairs of 16 outputs x 2): the operands q4_tile builds in
 * registers, built once for every row of a call. */
static inline __attribute__((always_inline)) void q4_widen_exact(const uint8_t *w, const int64_t blocks,
                                                                 const int kind, bf16 *dst) {
    for (int64_t kb = 0; kb < blocks; kb++)
        for (int c = 0; c < 8; c++) {
            __m512i pair[2];
            q4_operands(w, kb, c, kind, pair);
            _mm512_storeu_si512(dst + (kb * 16 + 2 * c) * 32, pair[0]);
            _mm512_storeu_si512(dst + (kb * 16 + 2 * c + 1) * 32, pair[1]);
        }
}

/* q4_tile on widened blocks (wide[b]: q4_widen_exact's of stream wb[b]) for up to DP_ROWS rows: per
 * 32-k block the same vdpbf16ps chain per (row, output) and the same two FMAs, so the same bits; the
 * running sums wait in `sums` ([DP_ROWS][DP_GROUP][16]) while the block sums hold the registers. */
static inline __attribute__((always_inline)) void q4_wide_tile(const bf16 *x, int64_t k, const float *xsum,
                                                               const uint8_t *const *wb, const bf16 *const *wide,
                                                               const int R, const int NB, const int kind,
                                                               float *sums) {
    const int64_t blocks = k / 32;
    const int32_t *xp = (const int32_t *)x;
    for (int i = 0; i < DP_ROWS * DP_GROUP * 16; i++) sums[i] = 0.0f;
    for (int64_t kb = 0; kb < blocks; kb++) {
        __m512 blk[DP_ROWS][DP_GROUP];
        for (int r = 0; r < R; r++)
            for (int b = 0; b < NB; b++) blk[r][b] = _mm512_setzero_ps();
        for (int p = 0; p < 16; p++) {
            __m512bh w[DP_GROUP];
            for (int b = 0; b < NB; b++) w[b] = (__m512bh)_mm512_loadu_si512(wide[b] + (kb * 16 + p) * 32);
            for (int r = 0; r < R; r++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[r * (k / 2) + kb * 16 + p]);
                for (int b = 0; b < NB; b++) blk[r][b] = _mm512_dpbf16_ps(blk[r][b], w[b], xv);
            }
        }
        for (int b = 0; b < NB; b++) {
            const __m512 d = q4_scale(wb[b], kb, 0, kind), m = q4_scale(wb[b], kb, 1, kind);
            const __m512 m128 = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d, m); /* m - 128 d */
            for (int r = 0; r < R; r++) {
                float *at = sums + (r * DP_GROUP + b) * 16;
                __m512 acc = _mm512_fmadd_ps(blk[r][b], d, _mm512_loadu_ps(at));
                acc = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * blocks + kb]), m128, acc);
                _mm512_storeu_ps(at, acc);
            }
        }
    }
}

/* q4_group for many rows: the NB blocks wb widened into `scratch` once, then tiles of DP_ROWS rows;
 * stored as q4_store stores */
static inline __attribute__((always_inline)) void q4_wide_group(const bf16 *x, int64_t m, int64_t k,
                                                                const float *xsum, const uint8_t *const *wb,
                                                                const int NB, const bf16 *bias, void *out,
                                                                int64_t n, const int mode, const int kind,
                                                                bf16 *scratch) {
    const int64_t blocks = k / 32;
    const bf16 *wide[DP_GROUP];
    for (int b = 0; b < NB; b++) {
        q4_widen_exact(wb[b], blocks, kind, scratch + b * 16 * k);
        wide[b] = scratch + b * 16 * k;
    }
    float sums[DP_ROWS * DP_GROUP * 16];
    for (int64_t r0 = 0; r0 < m; r0 += DP_ROWS) {
        const int R = m - r0 < DP_ROWS ? (int)(m - r0) : DP_ROWS;
        switch (R) {
#define WIDE(RR)                                                                                \
    case RR: q4_wide_tile(x + r0 * k, k, xsum + r0 * blocks, wb, wide, RR, NB, kind, sums); break;
            WIDE(1) WIDE(2) WIDE(3) WIDE(4) WIDE(5) WIDE(6)
#undef WIDE
        default: break;
        }
        for (int r = 0; r < R; r++) {
            void *o = OUT_AT(out, (r0 + r) * n, mode);
            const float *row = sums + r * DP_GROUP * 16;
            if (mode == OUT_SILU) {
                for (int b = 0; b < NB / 2; b++)
                    store16((bf16 *)o + 16 * b, silu_mul16(round16(_mm512_loadu_ps(row + 16 * b)),
                                                           round16(_mm512_loadu_ps(row + 16 * (b + NB / 2)))));
                continue;
            }
            for (int b = 0; b < NB; b++) {
                const __m512 acc = _mm512_loadu_ps(row + 16 * b);
                const __m512 v = bias ? _mm512_add_ps(acc, load16(bias + 16 * b)) : acc;
                if (mode == OUT_F32)
                    _mm512_storeu_ps((float *)o + 16 * b, v);
                else
                    store16((bf16 *)o + 16 * b, v);
            }
        }
    }
}

/* out[m][n] = x[m][k] @ w.T (+ bias), or with OUT_SILU silu(gate) * up of the [2d, k] gate_up
 * weight into out[m][d] (n = d): each thread a contiguous run of 16-output blocks, GROUP at a time
 * (silu: two gate blocks with their up blocks) */
static void q4_linear(const bf16 *x, int64_t m, const uint8_t *packed, const bf16 *bias, void *out, int64_t n,
                      int64_t k, const int mode, const int kind) {
    const int64_t stride = (k / 32) * kind_bytes(kind), units = n / 16, blocks = k / 32;
    const int64_t step = mode == OUT_SILU ? GROUP / 2 : GROUP;
    float *xsum = malloc((size_t)(m * blocks) * sizeof(float));
    for (int64_t r = 0; r < m; r++)
        for (int64_t kb = 0; kb < blocks; kb++) {
            const bf16 *xr = x + r * k + kb * 32;
            xsum[r * blocks + kb] = _mm512_reduce_add_ps(_mm512_add_ps(load16(xr), load16(xr + 16)));
        }
#pragma omp parallel if (units * k * (m + 8) >= PARALLEL_MIN)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u1 = units * (t + 1) / threads;
        bf16 *scratch = m >= WIDE_MIN_ROWS ? aligned_alloc(64, (size_t)(GROUP * 16 * k) * sizeof(bf16)) : NULL;
        for (int64_t u = units * t / threads; u < u1; u += step) {
            const int64_t left = u1 - u < step ? u1 - u : step;
            const uint8_t *wb[GROUP];
            int nb = 0;
            for (int64_t i = 0; i < left; i++) wb[nb++] = packed + (u + i) * stride;
            if (mode == OUT_SILU)
                for (int64_t i = 0; i < left; i++) wb[nb++] = packed + (units + u + i) * stride;
            void *o = OUT_AT(out, 16 * u, mode);
            const bf16 *b = bias ? bias + 16 * u : NULL;
/* a constant block count and block kind for each instance; widened once for many rows */
#define Q4_KIND(NB, K)                                                                \
    if (scratch)                                                                      \
        q4_wide_group(x, m, k, xsum, wb, NB, b, o, n, mode, K, scratch);              \
    else                                                                              \
        q4_group(x, m, k, xsum, wb, NB, b, o, n, mode, K);
#define Q4_GROUP(NB)                                                                  \
    switch (kind) {                                                                   \
    case Q4_KS: Q4_KIND(NB, Q4_KS) break;                                             \
    case Q5_K: Q4_KIND(NB, Q5_K) break;                                               \
    case Q4_K: Q4_KIND(NB, Q4_K) break;                                               \
    default: Q4_KIND(NB, Q4_1) break;                                                 \
    }
            switch (nb) {
            case 4: Q4_GROUP(4) break;
            case 3: Q4_GROUP(3) break;
            case 2: Q4_GROUP(2) break;
            default: Q4_GROUP(1) break;
            }
#undef Q4_GROUP
#undef Q4_KIND
        }
        free(scratch);
    }
    free(xsum);
}

#define Q4(mode, ...) q4_linear(__VA_ARGS__, mode, Q4_1)
#define Q4K(mode, ...) q4_linear(__VA_ARGS__, mode, Q4_K)
#define Q5K(mode, ...) q4_linear(__VA_ARGS__, mode, Q5_K)
#define Q4KS(mode, ...) q4_linear(__VA_ARGS__, mode, Q4_KS)
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 has no bf16 dot product: the sums are fp32 FMAs of eight outputs' weights against a
 * broadcast x. The same packed layout: zero-extended to 32-bit lanes, a chunk's first 16 bytes are
 * outputs 0..7, each lane q[4c] | q[4c+2] << 4 | q[4c+1] << 8 | q[4c+3] << 12. One mask and one
 * conversion give each k's eight weights as 2^s q (exact); x, widened to fp32 once per call, comes
 * pre-scaled by 2^-s (exact), so each product is x q itself. Per 32 k the block adds
 * d * sum x q + m * sum x. Rows go in tiles of up to four against one 16-output block, whose k / 32
 * blocks stay in L1 or L2 between tiles.
 *
 * srt_q4k_linear takes the same nibbles with fp32 d and m (packing.q4_pack of q4k_recover's
 * blocks, 384 bytes): a GGUF Q4_K sub-block's scale d sc and minimum -dmin m are products of an
 * fp16 and a 6-bit integer, exact in fp32 but not in fp16. srt_q5k_linear (Q5_K, 448 bytes) rotates
 * each fifth-bit word right by the lane's output (two variable shifts), which puts the fifth bits of
 * k 4c and 4c + 1 (or 4c + 2 and 4c + 3) at bits 4 and 20, and moves the second nibble from bit 8 to
 * bit 16: two 5-bit fields a lane, at bits 0 and 16, x pre-scaled by 1 and 2^-16. */
#include <immintrin.h>
#include <omp.h>

#include "simd_avx2.h"

#define ROWS 4
#define SETS 4
#define PARALLEL_MIN 65536
#define PREFETCH_BLOCKS 32 /* ~10 KB ahead, as cpu_q8_linear.c's AVX2 path */

enum { OUT_BF16, OUT_F32, OUT_SILU };

int64_t srt_q4_linear_available(void) { return 1; }
int64_t srt_q4k_linear_available(void) { return 1; }
int64_t srt_q5k_linear_available(void) { return 1; }

/* d (which 0) or m (1) of outputs 8h .. 8h + 7 of block kb: fp16 (Q4_1), fp32 (Q4_K, Q5_K), or
 * Q4_KS's D sc (M mn) */
static inline __attribute__((always_inline)) __m256 q4_scale(const uint8_t *w, const int64_t kb, const int which,
                                                             const int h, const int kind) {
    const uint8_t *p = q4_block(w, kb, kind);
    if (kind == Q4_KS) {
        const __m256 six =
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16 * which + 8 * h))));
        return _mm256_mul_ps(_mm256_loadu_ps(q4ks_head(w, kb) + 16 * which + 8 * h), six);
    }
    if (kind == Q4_1) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 * which + 16 * h)));
    return _mm256_loadu_ps((const float *)(p + 64 * which + 32 * h));
}

/* acc[r][h] = outputs 8h .. 8h + 7 of block stream wb against row r of xs (fp32, pre-scaled as
 * above, rows k apart); xsum[r * k / 32 + kb]: row r's sum of x over k block kb */
static inline __attribute__((always_inline)) void q4_tile(const float *xs, int64_t k, const float *xsum,
                                                          const uint8_t *wb, const int R, const int kind,
                                                          __m256 acc[ROWS][2]) {
    const int64_t blocks = k / 32;
    const int scales = nibbles_at(kind), bytes = kind_bytes(kind); /* d and m, nibbles(, bits) */
    const int S = R == 1 ? 4 : R == 2 ? 2 : 1; /* sums per output: 8 chains of 4-cycle FMAs in flight */
    const __m256i mask[4] = {_mm256_set1_epi32(0x000F), _mm256_set1_epi32(0x0F00), _mm256_set1_epi32(0x00F0),
                             _mm256_set1_epi32(0xF000)};
    /* Q5_K: q[4c] and q[4c + 1] (or q[4c + 2] and q[4c + 3]) as 5-bit fields at bits 0 and 16; a
     * fifth-bit word rotated right by the lane's output holds their fifth bits at bits 4 and 20 */
    const __m256i mask5[2] = {_mm256_set1_epi32(0x1F), _mm256_set1_epi32(0x1F0000)};
    const __m256i first = _mm256_set1_epi32(0xF), second = _mm256_set1_epi32(0xF0000);
    const __m256i fifth = _mm256_set1_epi32(0x100010);
    const __m256i turn[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
    const __m256i back[2] = {_mm256_sub_epi32(_mm256_set1_epi32(32), turn[0]),
                             _mm256_sub_epi32(_mm256_set1_epi32(32), turn[1])};
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < blocks; kb++) {
        const uint8_t *block = q4_block(wb, kb, kind);
        for (int l = 0; l < bytes; l += 64)
            _mm_prefetch((const char *)(block + PREFETCH_BLOCKS * bytes + l), _MM_HINT_T0);
        __m256 blk[ROWS][2][SETS];
        for (int r = 0; r < R; r++)
            for (int s = 0; s < S; s++) blk[r][0][s] = blk[r][1][s] = _mm256_setzero_ps();
        for (int c = 0; c < 8; c++) {
            const uint8_t *chunk = block + scales + 32 * c;
            const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)chunk));
            const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(chunk + 16)));
            __m256i fields[2][2]; /* Q5_K: [outputs 0..7, 8..15][k 4c, 4c + 1 | 4c + 2, 4c + 3] */
            if (kind == Q5_K) {
                const int32_t *bits = (const int32_t *)(block + 384) + 2 * c;
                for (int p = 0; p < 2; p++) { /* p: the k pair */
                    const __m256i word = _mm256_set1_epi32(bits[p]);
                    for (int h = 0; h < 2; h++) {
                        const __m256i fives = _mm256_or_si256(_mm256_srlv_epi32(word, turn[h]),
                                                              _mm256_sllv_epi32(word, back[h])); /* rotated */
                        const __m256i nib = p ? _mm256_srli_epi32(h ? hi : lo, 4) : h ? hi : lo;
                        const __m256i both = _mm256_or_si256(_mm256_and_si256(nib, first),
                                                             _mm256_and_si256(_mm256_slli_epi32(nib, 8), second));
                        fields[h][p] = _mm256_or_si256(both, _mm256_and_si256(fives, fifth));
                    }
                }
            }
            for (int i = 0; i < 4; i++) {
                const __m256 w0 = _mm256_cvtepi32_ps(kind == Q5_K ? _mm256_and_si256(fields[0][i / 2], mask5[i % 2])
                                                                  : _mm256_and_si256(lo, mask[i]));
                const __m256 w1 = _mm256_cvtepi32_ps(kind == Q5_K ? _mm256_and_si256(fields[1][i / 2], mask5[i % 2])
                                                                  : _mm256_and_si256(hi, mask[i]));
                for (int r = 0; r < R; r++) {
                    const __m256 xb = _mm256_broadcast_ss(xs + r * k + kb * 32 + 4 * c + i);
                    blk[r][0][i % S] = _mm256_fmadd_ps(w0, xb, blk[r][0][i % S]);
                    blk[r][1][i % S] = _mm256_fmadd_ps(w1, xb, blk[r][1][i % S]);
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                for (int s = 1; s < S; s++) blk[r][h][0] = _mm256_add_ps(blk[r][h][0], blk[r][h][s]);
        for (int h = 0; h < 2; h++) {
            const __m256 d = q4_scale(wb, kb, 0, h, kind), m = q4_scale(wb, kb, 1, h, kind);
            for (int r = 0; r < R; r++) {
                acc[r][h] = _mm256_fmadd_ps(blk[r][h][0], d, acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[r * blocks + kb]), m, acc[r][h]);
            }
        }
    }
}

/* q4_tile with constant row count and block kind for each instance */
static void q4_rows(const float *xs, int64_t k, const float *xsum, const uint8_t *wb, const int R, const int kind,
                    __m256 acc[ROWS][2]) {
#define Q4_TILE(R)                                                   \
    switch (kind) {                                                  \
    case Q4_KS: q4_tile(xs, k, xsum, wb, R, Q4_KS, acc); break;      \
    case Q5_K: q4_tile(xs, k, xsum, wb, R, Q5_K, acc); break;        \
    case Q4_K: q4_tile(xs, k, xsum, wb, R, Q4_K, acc); break;        \
    default: q4_tile(xs, k, xsum, wb, R, Q4_1, acc); break;          \
    }
    switch (R) {
    case 4: Q4_TILE(4) break;
    case 3: Q4_TILE(3) break;
    case 2: Q4_TILE(2) break;
    default: Q4_TILE(1) break;
    }
#undef Q4_TILE
}

/* every row of x against 16-output block stream wb (and, OUT_SILU, the up block's `up`), R rows a
 * tile; out's first column at `out` (row stride n) */
static void q4_unit(const float *xs, int64_t m, int64_t k, const float *xsum, const uint8_t *wb,
                    const uint8_t *up, const bf16 *bias, void *out, int64_t n, const int mode, const int kind) {
    __m256 acc[ROWS][2], acc_up[ROWS][2];
    const int64_t blocks = k / 32;
    for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        const int R = m - r0 < ROWS ? (int)(m - r0) : ROWS;
        q4_rows(xs + r0 * k, k, xsum + r0 * blocks, wb, R, kind, acc);
        if (mode == OUT_SILU) q4_rows(xs + r0 * k, k, xsum + r0 * blocks, up, R, kind, acc_up);
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) {
                void *o = OUT_AT(out, (r0 + r) * n + 8 * h, mode);
                const __m256 v = bias ? _mm256_add_ps(acc[r][h], load8(bias + 8 * h)) : acc[r][h];
                if (mode == OUT_SILU)
                    store8(o, silu_mul8(round8(acc[r][h]), round8(acc_up[r][h])));
                else if (mode == OUT_F32)
                    _mm256_storeu_ps(o, v);
                else
                    store8(o, v);
            }
    }
}

/* out[m][n] = x[m][k] @ w.T (+ bias), or with OUT_SILU silu(gate) * up of the [2d, k] gate_up
 * weight into out[m][d] (n = d): the 16-output blocks split evenly over the threads */
static void q4_linear(const bf16 *x, int64_t m, const uint8_t *packed, const bf16 *bias, void *out, int64_t n,
                      int64_t k, const int mode, const int kind) {
    const int64_t units = n / 16, blocks = k / 32, stride = blocks * kind_bytes(kind);
    /* k 4c + i's lane shift: Q5_K's fields sit at bits 0 and 16 of two lanes */
    const float scale[4] = {1.0f, kind == Q5_K ? 1.0f / 65536 : 1.0f / 256, kind == Q5_K ? 1.0f : 1.0f / 16,
                            kind == Q5_K ? 1.0f / 65536 : 1.0f / 4096};
    float *xs = malloc((size_t)(m * k) * sizeof(float)), *xsum = malloc((size_t)(m * blocks) * sizeof(float));
    for (int64_t r = 0; r < m; r++)
        for (int64_t kb = 0; kb < blocks; kb++) {
            float v[32], sum = 0.0f;
            for (int i = 0; i < 32; i += 8) _mm256_storeu_ps(v + i, load8(x + r * k + kb * 32 + i));
            for (int i = 0; i < 32; i++) {
                sum += v[i];
                xs[r * k + kb * 32 + i] = v[i] * scale[i % 4];
            }
            xsum[r * blocks + kb] = sum;
        }
#pragma omp parallel for if (units * k * (m + 8) >= PARALLEL_MIN) schedule(static)
    for (int64_t u = 0; u < units; u++)
        q4_unit(xs, m, k, xsum, packed + u * stride, mode == OUT_SILU ? packed + (units + u) * stride : NULL,
                bias ? bias + 16 * u : NULL, OUT_AT(out, 16 * u, mode), n, mode, kind);
    free(xs);
    free(xsum);
}

#define Q4(mode, ...) q4_linear(__VA_ARGS__, mode, Q4_1)
#define Q4K(mode, ...) q4_linear(__VA_ARGS__, mode, Q4_K)
#define Q5K(mode, ...) q4_linear(__VA_ARGS__, mode, Q5_K)
#define Q4KS(mode, ...) q4_linear(__VA_ARGS__, mode, Q4_KS)
#else
int64_t srt_q4_linear_available(void) { return 0; }
int64_t srt_q4k_linear_available(void) { return 0; }
int64_t srt_q5k_linear_available(void) { return 0; }
#define Q4(mode, ...) abort() /* never called: srt_q4_linear_available() answered 0 */
#define Q4K(mode, ...) abort() /* never called: srt_q4k_linear_available() answered 0 */
#define Q5K(mode, ...) abort() /* never called: srt_q5k_linear_available() answered 0 */
#define Q4KS(mode, ...) abort() /* never called: srt_q4k_linear_available() answered 0 */
#endif

/* out[m][n] = x[m][k] @ w.T (+ bias[n]) for the Q4_1 weight packed by packing.q4_pack; x rows
 * contiguous; n % 16 == 0 and k % 32 == 0 (the caller checks) */
void srt_q4_linear(const bf16 *x, int64_t m, const uint8_t *packed, const bf16 *bias, bf16 *out, int64_t n,
                   int64_t k) {
    Q4(OUT_BF16, x, m, packed, bias, out, n, k);
}

/* srt_q4_linear, srt_q4k_linear, srt_q5k_linear or srt_q4ks_linear by `kind` (srt_gguf_linear's:
 * 1 Q4_1, 2 Q4_K, 3 Q5_K, 6 Q4_KS) with the float32 sums (+ bias) in out, unrounded: a product that
 * feeds the residual stream */
void srt_q4_linear_f32(const bf16 *x, int64_t m, const uint8_t *packed, int64_t kind, const bf16 *bias, float *out,
                       int64_t n, int64_t k) {
    if (kind == Q4_KS)
        Q4KS(OUT_F32, x, m, packed, bias, out, n, k);
    else if (kind == Q4_K)
        Q4K(OUT_F32, x, m, packed, bias, out, n, k);
    else if (kind == Q5_K)
        Q5K(OUT_F32, x, m, packed, bias, out, n, k);
    else
        Q4(OUT_F32, x, m, packed, bias, out, n, k);
}

/* act[m][d] = silu(x @ w_gate.T) * (x @ w_up.T) for the packed [2d, k] gate_up weight (gate rows
 * first), without the [m][2d] product: the same values as srt_q4_linear then srt_silu_mul */
void srt_q4_linear_silu(const bf16 *x, int64_t m, const uint8_t *packed, bf16 *act, int64_t d, int64_t k) {
    Q4(OUT_SILU, x, m, packed, NULL, act, d, k);
}

/* srt_q4_linear for a GGUF Q4_K weight: q4_pack of q4k_recover's blocks (fp32 d and m) */
void srt_q4k_linear(const bf16 *x, int64_t m, const uint8_t *packed, const bf16 *bias, bf16 *out, int64_t n,
                    int64_t k) {
    Q4K(OUT_BF16, x, m, packed, bias, out, n, k);
}

/* srt_q4_linear_silu for a GGUF Q4_K gate_up weight */
void srt_q4k_linear_silu(const bf16 *x, int64_t m, const uint8_t *packed, bf16 *act, int64_t d, int64_t k) {
    Q4K(OUT_SILU, x, m, packed, NULL, act, d, k);
}

/* srt_q4_linear for a GGUF Q5_K weight: q5k_pack of q5k_recover's blocks (Q4_K's with a fifth bit) */
void srt_q5k_linear(const bf16 *x, int64_t m, const uint8_t *packed, const bf16 *bias, bf16 *out, int64_t n,
                    int64_t k) {
    Q5K(OUT_BF16, x, m, packed, bias, out, n, k);
}

/* srt_q4_linear_silu for a GGUF Q5_K gate_up weight */
void srt_q5k_linear_silu(const bf16 *x, int64_t m, const uint8_t *packed, bf16 *act, int64_t d, int64_t k) {
    Q5K(OUT_SILU, x, m, packed, NULL, act, d, k);
}

/* srt_q4_linear for a GGUF Q4_K weight with its six-bit scales (packing.q4ks_pack) */
void srt_q4ks_linear(const bf16 *x, int64_t m, const uint8_t *packed, const bf16 *bias, bf16 *out, int64_t n,
                     int64_t k) {
    Q4KS(OUT_BF16, x, m, packed, bias, out, n, k);
}

/* srt_q4_linear_silu for such a gate_up weight */
void srt_q4ks_linear_silu(const bf16 *x, int64_t m, const uint8_t *packed, bf16 *act, int64_t d, int64_t k) {
    Q4KS(OUT_SILU, x, m, packed, NULL, act, d, k);
}
