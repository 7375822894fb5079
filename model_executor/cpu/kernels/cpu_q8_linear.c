/* The LM head on a GGUF file's Q8_0 token embedding (--quantization gguf; SmolLM2 ties the two):
 * each run of 32 weights along k is an int8 q in -127..127 with an fp16 scale d, w = d q. A decode
 * step at batch 1 streams the whole head once: 1.0625 bytes a weight against bf16's 2 (SmolLM2:
 * 30 MB for 57).
 *
 * Dot products with AVX-512 VNNI (vpdpbusd: four u8 x s8 products into each int32 lane). The weights
 * go in as q + 128 (u8). Each 32-value block of a row of x becomes 16-bit integers,
 * x16 = round(x * X16_MAX / amax) with scale dx = amax / X16_MAX, split in two int8 halves,
 * x16 = 256 hi + lo (hi = (x16 + 128) >> 8, lo in -128..127), so that
 *   sum_k q x16 = 256 sum (q + 128) hi + sum (q + 128) lo - 128 sum x16
 * exactly in int32, and the block adds d dx times that. The weights are exact; each x is off by at
 * most amax / 65278, against the 2^-9 of its own value that rounding a weight to bf16 costs.
 *
 * Packed by packing.q8_pack as [n/16][k/32][544 bytes]: per 16 outputs and 32 k, the 16 d (fp16), then
 * 8 chunks of 64 bytes, chunk c byte 4j + i = q[j][4c + i] + 128: lane j of a vpdpbusd operand.
 * Rows go in tiles of two against four 16-output blocks, as in cpu_q4_linear.c.
 *
 * GGUF Q6_K layers run here too (srt_q6k_linear): each run of 16 weights along k is float32(D q) with
 * q in -32..31 and D = d sc (an fp16 times an int8, exact in fp32). Their layout (q8_pack with fp32
 * scales) is [n/16][k/32][640 bytes]: the 16 outputs' D for k 0..15 and then for k 16..31 (32 fp32),
 * then the same 512 bytes of q + 128. Chunks 0..3 (k 0..15) and 4..7 (k 16..31) are summed apart,
 * each half with its own scale and its own correction term. The q6k argument of the functions below
 * is a constant in each instance, so the Q8_0 instances keep their one pass over the 8 chunks (and
 * give the same bits: the int sum of x16 is kept per 16 k and added back).
 *
 * Q6_K as the file holds its scales (srt_q6ks_linear, packing.q6ks_pack; AVX-512 only) takes 0.83
 * bytes a weight against those 1.25: per 16 outputs and 256 k the 16 fp32 D, then for each run of
 * 32 k its 32 int8 sc and 8 chunks of 48 bytes, the six bits of q + 32 (gguf_widen.h's q6ks_chunk
 * widens one to the 64 bytes above, less 96). A run's scale is D sc, exact in fp32; the correction
 * is 32 sum x16; so the sums are srt_q6k_linear's to the bit.
 */
#include <stdint.h>
#include <stdlib.h>

#include "srt_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include <omp.h>

#include "simd_bf16.h"
#include "gguf_widen.h"

#define ROWS 2
#define GROUP 4
#define BLOCK_BYTES 544    /* 16 outputs x 32 k: 32 bytes of d, 512 of q + 128 */
#define Q6K_BLOCK_BYTES 640 /* the same with 128 bytes of fp32 D, two per output */
#define PARALLEL_MIN 65536
#define PREFETCH_BLOCKS 40 /* ~20 KB ahead into L2, as cpu_q4_linear.c */
#define X16_MAX 32639.0f   /* (X16_MAX + 128) >> 8 = 127: hi stays an int8 */

int64_t srt_q8_linear_available(void) { return 1; }
int64_t srt_q6ks_linear_available(void) { return 1; }

enum { Q8_0, Q6_K, Q6_KS }; /* the layouts: q8_pack's with fp16 d, with Q6_K's fp32 D, q6ks_pack's */
static inline int layout_bytes(const int layout) {
    return (int)gguf_block_bytes(layout == Q8_0 ? GGUF_Q8_0 : layout == Q6_K ? GGUF_Q6_K : GGUF_Q6_KS);
}
/* block kb of a 16-output stream: its scales, then its chunks */
static inline const uint8_t *q8_block(const uint8_t *w, const int64_t kb, const int layout) {
    return layout == Q6_KS ? q6ks_run(w, kb) : w + kb * layout_bytes(layout);
}

/* Row r's block kb of x (k values a row) -> hi and lo (int8, k a row), dx and the int sums of x16 over
 * k 0..15 and 16..31 (sum16[2 (r blocks + kb)] and the next) */
static void x16_split(const bf16 *x, int64_t m, int64_t k, int8_t *hi, int8_t *lo, float *dx, int32_t *sum16) {
    const int64_t blocks = k / 32;
    const __m512i c128 = _mm512_set1_epi32(128);
    for (int64_t r = 0; r < m; r++)
        for (int64_t kb = 0; kb < blocks; kb++) {
            const int64_t at = r * k + kb * 32;
            const __m512 a = load16(x + at), b = load16(x + at + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            const __m512 scale = _mm512_set1_ps(amax > 0 ? X16_MAX / amax : 0.0f);
            dx[r * blocks + kb] = amax / X16_MAX;
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, scale)); /* nearest even */
            const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, scale));
            sum16[2 * (r * blocks + kb)] = _mm512_reduce_add_epi32(qa);
            sum16[2 * (r * blocks + kb) + 1] = _mm512_reduce_add_epi32(qb);
            const __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(qa, c128), 8);
            const __m512i hb = _mm512_srai_epi32(_mm512_add_epi32(qb, c128), 8);
            _mm_storeu_si128((__m128i *)(hi + at), _mm512_cvtepi32_epi8(ha));
            _mm_storeu_si128((__m128i *)(hi + at + 16), _mm512_cvtepi32_epi8(hb));
            _mm_storeu_si128((__m128i *)(lo + at), _mm512_cvtepi32_epi8(_mm512_sub_epi32(qa, _mm512_slli_epi32(ha, 8))));
            _mm_storeu_si128((__m128i *)(lo + at + 16), _mm512_cvtepi32_epi8(_mm512_sub_epi32(qb, _mm512_slli_epi32(hb, 8))));
        }
}

/* acc[r][b] = row r (rows k apart) times block stream wb[b] of `layout` (Q6_K's two halves a block) */
static inline __attribute__((always_inline)) void q8_tile(const int8_t *hi, const int8_t *lo, int64_t k,
                                                          const float *dx, const int32_t *sum16,
                                                          const uint8_t *const *wb, const int R, const int NB,
                                                          const int layout, __m512 acc[ROWS][GROUP]) {
    const int64_t blocks = k / 32;
    const int q6k = layout != Q8_0, bytes = layout_bytes(layout), halves = q6k ? 2 : 1;
    const int scales = layout == Q6_K ? 128 : 32, bias = layout == Q6_KS ? 32 : 128; /* q + bias, u8 */
    const int32_t *hp = (const int32_t *)hi, *lp = (const int32_t *)lo; /* four int8 x as one lane */
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < blocks; kb++) {
        for (int b = 0; b < NB; b++)
            for (int l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)(q8_block(wb[b], kb, layout) + PREFETCH_BLOCKS * bytes + l), _MM_HINT_T1);
        for (int h = 0; h < halves; h++) { /* Q8_0: chunks 0..7 at once; Q6_K: 0..3, then 4..7 */
            __m512i sh[ROWS][GROUP], sl[ROWS][GROUP];
            for (int r = 0; r < R; r++)
                for (int b = 0; b < NB; b++) sh[r][b] = sl[r][b] = _mm512_setzero_si512();
            for (int c = 8 / halves * h; c < 8 / halves * (h + 1); c++) {
                __m512i xh[ROWS], xl[ROWS];
                for (int r = 0; r < R; r++) {
                    xh[r] = _mm512_set1_epi32(hp[r * (k / 4) + kb * 8 + c]);
                    xl[r] = _mm512_set1_epi32(lp[r * (k / 4) + kb * 8 + c]);
                }
                for (int b = 0; b < NB; b++) {
                    const uint8_t *block = q8_block(wb[b], kb, layout);
                    const __m512i w = layout == Q6_KS ? q6ks_chunk(block + 32 + 48 * c)
                                                      : _mm512_loadu_si512((const void *)(block + scales + 64 * c));
                    for (int r = 0; r < R; r++) {
                        sh[r][b] = _mm512_dpbusd_epi32(sh[r][b], w, xh[r]);
                        sl[r][b] = _mm512_dpbusd_epi32(sl[r][b], w, xl[r]);
                    }
                }
            }
            for (int b = 0; b < NB; b++) {
                const uint8_t *s = q8_block(wb[b], kb, layout);
                const __m512 d =
                    layout == Q6_KS ? _mm512_mul_ps(_mm512_loadu_ps(q6ks_head(wb[b], kb)),
                                                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(s + 16 * h)))))
                    : q6k ? _mm512_loadu_ps((const float *)s + 16 * h)
                          : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
                for (int r = 0; r < R; r++) {
                    const int32_t *x_sums = sum16 + 2 * (r * blocks + kb);
                    const int32_t x_sum = q6k ? x_sums[h] : x_sums[0] + x_sums[1];
                    const __m512i t = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(sh[r][b], 8), sl[r][b]),
                                                       _mm512_set1_epi32(bias * x_sum));
                    acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t),
                                                _mm512_mul_ps(d, _mm512_set1_ps(dx[r * blocks + kb])), acc[r][b]);
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void q8_group(const int8_t *hi, const int8_t *lo, int64_t m, int64_t k,
                                                           const float *dx, const int32_t *sum16,
                                                           const uint8_t *const *wb, const int NB, const int layout,
                                                           float *out, int64_t n) {
    __m512 acc[ROWS][GROUP];
    const int64_t blocks = k / 32;
    for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        const int R = m - r0 >= 2 ? 2 : 1;
        if (R == 2)
            q8_tile(hi + r0 * k, lo + r0 * k, k, dx + r0 * blocks, sum16 + 2 * r0 * blocks, wb, 2, NB, layout, acc);
        else
            q8_tile(hi + r0 * k, lo + r0 * k, k, dx + r0 * blocks, sum16 + 2 * r0 * blocks, wb, 1, NB, layout, acc);
        for (int r = 0; r < R; r++)
            for (int b = 0; b < NB; b++) _mm512_storeu_ps(out + (r0 + r) * n + 16 * b, acc[r][b]);
    }
}

static void q8_linear(const bf16 *x, int64_t m, const uint8_t *packed, float *out, int64_t n, int64_t k,
                      const int layout) {
    const int64_t stride = (k / 32) * layout_bytes(layout), units = n / 16, blocks = k / 32;
    int8_t *hi = malloc((size_t)(2 * m * k)), *lo = hi + m * k;
    float *dx = malloc((size_t)(m * blocks) * sizeof(float));
    int32_t *sum16 = malloc((size_t)(2 * m * blocks) * sizeof(int32_t));
    x16_split(x, m, k, hi, lo, dx, sum16);
#pragma omp parallel if (units * k * (m + 8) >= PARALLEL_MIN)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u1 = units * (t + 1) / threads;
        for (int64_t u = units * t / threads; u < u1; u += GROUP) {
            const int64_t left = u1 - u < GROUP ? u1 - u : GROUP;
            const uint8_t *wb[GROUP];
            for (int64_t i = 0; i < left; i++) wb[i] = packed + (u + i) * stride;
/* a constant block count and layout for each instance */
#define Q8_GROUP(NB)                                                                    \
    switch (layout) {                                                                   \
    case Q6_KS: q8_group(hi, lo, m, k, dx, sum16, wb, NB, Q6_KS, out + 16 * u, n); break; \
    case Q6_K: q8_group(hi, lo, m, k, dx, sum16, wb, NB, Q6_K, out + 16 * u, n); break;   \
    default: q8_group(hi, lo, m, k, dx, sum16, wb, NB, Q8_0, out + 16 * u, n); break;     \
    }
            switch (left) {
            case 4: Q8_GROUP(4) break;
            case 3: Q8_GROUP(3) break;
            case 2: Q8_GROUP(2) break;
            default: Q8_GROUP(1) break;
            }
#undef Q8_GROUP
        }
    }
    free(hi);
    free(dx);
    free(sum16);
}

#define Q8(...) q8_linear(__VA_ARGS__)
#define Q6KS(...) q8_linear(__VA_ARGS__, Q6_KS)
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 has no vpdpbusd, and vpmaddubsw's u8 x s8 pair sums saturate at 32767, so q + 128 cannot go
 * in unsigned as above. Instead each weight goes in as |q| (u8, q = byte - 128 in -127..127) against
 * x's part with q's sign (vpsignb), which keeps every pair sum within 2 x 127 x 127; x16 is split in
 * base 254, x16 = 254 hi + lo with |hi|, |lo| <= 127, so that flipping a part's sign never wraps. Then
 *   sum_k q x16 = 254 sum q hi + sum q lo
 * exactly in int32; the block adds d dx times that. Each x is off by at most amax / 64516. The same
 * packed layout: a chunk's first 32 bytes are outputs 0..7 of a 16-output block (one per 32-bit
 * lane), the next 32 outputs 8..15. One row at a time against each 16-output block, whose k / 32
 * blocks stay in L1 between rows. Q6_K's layout the same way, its two halves of a block summed apart. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>

#include "simd_avx2.h"

#define BLOCK_BYTES 544
#define Q6K_BLOCK_BYTES 640
#define PARALLEL_MIN 65536
#define PREFETCH_BLOCKS 20
#define X16_MAX 32258.0f /* 127 x 254 */

int64_t srt_q8_linear_available(void) { return 1; }

/* Row r's block kb of x -> hi and lo (int8, k a row) and dx */
static void x254_split(const bf16 *x, int64_t m, int64_t k, int8_t *hi, int8_t *lo, float *dx) {
    const int64_t blocks = k / 32;
    for (int64_t r = 0; r < m; r++)
        for (int64_t kb = 0; kb < blocks; kb++) {
            const int64_t at = r * k + kb * 32;
            float v[32], amax = 0.0f;
            for (int i = 0; i < 32; i += 8) _mm256_storeu_ps(v + i, load8(x + at + i)); /* exact */
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
            const float scale = amax > 0 ? X16_MAX / amax : 0.0f;
            dx[r * blocks + kb] = amax / X16_MAX;
            for (int i = 0; i < 32; i++) {
                const int q = (int)lrintf(v[i] * scale); /* nearest even, |q| <= 32258 */
                const int h = q >= 0 ? (q + 127) / 254 : -((127 - q) / 254);
                hi[at + i] = (int8_t)h;
                lo[at + i] = (int8_t)(q - 254 * h);
            }
        }
}

/* out[0..15] of one row (x split in hi, lo, dx) against one 16-output block stream wb; q6k: Q6_K's
 * layout, the block's k 0..15 and 16..31 each with its own scales. h is the half of the 16 outputs, kh
 * the half of k. */
static inline __attribute__((always_inline)) void q8_row_block(const int8_t *hi, const int8_t *lo, int64_t k,
                                                               const float *dx, const uint8_t *wb, const int q6k,
                                                               float *out) {
    const int64_t blocks = k / 32;
    const int bytes = q6k ? Q6K_BLOCK_BYTES : BLOCK_BYTES, scales = q6k ? 128 : 32, halves = q6k ? 2 : 1;
    const int32_t *hp = (const int32_t *)hi, *lp = (const int32_t *)lo; /* four int8 x as one lane */
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t kb = 0; kb < blocks; kb++) {
        const uint8_t *block = wb + kb * bytes;
        for (int l = 0; l < bytes; l += 64)
            _mm_prefetch((const char *)(block + PREFETCH_BLOCKS * bytes + l), _MM_HINT_T0);
        const __m256 scale = _mm256_set1_ps(dx[kb]);
        for (int kh = 0; kh < halves; kh++) { /* Q8_0: chunks 0..7 at once; Q6_K: 0..3, then 4..7 */
            __m256i sh[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            __m256i sl[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int c = 8 / halves * kh; c < 8 / halves * (kh + 1); c++) {
                const __m256i xh = _mm256_set1_epi32(hp[kb * 8 + c]), xl = _mm256_set1_epi32(lp[kb * 8 + c]);
                for (int h = 0; h < 2; h++) {
                    const __m256i q = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(block + scales + 64 * c + 32 * h)), flip);
                    const __m256i a = _mm256_abs_epi8(q);
                    sh[h] = _mm256_add_epi32(sh[h], _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(xh, q)), ones));
                    sl[h] = _mm256_add_epi32(sl[h], _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(xl, q)), ones));
                }
            }
            for (int h = 0; h < 2; h++) {
                const __m256 d = q6k ? _mm256_loadu_ps((const float *)block + 16 * kh + 8 * h)
                                     : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16 * h)));
                const __m256i t = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(sh[h], 8), _mm256_slli_epi32(sh[h], 1)), sl[h]);
                acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, scale), acc[h]);
            }
        }
    }
    _mm256_storeu_ps(out, acc[0]);
    _mm256_storeu_ps(out + 8, acc[1]);
}

/* the row-block loop for one layout: q6k a constant here, so each layout has its own inner loop */
static void q8_blocks(const int8_t *hi, const int8_t *lo, int64_t m, int64_t k, const float *dx,
                      const uint8_t *packed, float *out, int64_t n, const int q6k) {
    const int64_t units = n / 16, blocks = k / 32, stride = blocks * (q6k ? Q6K_BLOCK_BYTES : BLOCK_BYTES);
#pragma omp parallel for if (units * k * (m + 8) >= PARALLEL_MIN) schedule(static)
    for (int64_t u = 0; u < units; u++)
        for (int64_t r = 0; r < m; r++)
            if (q6k)
                q8_row_block(hi + r * k, lo + r * k, k, dx + r * blocks, packed + u * stride, 1, out + r * n + 16 * u);
            else
                q8_row_block(hi + r * k, lo + r * k, k, dx + r * blocks, packed + u * stride, 0, out + r * n + 16 * u);
}

static void q8_linear(const bf16 *x, int64_t m, const uint8_t *packed, float *out, int64_t n, int64_t k,
                      const int q6k) {
    int8_t *hi = malloc((size_t)(2 * m * k)), *lo = hi + m * k;
    float *dx = malloc((size_t)(m * (k / 32)) * sizeof(float));
    x254_split(x, m, k, hi, lo, dx);
    q8_blocks(hi, lo, m, k, dx, packed, out, n, q6k);
    free(hi);
    free(dx);
}

#define Q8(...) q8_linear(__VA_ARGS__)
int64_t srt_q6ks_linear_available(void) { return 0; }
#define Q6KS(...) abort() /* never called: srt_q6ks_linear_available() answered 0 */
#else
int64_t srt_q8_linear_available(void) { return 0; }
int64_t srt_q6ks_linear_available(void) { return 0; }
#define Q8(...) abort() /* never called: srt_q8_linear_available() answered 0 */
#define Q6KS(...) abort() /* never called: srt_q6ks_linear_available() answered 0 */
#endif

/* out[m][n] (float32) = x[m][k] @ w.T for the Q8_0 weight packed by packing.q8_pack; x rows contiguous;
 * n % 16 == 0 and k % 32 == 0 (the caller checks) */
void srt_q8_linear(const bf16 *x, int64_t m, const uint8_t *packed, float *out, int64_t n, int64_t k) {
    Q8(x, m, packed, out, n, k, 0);
}

/* the same for the Q6_K weight packed by packing.q8_pack with fp32 scales (640 bytes a block) */
void srt_q6k_linear(const bf16 *x, int64_t m, const uint8_t *packed, float *out, int64_t n, int64_t k) {
    Q8(x, m, packed, out, n, k, 1);
}

/* the same for the Q6_K weight packed by packing.q6ks_pack (the file's int8 scales, 424 bytes a
 * block on average): srt_q6k_linear's bits */
void srt_q6ks_linear(const bf16 *x, int64_t m, const uint8_t *packed, float *out, int64_t n, int64_t k) {
    Q6KS(x, m, packed, out, n, k);
}
