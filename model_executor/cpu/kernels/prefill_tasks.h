/* How both prefill attention kernels (cpu_amx.c on AMX tiles, cpu_prefill_attention.c on AVX-512
 * BF16) share out a batch: a task is (request, chunk of up to `chunk` of its new tokens, kv head),
 * numbered request by request, chunk by chunk, kv head fastest. */
#ifndef SRT_PREFILL_TASKS_H
#define SRT_PREFILL_TASKS_H

#include <stdint.h>

/* The (request, chunk) pairs of the batch; *max_keys = the most keys a request has (its cached
 * prefix and its new tokens) */
static inline int64_t prefill_chunks(const int64_t *lens, const int64_t *prefixes, int64_t bs, int64_t chunk,
                                     int64_t *max_keys) {
    int64_t chunks = 0;
    *max_keys = 0;
    for (int64_t b = 0; b < bs; b++) {
        *max_keys = prefixes[b] + lens[b] > *max_keys ? prefixes[b] + lens[b] : *max_keys;
        chunks += (lens[b] + chunk - 1) / chunk;
    }
    return chunks;
}

/* The request of (request, chunk) pair i; *c0 = the chunk's first new token */
static inline int64_t prefill_chunk_request(const int64_t *lens, int64_t chunk, int64_t i, int64_t *c0) {
    int64_t b = 0;
    while (i >= (lens[b] + chunk - 1) / chunk) i -= (lens[b++] + chunk - 1) / chunk;
    *c0 = i * chunk;
    return b;
}
#endif
