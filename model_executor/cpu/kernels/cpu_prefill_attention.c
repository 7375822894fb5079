/* Causal prefill attention: AMX tiles where this process was granted them (cpu_amx.c), else AVX-512
 * BF16 (vdpbf16ps) as two products on dp_bf16.h's register tile.
 *
 * A task is (request, kv head, chunk of up to QUERY_CHUNK new tokens). Its rows are the chunk's
 * queries for each query head of the group, (query, head) in that order, so the group's heads
 * share each K and V line. The keys the chunk can see (the request's cached prefix, then its new
 * tokens up to the chunk's last) are laid out once as a bf16_pack'd weight of 16-key blocks (K
 * rows, dims in pairs) and V transposed the same way (16-dim blocks, keys in pairs). Then
 *   S = Q K^T in fp32, skipping each 6-row tile's key groups past its last query's position;
 *   P = exp(scale * (s - row max)) rounded to bf16 (as flash attention's second product), zero past
 *       the row's last key, and the row's sum of the unrounded values;
 *   O = P V over each tile's visible keys, divided by the row's sum, rounded to bf16.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "srt_kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "simd_bf16.h"
#include "dp_bf16.h"
#include "prefill_tasks.h"

#define QUERY_CHUNK 64

int64_t srt_dp_prefill_attention_available(void) { return 1; }

typedef struct {
    bf16 *q;      /* [rows][d]: the task's query rows, contiguous */
    bf16 *kt;     /* [key block][d/2 pairs][16 keys][2] */
    bf16 *vt;     /* [d/16 dim blocks][kpad/2 key pairs][16 dims][2] */
    float *s;     /* [rows][kpad] scores */
    bf16 *p;      /* [rows][kpad] probabilities, zero past each row's keys */
    float *o;     /* [rows][d] */
    float *inv;   /* [rows] 1 / the row's sum */
} scratch;

/* R rows of fp32 sums -> out (row stride n), unrounded */
static inline __attribute__((always_inline)) void store_raw(__m512 acc[DP_ROWS][DP_GROUP], const int R, const int NB,
                                                            float *out, int64_t n) {
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(out + r * n + 16 * b, acc[r][b]);
}

/* out rows [0, rows) (stride n) = x rows (stride x_stride) times the blocks of w (a block of 16
 * outputs is `block` values: k / 2 lines) for outputs [0, 16 * blocks); each 6-row tile sums over
 * the first ceil(visible(tile) / 2) pairs of k and skips the output groups at or past visible(tile)
 * when `causal_cols` (S: outputs are keys), where visible(tile) is the keys its last row sees */
static void dp_product(const bf16 *x, int64_t x_stride, int64_t rows, const bf16 *w, int64_t block, int64_t blocks,
                       float *out, int64_t n, int64_t group, int64_t first_visible, int64_t full_pairs,
                       const int causal_cols) {
    __m512 acc[DP_ROWS][DP_GROUP];
    for (int64_t b0 = 0; b0 < blocks; b0 += DP_GROUP) {
        const int64_t nb = blocks - b0 < DP_GROUP ? blocks - b0 : DP_GROUP;
        const bf16 *wb[DP_GROUP];
        for (int64_t i = 0; i < nb; i++) wb[i] = w + (b0 + i) * block;
        for (int64_t r0 = 0; r0 < rows; r0 += DP_ROWS) {
            const int64_t R = rows - r0 < DP_ROWS ? rows - r0 : DP_ROWS;
            const int64_t visible = first_visible + (r0 + R - 1) / group; /* keys the tile's last row sees */
            if (causal_cols && 16 * b0 >= visible) continue;            /* every score here is masked */
            const int64_t pairs = causal_cols ? full_pairs : (visible + 1) / 2;
            const bf16 *xr = x + r0 * x_stride;
            float *o = out + r0 * n + 16 * b0;
#define TILE(RR, NBB)                                                                  \
    case RR * 8 + NBB:                                                                 \
        dp_tile(xr, x_stride, pairs, wb, RR, NBB, acc, NULL, 0, 0);                    \
        store_raw(acc, RR, NBB, o, n);                                                 \
        break;
#define TILES(RR) TILE(RR, 1) TILE(RR, 2) TILE(RR, 3) TILE(RR, 4)
            switch (R * 8 + nb) {
                TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)
            default: break;
            }
#undef TILES
#undef TILE
        }
    }
}

static void dp_prefill_task(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *v,
                            int64_t v_stride, bf16 *out, int64_t start, int64_t kstart, int64_t n, int64_t prefix,
                            int64_t c0, int64_t kvh, int64_t hq, int64_t G, int64_t d, float scale, scratch *sc) {
    const int64_t c1 = c0 + QUERY_CHUNK < n ? c0 + QUERY_CHUNK : n; /* new tokens [c0, c1) */
    const int64_t nk = prefix + c1, kblocks = (nk + 15) / 16, kp = kblocks * 16, pairs = d / 2;
    const int64_t rows = (c1 - c0) * G;
    /* Q rows (query i, head g) -> row i * G + g */
    for (int64_t i = c0; i < c1; i++)
        memcpy(sc->q + (i - c0) * G * d, q + (start + i) * q_stride + kvh * G * d, (size_t)(G * d) * sizeof(bf16));
    /* K: kt[kb][p][j] = dims 2p, 2p + 1 of key 16 kb + j (as one 32-bit value); zero past nk */
    uint32_t *kt = (uint32_t *)sc->kt;
    for (int64_t kb = 0; kb < kblocks; kb++)
        for (int64_t j = 0; j < 16; j++) {
            const int64_t key = kb * 16 + j;
            const uint32_t *kr = (const uint32_t *)(k + (kstart + key) * k_stride + kvh * d);
            for (int64_t p = 0; p < pairs; p++) kt[(kb * pairs + p) * 16 + j] = key < nk ? kr[p] : 0;
        }
    /* V: vt[db][t][i] = dim 16 db + i of keys 2t and 2t + 1, interleaved; zero past nk */
    for (int64_t t = 0; t < kp / 2; t++)
        for (int64_t c = 0; c < d / 32; c++) {
            const int64_t key = 2 * t;
            __m512i e = _mm512_setzero_si512(), o = e;
            if (key < nk) e = _mm512_loadu_si512(v + (kstart + key) * v_stride + kvh * d + 32 * c);
            if (key + 1 < nk) o = _mm512_loadu_si512(v + (kstart + key + 1) * v_stride + kvh * d + 32 * c);
            __m512i lo, hi;
            interleave32(e, o, &lo, &hi);
            _mm512_storeu_si512(sc->vt + (2 * c) * 16 * kp + t * 32, lo);
            _mm512_storeu_si512(sc->vt + (2 * c + 1) * 16 * kp + t * 32, hi);
        }
    const int64_t first_visible = prefix + c0 + 1; /* keys row 0 (the chunk's first query) sees */
    dp_product(sc->q, d, rows, sc->kt, 16 * d, kblocks, sc->s, kp, G, first_visible, pairs, 1);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = first_visible + r / G;
        const float *sr = sc->s + r * kp;
        bf16 *pr = sc->p + r * kp;
        const __m512 shift = _mm512_set1_ps(-scale * max16(sr, len));
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t t = 0; t < kp; t += 16) {
            const __mmask16 m = lanes16(len - t);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, sr + t), vscale, shift)));
            vsum = _mm512_add_ps(vsum, e);
            store16(pr + t, e);
        }
        sc->inv[r] = 1.0f / _mm512_reduce_add_ps(vsum);
    }
    dp_product(sc->p, kp, rows, sc->vt, 16 * kp, d / 16, sc->o, d, G, first_visible, 0, 0);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = c0 + r / G, head = kvh * G + r % G;
        const __m512 inv = _mm512_set1_ps(sc->inv[r]);
        bf16 *orow = out + (start + i) * hq * d + head * d;
        for (int64_t j = 0; j < d; j += 16) store16(orow + j, _mm512_mul_ps(_mm512_loadu_ps(sc->o + r * d + j), inv));
    }
}

static void dp_prefill_attention(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *v,
                                 int64_t v_stride, bf16 *out, const int64_t *starts, const int64_t *kstarts,
                                 const int64_t *lens, const int64_t *prefixes, int64_t bs, int64_t hq, int64_t hkv,
                                 int64_t d, float scale) {
    int64_t max_keys;
    const int64_t tasks = prefill_chunks(lens, prefixes, bs, QUERY_CHUNK, &max_keys);
    const int64_t G = hq / hkv, kpad = (max_keys + 15) / 16 * 16, rows = QUERY_CHUNK * G;
#pragma omp parallel
    {
        scratch sc;
        sc.q = aligned_alloc(64, (size_t)(rows * d) * sizeof(bf16));
        sc.kt = aligned_alloc(64, (size_t)(kpad * d) * sizeof(bf16));
        sc.vt = aligned_alloc(64, (size_t)(kpad * d) * sizeof(bf16));
        sc.s = aligned_alloc(64, (size_t)(rows * kpad) * sizeof(float));
        sc.p = aligned_alloc(64, (size_t)(rows * kpad) * sizeof(bf16));
        sc.o = aligned_alloc(64, (size_t)(rows * d) * sizeof(float));
        sc.inv = aligned_alloc(64, (size_t)((rows + 15) / 16 * 16) * sizeof(float));
        /* tasks: (request, query chunk, kv head) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks * hkv; t++) {
            int64_t c0;
            const int64_t b = prefill_chunk_request(lens, QUERY_CHUNK, t / hkv, &c0);
            dp_prefill_task(q, q_stride, k, k_stride, v, v_stride, out, starts[b], kstarts[b], lens[b], prefixes[b],
                            c0, t % hkv, hq, G, d, scale, &sc);
        }
        free(sc.q);
        free(sc.kt);
        free(sc.vt);
        free(sc.s);
        free(sc.p);
        free(sc.o);
        free(sc.inv);
    }
}
#define DP_ATTENTION(...) dp_prefill_attention(__VA_ARGS__)
#else
int64_t srt_dp_prefill_attention_available(void) { return 0; }
#define DP_ATTENTION(...) abort() /* never called: srt_dp_prefill_attention_available() answered 0 */
#endif

/* Causal attention of bs requests' new tokens, packed one after another: request b's lens[b]
 * queries are q rows starts[b] .., and its prefixes[b] + lens[b] keys (its cached prefix, then its
 * new tokens) k/v rows kstarts[b] ..; new token i sees keys [0, prefixes[b] + i]. Rows strided
 * (heads contiguous), out [new tokens, hq * d] contiguous. d 64 or 128, hq a multiple of hkv (the
 * caller checks). */
void srt_prefill_attention(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *v,
                           int64_t v_stride, bf16 *out, const int64_t *starts, const int64_t *kstarts,
                           const int64_t *lens, const int64_t *prefixes, int64_t bs, int64_t hq, int64_t hkv,
                           int64_t d, float scale) {
    if (srt_amx_granted())
        srt_amx_prefill_attention(q, q_stride, k, k_stride, v, v_stride, out, starts, kstarts, lens, prefixes, bs, hq,
                                  hkv, d, scale);
    else
        DP_ATTENTION(q, q_stride, k, k_stride, v, v_stride, out, starts, kstarts, lens, prefixes, bs, hq, hkv, d,
                     scale);
}
