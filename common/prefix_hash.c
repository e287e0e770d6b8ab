/* The prefix hash chain (prefix_hash.h). */
#include "common/prefix_hash.h"

uint64_t duet_prefix_hash_block(uint64_t h, const int32_t *tokens, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        const uint32_t t = (uint32_t)tokens[i];
        for (int b = 0; b < 4; b++) /* byte by byte, low first: the same on every host */
            h = (h ^ ((t >> (8 * b)) & 0xffu)) * 0x100000001b3ull;
    }
    return h;
}

size_t duet_prefix_hash_chain(const int32_t *tokens, int64_t n, int64_t page_tokens, uint64_t *out,
                              size_t max_out)
{
    if (page_tokens <= 0)
        return 0;
    uint64_t h = DUET_PREFIX_HASH_SEED;
    size_t k = 0;
    while (k < max_out && (int64_t)(k + 1) * page_tokens < n) {
        h = duet_prefix_hash_block(h, tokens + (int64_t)k * page_tokens, page_tokens);
        out[k++] = h;
    }
    return k;
}
