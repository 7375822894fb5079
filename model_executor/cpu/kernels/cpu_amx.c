/* bf16 linear layers on Intel AMX tiles, for the small row counts of decode steps.
 *
 * At a decode step's few rows a linear layer is a stream of its weight from memory. oneDNN's AMX
 * GEMM streams weights that are not in cache well under the machine's read bandwidth (measured on
 * SmolLM2's layers): this kernel streams the weight in the order the tiles consume it, prefetches
 * a few tiles ahead, and reaches the bandwidth (figures in docs/performance.md).
 *
 * The weight is packed once at load (model_executor/cpu/kernels/packing.py, bf16_pack) as
 * [n/16][k/32][16][16][2]: for each block of 16 outputs, each 32-wide slice of k is one B tile of
 * 16 rows (pairs of k) x 16 columns (outputs) x 2, contiguous, 1 KiB. The math is fp32 in the
 * tiles; outputs are rounded to bf16 (round to nearest even) after the bias is added.
 *
 * Built with the rest of the CPU kernels (-march=native). Without AMX in the compiler's target,
 * srt_amx_init() answers 0 and the bf16 linears run on AVX-512 BF16 (cpu_bf16_linear.c), or
 * without it on oneDNN / the gemv kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "srt_kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "prefill_tasks.h"
#include "simd_bf16.h"
#include "gguf_widen.h"

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for permission to use an XSAVE feature */
#define XFEATURE_XTILEDATA 18
#define PREFETCH_TILES 2 /* how many k-slices ahead the B stream is prefetched (tuned: 1-4 alike) */
#define PARALLEL_MIN_TILES 64

static int64_t granted; /* set by srt_amx_init: the bf16 linears of cpu_bf16_linear.c then run here */

/* 1 when this process may use AMX tiles (the kernel grants it per process), else 0. */
int64_t srt_amx_init(void) {
    granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

int64_t srt_amx_granted(void) { return granted; }

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* All eight tiles 16 rows of 64 bytes. The linear kernels use C 0 (rows r, n0), 1 (r, n1),
 * 2 (r + 16, n0), 3 (r + 16, n1); A 4 (r), 5 (r + 16); B 6 (n0), 7 (n1); x is padded to whole
 * 16-row blocks. */
static void configure_tiles(void) {
    tile_config cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    /* gcc 12 does not count ldtilecfg as reading all 64 bytes and dropped part of the memset
     * (unused tiles then held garbage: #GP): the barrier makes every store happen first. */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}


/* rows of a 16 x 16 fp32 C block (+ bias) -> bf16 outputs */
static inline void store_block(const float *c, int64_t rows, const bf16 *bias, bf16 *out, int64_t n) {
    const __m512 b = bias ? load16(bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + r * 16), b);
        store16(out + r * n, v);
    }
}

static inline void prefetch_tile(const bf16 *tile) {
    for (int line = 0; line < 16; line++) _mm_prefetch((const char *)tile + 64 * line, _MM_HINT_T0);
}

/* the same, stored as fp32 unrounded (an LM head's logits: a bf16 logit of 16 is 0.06 from its
 * neighbours, a loglikelihood's whole error budget). Each row's 16 values are one cache line
 * where `out` is 64-byte aligned (n % 16 == 0 always): written with non-temporal stores, which skip
 * reading the line in first: less time for SmolLM2's LM head followed by srt_argmax at 32-64 rows,
 * equal or less at 1-16 (docs/performance.md, "What bounds a step").
 * amx_linear fences them before its threads meet. */
static inline void store_block_f32(const float *c, int64_t rows, const bf16 *bias, float *out, int64_t n) {
    const __m512 b = bias ? load16(bias) : _mm512_setzero_ps();
    const int aligned = ((uintptr_t)out & 63) == 0;
    for (int64_t r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + r * 16), b);
        if (aligned)
            _mm512_stream_ps(out + r * n, v);
        else
            _mm512_storeu_ps(out + r * n, v);
    }
}

/* rows of the gate (c_gate) and up (c_up) 16 x 16 fp32 blocks of one set of 16 outputs ->
 * silu(gate) * up in bf16, each input rounded to bf16 first: the values srt_silu_mul computes from
 * the bf16 gate_up output of the unfused path */
static inline void store_block_silu(const float *c_gate, const float *c_up, int64_t rows, bf16 *out, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const __m512 g = round16(_mm512_loadu_ps(c_gate + r * 16)), u = round16(_mm512_loadu_ps(c_up + r * 16));
        store16(out + r * n, silu_mul16(g, u));
    }
}

enum { OUT_BF16, OUT_F32, OUT_SILU }; /* what output_pair stores */

/* Two sets of 16 outputs for every row, from the B tile streams b0 and b1, two 16-row blocks of x at
 * a time (four C tiles: each B tile load feeds two products): B streams from memory for the first
 * two blocks and from cache for the others. Against one block at a time, alternating in one process
 * on SmolLM2's 30 layers with cold weights: less time at 32-64 rows and for the LM head, equal at 16
 * (docs/performance.md). (An earlier measurement of the same idea had found it slower; one-block-at-
 * a-time timings on that VM swung by more than that from run to run, hence the alternating medians.)
 * OUT_BF16 / OUT_F32: b0, b1 are outputs [col, col + 32) of a linear; out [m][n] bf16 / fp32 (+ bias).
 * OUT_SILU: b0 is the gate's outputs [col, col + 16), b1 the up projection's same outputs; out
 * [m][n] bf16 gets silu(gate) * up there. `mode` is a constant at each call site. */
static inline void output_pair(const bf16 *xp, int64_t m, int64_t blocks, const bf16 *b0, const bf16 *b1, int64_t k,
                               const bf16 *bias, void *out, int64_t n, int64_t col, const int mode) {
    const int64_t slices = k / 32;
    float c[4][256];
    for (int64_t mb = 0; mb < blocks; mb += 2) {
        const bf16 *a0 = xp + mb * 16 * k, *a1 = a0 + 16 * k;
        const int two = mb + 1 < blocks;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j = 0; j < slices; j++) {
            if (mb == 0 && j + PREFETCH_TILES < slices) {
                prefetch_tile(b0 + (j + PREFETCH_TILES) * 512);
                prefetch_tile(b1 + (j + PREFETCH_TILES) * 512);
            }
            _tile_loadd(4, a0 + j * 32, k * 2);
            _tile_loadd(6, b0 + j * 512, 64);
            _tile_loadd(7, b1 + j * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, a1 + j * 32, k * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (two) {
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
        }
        for (int64_t i = 0; i <= two; i++) {
            const int64_t row0 = (mb + i) * 16, rows = m - row0 < 16 ? m - row0 : 16;
            if (mode == OUT_SILU) {
                store_block_silu(c[2 * i], c[2 * i + 1], rows, (bf16 *)out + row0 * n + col, n);
            } else if (mode == OUT_F32) {
                float *o = (float *)out + row0 * n + col;
                store_block_f32(c[2 * i], rows, bias, o, n);
                store_block_f32(c[2 * i + 1], rows, bias ? bias + 16 : NULL, o + 16, n);
            } else {
                bf16 *o = (bf16 *)out + row0 * n + col;
                store_block(c[2 * i], rows, bias, o, n);
                store_block(c[2 * i + 1], rows, bias ? bias + 16 : NULL, o + 16, n);
            }
        }
    }
}

/* C tiles 0 .. nb-1 (nb <= 4) = row blocks 0 .. nb-1 of a (16 rows each, k apart) times the B stream
 * b of 16 outputs: each B tile is loaded once and meets every row block (A tiles 4 and 5 in turn) */
static inline void quad_pass(const bf16 *a, int64_t nb, const bf16 *b, int64_t k, float c[4][256]) {
    const int64_t slices = k / 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < slices; j++) {
        if (j + PREFETCH_TILES < slices) prefetch_tile(b + (j + PREFETCH_TILES) * 512);
        _tile_loadd(6, b + j * 512, 64);
        _tile_loadd(4, a + j * 32, k * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (nb > 1) {
            _tile_loadd(5, a + 16 * k + j * 32, k * 2);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (nb > 2) {
            _tile_loadd(4, a + 32 * k + j * 32, k * 2);
            _tile_dpbf16ps(2, 4, 6);
        }
        if (nb > 3) {
            _tile_loadd(5, a + 48 * k + j * 32, k * 2);
            _tile_dpbf16ps(3, 5, 6);
        }
    }
    _tile_stored(0, c[0], 64);
    if (nb > 1) _tile_stored(1, c[1], 64);
    if (nb > 2) _tile_stored(2, c[2], 64);
    if (nb > 3) _tile_stored(3, c[3], 64);
}

/* 16 outputs [col, col + 16) for every row of a 33-64 row x (3-4 blocks): the weight streams once,
 * where output_pair would stream it for the first two row blocks and re-read it from cache for the
 * others (no overlap with the next stream). OUT_BF16 / OUT_F32: b0 is the linear's 16-output
 * block; OUT_SILU: b0 the gate's and b1 the up projection's, one pass each. Alternating in one
 * process, SmolLM2 decode steps at batch 48-64 took less time, or the same while the VM was fast
 * (docs/performance.md). Above 64 rows (more than one pass either way) it was not reliably faster. */
static inline void output_quad(const bf16 *xp, int64_t m, int64_t blocks, const bf16 *b0, const bf16 *b1, int64_t k,
                               const bf16 *bias, void *out, int64_t n, int64_t col, const int mode) {
    float c[4][256], c_up[4][256];
    quad_pass(xp, blocks, b0, k, c);
    if (mode == OUT_SILU) quad_pass(xp, blocks, b1, k, c_up);
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t row0 = i * 16, rows = m - row0 < 16 ? m - row0 : 16;
        if (mode == OUT_SILU)
            store_block_silu(c[i], c_up[i], rows, (bf16 *)out + row0 * n + col, n);
        else if (mode == OUT_F32)
            store_block_f32(c[i], rows, bias, (float *)out + row0 * n + col, n);
        else
            store_block(c[i], rows, bias, (bf16 *)out + row0 * n + col, n);
    }
}

/* x [m][k] with m padded to whole 16-row blocks: the padded copy (free it), or NULL when x is whole */
static bf16 *pad_rows(const bf16 *x, int64_t m, int64_t k) {
    if (m % 16 == 0) return NULL;
    /* a tile reads 16 rows: zero rows past m (their outputs are not stored) */
    bf16 *padded = calloc((size_t)((m + 15) / 16 * 16 * k), sizeof(bf16));
    memcpy(padded, x, (size_t)(m * k) * sizeof(bf16));
    return padded;
}

/* The 16-output weight blocks task t of `tasks` (each `width` outputs wide) reads: first the block
 * of its first output (blocks 2t and 2t + 1 of a linear in pairs, block t alone for output_quad's
 * linears), and with silu the gate's block t and the up projection's (block tasks + t of the
 * gate_up weight) */
static inline int64_t first_block(int64_t t, int64_t width) { return width * t / 16; }
static inline int64_t second_block(int64_t t, int64_t tasks, const int silu) { return silu ? tasks + t : 2 * t + 1; }

/* One task per two 16-output B streams: outputs [32t, 32t + 32) of a linear, or with OUT_SILU the
 * gate's block t and the up projection's block t (out [m][n] then has n = d outputs); at 33-64 rows
 * a linear's task is its 16 outputs [16t, 16t + 16) alone (output_quad). The weight is `packed`
 * (bf16_pack's), or with `blocks` a GGUF weight's blocks of `kind`, each task's widened to bf16
 * first (gguf_widen.h) into a scratch of the thread's: the tiles then run as on the bf16 copy. */
static inline void amx_linear(const bf16 *x, int64_t m, const bf16 *packed, const uint8_t *blocks, int64_t kind,
                              const bf16 *bias, void *out, int64_t n, int64_t k, const int mode) {
    const int64_t rows = (m + 15) / 16, slices = k / 32;
    const int silu = mode == OUT_SILU, quad = rows > 2 && rows <= 4;
    const int64_t width = silu || quad ? 16 : 32, tasks = n / width;
    const int64_t stride = blocks ? slices * gguf_block_bytes(kind) : 0;
    bf16 *padded = pad_rows(x, m, k);
    const bf16 *xp = padded ? padded : x;
#pragma omp parallel if (tasks * slices >= PARALLEL_MIN_TILES)
    {
        bf16 *scratch = blocks ? aligned_alloc(64, (size_t)(32 * k) * sizeof(bf16)) : NULL;
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t first = first_block(t, width), second = second_block(t, tasks, silu);
            const int two = !quad || silu;
            const bf16 *b0, *b1 = NULL;
            if (blocks) {
                gguf_widen(blocks + first * stride, kind, scratch, k);
                b0 = scratch;
                if (two) {
                    gguf_widen(blocks + second * stride, kind, scratch + 16 * k, k);
                    b1 = scratch + 16 * k;
                }
            } else {
                b0 = packed + first * slices * 512;
                if (two) b1 = packed + second * slices * 512;
            }
            if (quad)
                output_quad(xp, m, rows, b0, b1, k, bias ? bias + width * t : NULL, out, n, width * t, mode);
            else
                output_pair(xp, m, rows, b0, b1, k, bias ? bias + width * t : NULL, out, n, width * t, mode);
        }
        _tile_release();
        if (mode == OUT_F32) _mm_sfence(); /* store_block_f32's non-temporal stores */
        free(scratch);
    }
    free(padded);
}

/* out[m][n] = x[m][k] @ w.T (+ bias[n]); x rows contiguous; n % 32 == 0 and k % 32 == 0 (the
 * caller checks). srt_amx_init() must have answered 1 in this process. */
void srt_amx_linear(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, bf16 *out, int64_t n,
                    int64_t k) {
    amx_linear(x, m, packed, NULL, 0, bias, out, n, k, OUT_BF16);
}

/* The same with fp32 outputs, unrounded (an LM head's logits) */
void srt_amx_linear_f32(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, float *out, int64_t n,
                        int64_t k) {
    amx_linear(x, m, packed, NULL, 0, bias, out, n, k, OUT_F32);
}

/* act[m][d] = silu(x @ w_gate.T) * (x @ w_up.T) for the packed [2d, k] gate_up weight (gate rows
 * first, then up, as MergedColumnParallelLinear holds them), without the [m][2d] gate_up output:
 * the same values as srt_amx_linear then srt_silu_mul. d % 16 == 0 and k % 32 == 0. */
void srt_amx_linear_silu(const bf16 *x, int64_t m, const bf16 *packed, bf16 *act, int64_t d, int64_t k) {
    amx_linear(x, m, packed, NULL, 0, NULL, act, d, k, OUT_SILU);
}

/* srt_gguf_linear on AMX tiles: amx_linear on the GGUF weight's blocks, widened a task at a time,
 * so the sums are srt_amx_linear's on the weight's bf16 copy, bit for bit, at any row count, and no
 * copy is kept. `mode` as srt_gguf_linear's: 0 bf16, 1 float32, 2 silu(gate) * up. */
void srt_amx_gguf_linear(const bf16 *x, int64_t m, const uint8_t *packed, int64_t kind, const bf16 *bias, void *out,
                         int64_t n, int64_t k, int64_t mode) {
    if (mode == 2)
        amx_linear(x, m, NULL, packed, kind, NULL, out, n, k, OUT_SILU);
    else if (mode == 1)
        amx_linear(x, m, NULL, packed, kind, bias, out, n, k, OUT_F32);
    else
        amx_linear(x, m, NULL, packed, kind, bias, out, n, k, OUT_BF16);
}

/* ---- Prefill attention on AMX tiles ----
 * For each (request, kv head, chunk of up to 128 new tokens' queries): the keys the chunk can see
 * (the request's cached prefix, then its new tokens up to the chunk's last) are laid out
 * once as B tiles (K transposed into dim pairs; V interleaved by token pairs); then for each query
 * head of the group and each block of 16 queries, S = Q K^T block by block (A = 16 query rows in
 * place, C = 16 x 16 scores), a causal softmax over each row in fp32, and O = P V with P rounded to
 * bf16 (as flash attention's second GEMM) and the output in four C tiles (two passes for d = 128).
 * P is exp(scale * (s - row max)) and each output row is divided by its sum at the end.
 * Tiles as configure_tiles() sets them: C 0-3, A 4-5, B 5-7. */
#define PF_CHUNK 128 /* queries per task */

typedef struct {
    uint32_t *kt;  /* [key block][32-dim chunk][16 dim pairs][16 keys] */
    bf16 *vt;      /* [32-key chunk][16-dim tile][16 key pairs][16 dims][2] */
    float *s;      /* [16 queries][keys] scores, then probabilities */
    bf16 *p;       /* [32-key chunk][16 queries][32 keys] */
    bf16 *qpad;    /* [16][d]: a last, partial block of queries, zero-padded */
    float o[4][256];
} pf_scratch;

static void prefill_task(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *v,
                         int64_t v_stride, bf16 *out, int64_t start, int64_t kstart, int64_t n, int64_t prefix,
                         int64_t c0, int64_t kvh, int64_t hq, int64_t G, int64_t d, float scale, pf_scratch *sc) {
    const int64_t c1 = c0 + PF_CHUNK < n ? c0 + PF_CHUNK : n; /* new tokens [c0, c1) */
    const int64_t nk = prefix + c1, chunks = d / 32, kblocks = (nk + 15) / 16, kchunks = (nk + 31) / 32;
    const int64_t smax = kchunks * 32;
    /* K as B tiles: kt[kb][c][i][j] = the i-th dim pair of chunk c of key kb*16 + j */
    for (int64_t kb = 0; kb < kblocks; kb++)
        for (int64_t c = 0; c < chunks; c++) {
            uint32_t *t = sc->kt + (kb * chunks + c) * 256;
            for (int64_t j = 0; j < 16; j++) {
                const int64_t key = kb * 16 + j;
                if (key < nk) {
                    const uint32_t *kr = (const uint32_t *)(k + (kstart + key) * k_stride + kvh * d) + c * 16;
                    for (int64_t i = 0; i < 16; i++) t[i * 16 + j] = kr[i];
                } else {
                    for (int64_t i = 0; i < 16; i++) t[i * 16 + j] = 0;
                }
            }
        }
    /* V as B tiles: vt[kc][dt][i] = dims [16dt, 16dt + 16) of keys 32kc + 2i and + 1, interleaved */
    const int64_t dtiles = d / 16;
    for (int64_t kc = 0; kc < kchunks; kc++)
        for (int64_t i = 0; i < 16; i++) {
            const int64_t key = kc * 32 + 2 * i;
            for (int64_t c = 0; c < chunks; c++) {
                __m512i e = _mm512_setzero_si512(), o = e;
                if (key < nk) e = _mm512_loadu_si512(v + (kstart + key) * v_stride + kvh * d + 32 * c);
                if (key + 1 < nk) o = _mm512_loadu_si512(v + (kstart + key + 1) * v_stride + kvh * d + 32 * c);
                bf16 *t = sc->vt + ((kc * dtiles + 2 * c) * 16 + i) * 32;
                __m512i lo, hi;
                interleave32(e, o, &lo, &hi);
                _mm512_storeu_si512(t, lo);
                _mm512_storeu_si512(t + 16 * 32, hi);
            }
        }
    for (int64_t g = 0; g < G; g++) {
        const int64_t head = kvh * G + g;
        for (int64_t q0 = c0; q0 < c1; q0 += 16) {
            const int64_t rows = c1 - q0 < 16 ? c1 - q0 : 16;
            const int64_t seen = prefix + q0 + rows; /* keys [0, seen) matter to this block */
            const bf16 *a = q + (start + q0) * q_stride + head * d;
            int64_t a_stride = q_stride * 2;
            if (rows < 16) {
                memset(sc->qpad, 0, (size_t)(16 * d) * sizeof(bf16));
                for (int64_t r = 0; r < rows; r++) memcpy(sc->qpad + r * d, a + r * q_stride, (size_t)d * sizeof(bf16));
                a = sc->qpad;
                a_stride = d * 2;
            }
            /* S = Q K^T four key blocks at a time (C tiles 0-3: four independent sums, each query
             * chunk loaded once for the four) */
            const int64_t seen_blocks = (seen + 15) / 16;
            for (int64_t kb0 = 0; kb0 < seen_blocks; kb0 += 4) {
                const int64_t nb = seen_blocks - kb0 < 4 ? seen_blocks - kb0 : 4;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t c = 0; c < chunks; c++) {
                    _tile_loadd(4, a + 32 * c, a_stride);
                    const uint32_t *kt = sc->kt + (kb0 * chunks + c) * 256;
                    _tile_loadd(6, kt, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (nb > 1) {
                        _tile_loadd(7, kt + chunks * 256, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (nb > 2) {
                        _tile_loadd(5, kt + 2 * chunks * 256, 64);
                        _tile_dpbf16ps(2, 4, 5);
                    }
                    if (nb > 3) {
                        _tile_loadd(6, kt + 3 * chunks * 256, 64);
                        _tile_dpbf16ps(3, 4, 6);
                    }
                }
                float *s0 = sc->s + kb0 * 16;
                _tile_stored(0, s0, smax * 4);
                if (nb > 1) _tile_stored(1, s0 + 16, smax * 4);
                if (nb > 2) _tile_stored(2, s0 + 32, smax * 4);
                if (nb > 3) _tile_stored(3, s0 + 48, smax * 4);
            }
            /* causal softmax of each row, normalised at the end (flash attention's order): P =
             * exp(scale * (s - max)) as bf16 A tiles, zero past the row's last key, and the output
             * row divided by the row's sum of those */
            const int64_t pchunks = (seen + 31) / 32;
            float inv_sum[16];
            for (int64_t r = 0; r < 16; r++) { /* rows past the block's queries: P = 0 */
                const float *sr = sc->s + r * smax;
                const int64_t len = r < rows ? prefix + q0 + r + 1 : 0;
                __m512 vsum = _mm512_setzero_ps();
                const __m512 vscale = _mm512_set1_ps(scale);
                const __m512 shift = _mm512_set1_ps(len ? -scale * max16(sr, len) : 0.0f);
                for (int64_t kc = 0; kc < pchunks; kc++) {
                    const int64_t t = kc * 32;
                    const __mmask16 mlo = lanes16(len - t), mhi = lanes16(len - t - 16);
                    const __m512 lo = _mm512_maskz_mov_ps(
                        mlo, exp16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(mlo, sr + t), vscale, shift)));
                    const __m512 hi = _mm512_maskz_mov_ps(
                        mhi, exp16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(mhi, sr + t + 16), vscale, shift)));
                    vsum = _mm512_add_ps(vsum, _mm512_add_ps(lo, hi));
                    _mm512_storeu_si512(sc->p + (kc * 16 + r) * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
                inv_sum[r] = len ? 1.0f / _mm512_reduce_add_ps(vsum) : 0.0f;
            }
            for (int64_t half = 0; half < d / 64; half++) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kc = 0; kc < pchunks; kc++) {
                    const bf16 *vb = sc->vt + (kc * dtiles + 4 * half) * 512;
                    _tile_loadd(4, sc->p + kc * 512, 64);
                    _tile_loadd(5, vb, 64);
                    _tile_loadd(6, vb + 512, 64);
                    _tile_loadd(7, vb + 1024, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, vb + 1536, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
                _tile_stored(0, sc->o[0], 64);
                _tile_stored(1, sc->o[1], 64);
                _tile_stored(2, sc->o[2], 64);
                _tile_stored(3, sc->o[3], 64);
                for (int64_t r = 0; r < rows; r++) {
                    bf16 *orow = out + (start + q0 + r) * hq * d + head * d + 64 * half;
                    const __m512 inv = _mm512_set1_ps(inv_sum[r]);
                    for (int64_t j = 0; j < 4; j++)
                        store16(orow + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(sc->o[j] + r * 16), inv));
                }
            }
        }
    }
}

/* Causal attention of bs requests' new tokens, packed one after another: request b's lens[b]
 * queries are q rows starts[b] .., and its prefixes[b] + lens[b] keys (its cached prefix, then its
 * new tokens) k/v rows kstarts[b] ..; new token i sees keys [0, prefixes[b] + i]. Rows strided
 * (heads contiguous), out [new tokens, hq * d] contiguous. d 64 or 128, hq a multiple of hkv (the
 * caller checks); srt_amx_init() answered 1. */
void srt_amx_prefill_attention(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *v,
                               int64_t v_stride, bf16 *out, const int64_t *starts, const int64_t *kstarts,
                               const int64_t *lens, const int64_t *prefixes, int64_t bs, int64_t hq, int64_t hkv,
                               int64_t d, float scale) {
    int64_t max_len;
    const int64_t tasks = prefill_chunks(lens, prefixes, bs, PF_CHUNK, &max_len);
    const int64_t G = hq / hkv, kpad = (max_len + 31) / 32 * 32;
#pragma omp parallel
    {
        configure_tiles();
        pf_scratch sc;
        sc.kt = aligned_alloc(64, (size_t)(kpad / 16 * (d / 32) * 256) * sizeof(uint32_t));
        sc.vt = aligned_alloc(64, (size_t)(kpad / 32 * (d / 16) * 512) * sizeof(bf16));
        sc.s = aligned_alloc(64, (size_t)(16 * kpad) * sizeof(float));
        sc.p = aligned_alloc(64, (size_t)(kpad / 32 * 512) * sizeof(bf16));
        sc.qpad = aligned_alloc(64, (size_t)(16 * d) * sizeof(bf16));
        /* tasks: (request, query chunk, kv head), longest chunks first in each request's order */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks * hkv; t++) {
            int64_t c0;
            const int64_t b = prefill_chunk_request(lens, PF_CHUNK, t / hkv, &c0);
            prefill_task(q, q_stride, k, k_stride, v, v_stride, out, starts[b], kstarts[b], lens[b], prefixes[b], c0,
                         t % hkv, hq, G, d, scale, &sc);
        }
        free(sc.kt);
        free(sc.vt);
        free(sc.s);
        free(sc.p);
        free(sc.qpad);
        _tile_release();
    }
}

#if defined(__AMX_INT8__)
/* ---- W8A8 int8 (--quantization w8a8_int8) ----
 * Weights are int8 with one fp32 scale per output (symmetric, absmax / 127), packed by
 * packing.int8_pack as [n/16][k/64][16 (k quads)][16 (n)][4]: each 64-wide slice of k for 16
 * outputs is one B tile, 1 KiB. Each row of x is quantized the same way per call (one scale per
 * row), the tiles multiply int8 into int32 (vpdpbssd's tile form, twice the bf16 rate per tile),
 * and the epilogue applies both scales (and the bias) in fp32 before rounding to bf16. */

#ifndef I8_CHUNK_BLOCKS
#define I8_CHUNK_BLOCKS 32 /* 16-row blocks of x per pass over the weight */
#endif

static inline void store_block_i8(const int32_t *c, int64_t rows, const float *xs, const float *ws, const bf16 *bias,
                                  bf16 *out, int64_t n) {
    const __m512 w = _mm512_loadu_ps(ws);
    const __m512 b = bias ? load16(bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * 16));
        const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(v, _mm512_set1_ps(xs[r])), w, b);
        store16(out + r * n, y);
    }
}

/* silu(gate) * up from the gate's and up projection's int32 blocks of one set of 16 outputs, each
 * scaled and rounded to bf16 first (the values srt_silu_mul gets from the unfused path) */
static inline void store_block_i8_silu(const int32_t *c_gate, const int32_t *c_up, int64_t rows, const float *xs,
                                       const float *ws_gate, const float *ws_up, bf16 *out, int64_t n) {
    const __m512 wg = _mm512_loadu_ps(ws_gate), wu = _mm512_loadu_ps(ws_up);
    for (int64_t r = 0; r < rows; r++) {
        const __m512 x = _mm512_set1_ps(xs[r]);
        const __m512 g = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c_gate + r * 16)), x), wg);
        const __m512 u = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c_up + r * 16)), x), wu);
        store16(out + r * n, silu_mul16(round16(g), round16(u)));
    }
}

/* Two sets of 16 outputs from the B streams b0 and b1 (weight scales ws0, ws1; bias b), one 16-row
 * block at a time: outputs [col, col + 32) of a linear, or with silu the gate's outputs [col, col +
 * 16) (b0) and the up projection's (b1) as silu(gate) * up. (output_pair's two-block form, tried
 * here too, was within noise at a batch-32 decode step of SmolLM2 and slower at 64, alternating step
 * by step: docs/performance.md.) */
static inline void output_pair_i8(const int8_t *xq, const float *xs, int64_t m, int64_t blocks, const int8_t *b0,
                                  const int8_t *b1, const float *ws0, const float *ws1, const bf16 *b, bf16 *out,
                                  int64_t n, int64_t k, int64_t col, const int silu) {
    const int64_t slices = k / 64;
    int32_t c[2][256];
    for (int64_t mb = 0; mb < blocks; mb++) {
        const int8_t *a = xq + mb * 16 * k;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t j = 0; j < slices; j++) {
            if (mb == 0 && j + PREFETCH_TILES < slices) {
                prefetch_tile((const bf16 *)(b0 + (j + PREFETCH_TILES) * 1024));
                prefetch_tile((const bf16 *)(b1 + (j + PREFETCH_TILES) * 1024));
            }
            _tile_loadd(4, a + j * 64, k);
            _tile_loadd(6, b0 + j * 1024, 64);
            _tile_loadd(7, b1 + j * 1024, 64);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        const int64_t rows = m - mb * 16 < 16 ? m - mb * 16 : 16;
        bf16 *o = out + mb * 16 * n + col;
        if (silu) {
            store_block_i8_silu(c[0], c[1], rows, xs + mb * 16, ws0, ws1, o, n);
        } else {
            store_block_i8(c[0], rows, xs + mb * 16, ws0, b, o, n);
            store_block_i8(c[1], rows, xs + mb * 16, ws1, b ? b + 16 : NULL, o + 16, n);
        }
    }
}

/* out[m][n] = x[m][k] @ (w * w_scale).T (+ bias) with x quantized per row as above, or with silu
 * silu(gate) * up of the gate_up weight into out[m][n] (n = d): one task per two 16-output B
 * streams, as in amx_linear */
static void amx_linear_i8(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, const bf16 *bias,
                          bf16 *out, int64_t n, int64_t k, const int silu) {
    const int64_t blocks = (m + 15) / 16, slices = k / 64, width = silu ? 16 : 32, tasks = n / width;
    int8_t *xq = calloc((size_t)(blocks * 16 * k), 1);
    float *xs = calloc((size_t)(blocks * 16), sizeof(float));
    srt_quantize_rows(x, m, k, xq, xs, NULL); /* rows past m stay zero: whole 16-row tiles */
#pragma omp parallel if (tasks * slices >= PARALLEL_MIN_TILES / 2)
    {
        configure_tiles();
        /* a prefill's rows a chunk at a time, so the chunk's int8 rows stay in L2 while every
         * output pair passes over them (one pass over all rows re-read them from L3 per pair) */
        for (int64_t c0 = 0; c0 < blocks; c0 += I8_CHUNK_BLOCKS) {
            const int64_t nb = blocks - c0 < I8_CHUNK_BLOCKS ? blocks - c0 : I8_CHUNK_BLOCKS;
            const int64_t rows = m - c0 * 16 < nb * 16 ? m - c0 * 16 : nb * 16;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                const int64_t first = first_block(t, width), second = second_block(t, tasks, silu);
                output_pair_i8(xq + c0 * 16 * k, xs + c0 * 16, rows, nb, packed + first * slices * 1024,
                               packed + second * slices * 1024, w_scale + 16 * first, w_scale + 16 * second,
                               bias ? bias + width * t : NULL, out + c0 * 16 * n, n, k, width * t, silu);
            }
        }
        _tile_release();
    }
    free(xq);
    free(xs);
}

/* out[m][n] = x[m][k] @ (w * w_scale).T (+ bias), x quantized per row as above; n % 32 == 0 and
 * k % 64 == 0 (the caller checks). srt_amx_init() must have answered 1 in this process. */
void srt_amx_linear_i8(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, const bf16 *bias,
                       bf16 *out, int64_t n, int64_t k) {
    amx_linear_i8(x, m, packed, w_scale, bias, out, n, k, 0);
}

/* act[m][d] = silu(gate) * up of the int8 gate_up weight [2d, k] (gate rows first), without the
 * [m][2d] product: the same values as srt_amx_linear_i8 then srt_silu_mul. d % 16 == 0. */
void srt_amx_linear_i8_silu(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, bf16 *act,
                            int64_t d, int64_t k) {
    amx_linear_i8(x, m, packed, w_scale, NULL, act, d, k, 1);
}

int64_t srt_amx_has_int8(void) { return 1; }
#else
int64_t srt_amx_has_int8(void) { return 0; }

void srt_amx_linear_i8(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, const bf16 *bias,
                       bf16 *out, int64_t n, int64_t k) {
    (void)x, (void)m, (void)packed, (void)w_scale, (void)bias, (void)out, (void)n, (void)k;
    abort(); /* never called: srt_amx_has_int8() answered 0 */
}

void srt_amx_linear_i8_silu(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, bf16 *act,
                            int64_t d, int64_t k) {
    (void)x, (void)m, (void)packed, (void)w_scale, (void)act, (void)d, (void)k;
    abort(); /* never called: srt_amx_has_int8() answered 0 */
}
#endif

#else

int64_t srt_amx_init(void) { return 0; }
void srt_amx_gguf_linear(const bf16 *x, int64_t m, const uint8_t *packed, int64_t kind, const bf16 *bias, void *out,
                         int64_t n, int64_t k, int64_t mode) {
    (void)x, (void)m, (void)packed, (void)kind, (void)bias, (void)out, (void)n, (void)k, (void)mode;
    abort(); /* never called: srt_amx_init() answered 0 */
}

int64_t srt_amx_granted(void) { return 0; }

void srt_amx_prefill_attention(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *v,
                               int64_t v_stride, bf16 *out, const int64_t *starts, const int64_t *kstarts,
                               const int64_t *lens, const int64_t *prefixes, int64_t bs, int64_t hq, int64_t hkv,
                               int64_t d, float scale) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out, (void)starts, (void)kstarts;
    (void)lens, (void)prefixes, (void)bs, (void)hq, (void)hkv, (void)d, (void)scale;
    abort(); /* never called: srt_amx_init() answered 0 */
}

void srt_amx_linear(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, bf16 *out, int64_t n,
                    int64_t k) {
    (void)x, (void)m, (void)packed, (void)bias, (void)out, (void)n, (void)k;
    abort(); /* never called: srt_amx_init() answered 0 */
}

void srt_amx_linear_f32(const bf16 *x, int64_t m, const bf16 *packed, const bf16 *bias, float *out, int64_t n,
                        int64_t k) {
    (void)x, (void)m, (void)packed, (void)bias, (void)out, (void)n, (void)k;
    abort(); /* never called: srt_amx_init() answered 0 */
}

void srt_amx_linear_silu(const bf16 *x, int64_t m, const bf16 *packed, bf16 *act, int64_t d, int64_t k) {
    (void)x, (void)m, (void)packed, (void)act, (void)d, (void)k;
    abort(); /* never called: srt_amx_init() answered 0 */
}

int64_t srt_amx_has_int8(void) { return 0; }

void srt_amx_linear_i8(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, const bf16 *bias,
                       bf16 *out, int64_t n, int64_t k) {
    (void)x, (void)m, (void)packed, (void)w_scale, (void)bias, (void)out, (void)n, (void)k;
    abort(); /* never called: srt_amx_init() answered 0 */
}

void srt_amx_linear_i8_silu(const bf16 *x, int64_t m, const int8_t *packed, const float *w_scale, bf16 *act,
                            int64_t d, int64_t k) {
    (void)x, (void)m, (void)packed, (void)w_scale, (void)act, (void)d, (void)k;
    abort(); /* never called: srt_amx_init() answered 0 */
}

#endif
