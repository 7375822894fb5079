/* The AVX-512 BF16 register tile that cpu_bf16_linear.c's linears and cpu_prefill_attention.c's
 * two products share: R <= DP_ROWS rows of x times NB <= DP_GROUP blocks of 16 outputs of a weight
 * in bf16_pack's order, one vdpbf16ps per (row, block, k pair), sums in fp32 registers. Included
 * after simd_bf16.h, inside #if defined(__AVX512BF16__). */
#ifndef SRT_DP_BF16_H
#define SRT_DP_BF16_H

#define DP_ROWS 6  /* rows per register tile: 6 x 4 sums + 4 weight lines + 1 broadcast of 32 registers */
#define DP_GROUP 4 /* 16-output blocks per tile */

/* acc[r][b] = row r of x (rows x_stride values apart) times weight block wb[b], over k pairs
 * [0, pairs): block b's line for pair p is wb[b] + 32 p (16 outputs x 2). Meanwhile one line per
 * pair of each block pf[pf0 .. pf1) is prefetched into L2 (pf: NULL with pf0 == pf1). */
static inline __attribute__((always_inline)) void dp_tile(const bf16 *x, int64_t x_stride, int64_t pairs,
                                                          const bf16 *const *wb, const int R, const int NB,
                                                          __m512 acc[DP_ROWS][DP_GROUP], const bf16 *const *pf,
                                                          int64_t pf0, int64_t pf1) {
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();
    const int32_t *xp = (const int32_t *)x; /* a pair of bf16 x values as one 32-bit lane */
    const int64_t row_pairs = x_stride / 2;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh w[DP_GROUP];
        for (int b = 0; b < NB; b++) w[b] = (__m512bh)_mm512_loadu_si512(wb[b] + p * 32);
        for (int64_t b = pf0; b < pf1; b++) _mm_prefetch((const char *)(pf[b] + p * 32), _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[r * row_pairs + p]);
            for (int b = 0; b < NB; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], w[b], xv);
        }
    }
}
#endif
