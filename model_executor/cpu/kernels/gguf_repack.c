/* A GGUF file's K-quant super-blocks laid out for the kernels, straight from the file's bytes: no
 * value is decoded to a wider type on the way. The layouts are packing.py's (q4ks_pack,
 * q6ks_pack), which these equal byte for byte given the file's own factors (tests/test_gguf_blocks.py);
 * the file's blocks are ggml's (block_q4_K, block_q6_K).
 *
 * raw: n rows, each k / 256 super-blocks of the file's type; out: the layout's n / 16 x k / 32
 * blocks. n % 16 == 0, k % 256 == 0. */

#include <stdint.h>
#include <string.h>

#include "srt_kernels.h"

/* IEEE half -> float, exact for every value (subnormals, infinities, NaN). */
static float half_to_float(const uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 31u, man = h & 1023u, bits;
    if (exp == 31u) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0u) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0u) {
        bits = sign;
    } else {  // subnormal: normalize
        exp = 113u;
        while (!(man & 1024u)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 1023u) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float half_at(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | p[1] << 8)); }

enum { Q4K_SUPER = 144, Q4KS_SUPER = 2432, Q6K_SUPER = 210, Q6KS_SUPER = 3392 };

/* block_q4_K: fp16 d, fp16 dmin, 12 bytes of six-bit scales and mins, 128 bytes of nibbles (byte l
 * of chunk c: element l of run 2c low, of run 2c + 1 high). Out per 16 rows and super-block: their
 * fp32 d, their fp32 -dmin, then per run of 32 the 16 sc, the 16 mn and 256 bytes of nibbles,
 * byte 32 c + 2 j + b = q[j][4c + b] | q[j][4c + 2 + b] << 4. */
void srt_pack_q4k_file(const uint8_t *raw, int64_t n, int64_t k, uint8_t *out) {
    const int64_t supers = k / 256;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / 16; g++) {
        for (int64_t s = 0; s < supers; s++) {
            uint8_t *o = out + (g * supers + s) * Q4KS_SUPER;
            for (int j = 0; j < 16; j++) {
                const uint8_t *b = raw + ((g * 16 + j) * supers + s) * Q4K_SUPER;
                const float d = half_at(b), m = -half_at(b + 2);
                memcpy(o + 4 * j, &d, 4);
                memcpy(o + 64 + 4 * j, &m, 4);
                const uint8_t *sc = b + 4, *qs = b + 16;
                for (int r = 0; r < 8; r++) {
                    uint8_t *run = o + 128 + r * 288;
                    run[j] = r < 4 ? sc[r] & 63 : (uint8_t)((sc[r + 4] & 15) | ((sc[r - 4] >> 6) << 4));
                    run[16 + j] = r < 4 ? sc[r + 4] & 63 : (uint8_t)((sc[r + 4] >> 4) | ((sc[r] >> 6) << 4));
                    const uint8_t *chunk = qs + (r / 2) * 32;
                    const int shift = 4 * (r & 1);
                    for (int c = 0; c < 8; c++) {
                        for (int lh = 0; lh < 2; lh++) {
                            const int lo = (chunk[4 * c + lh] >> shift) & 15;
                            const int hi = (chunk[4 * c + 2 + lh] >> shift) & 15;
                            run[32 + 32 * c + 2 * j + lh] = (uint8_t)(lo | hi << 4);
                        }
                    }
                }
            }
        }
    }
}

/* block_q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16), fp16 d;
 * element 128 h + 32 t + l is ql[64 h + 32 (t & 1) + l] >> 4 (t >> 1) & 15 | (qh[32 h + l] >> 2 t &
 * 3) << 4, less 32. Out per 16 rows and super-block: their fp32 d, then per run of 32 the int8 scales
 * of its k 0..15 (16 rows) and 16..31, and per quad c of k 48 bytes over L[4 j + i] = q[j][4c + i]
 * + 32: 32 bytes L[b] & 15 | (L[b + 32] & 15) << 4, 16 bytes L[b] >> 4 | L[b + 16] >> 4 << 2 |
 * L[b + 32] >> 4 << 4 | L[b + 48] >> 4 << 6. */
void srt_pack_q6k_file(const uint8_t *raw, int64_t n, int64_t k, uint8_t *out) {
    const int64_t supers = k / 256;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / 16; g++) {
        for (int64_t s = 0; s < supers; s++) {
            uint8_t *o = out + (g * supers + s) * Q6KS_SUPER;
            uint8_t lanes[16][256];  // q + 32 of each row's super-block
            for (int j = 0; j < 16; j++) {
                const uint8_t *b = raw + ((g * 16 + j) * supers + s) * Q6K_SUPER;
                const float d = half_at(b + 208);
                memcpy(o + 4 * j, &d, 4);
                for (int r = 0; r < 8; r++) {
                    o[64 + r * 416 + j] = b[192 + 2 * r];
                    o[64 + r * 416 + 16 + j] = b[192 + 2 * r + 1];
                }
                for (int e = 0; e < 256; e++) {
                    const int h = e / 128, t = (e / 32) & 3, l = e & 31;
                    const int low = (b[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 15;
                    const int high = (b[128 + 32 * h + l] >> (2 * t)) & 3;
                    lanes[j][e] = (uint8_t)(low | high << 4);
                }
            }
            for (int r = 0; r < 8; r++) {
                for (int c = 0; c < 8; c++) {
                    uint8_t L[64];
                    for (int j = 0; j < 16; j++) {
                        for (int i = 0; i < 4; i++) {
                            L[4 * j + i] = lanes[j][32 * r + 4 * c + i];
                        }
                    }
                    uint8_t *chunk = o + 64 + r * 416 + 32 + c * 48;
                    for (int b = 0; b < 32; b++) {
                        chunk[b] = (uint8_t)((L[b] & 15) | (L[b + 32] & 15) << 4);
                    }
                    for (int b = 0; b < 16; b++) {
                        chunk[32 + b] = (uint8_t)((L[b] >> 4) | (L[b + 16] >> 4) << 2 | (L[b + 32] >> 4) << 4 |
                                                  (L[b + 48] >> 4) << 6);
                    }
                }
            }
        }
    }
}
