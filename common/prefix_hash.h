/*
 * The prefix cache's names for token prefixes (worker/prefix_cache.h), shared by the workers that
 * keep prefixes and the router that places prompts where their prefix is kept: one home for the
 * hash, so both sides always agree.
 *
 * A prefix of whole pages (k blocks of page_tokens tokens) is named by a hash chain: block k's
 * hash is FNV-1a (64-bit) over block k's token ids (little-endian int32 bytes) seeded with block
 * k-1's hash, block 1 seeded with DUET_PREFIX_HASH_SEED. A hash only names a prefix: the workers
 * compare the tokens themselves, so a collision costs at most a placement, never an answer.
 */
#ifndef DUET_COMMON_PREFIX_HASH_H
#define DUET_COMMON_PREFIX_HASH_H

#include <stddef.h>
#include <stdint.h>

#define DUET_PREFIX_HASH_SEED 0xcbf29ce484222325ull

/* The chain's hash after one more block: h (the hash before it) over tokens[0..n). */
uint64_t duet_prefix_hash_block(uint64_t h, const int32_t *tokens, int64_t n);

/*
 * out[k - 1] = the hash of tokens[0..k * page_tokens) for k = 1 .. the number of whole blocks of
 * tokens[0..n) that leave at least one token after them (a prompt needs one token to prefill),
 * at most max_out. Returns how many were written (0 for page_tokens <= 0).
 */
size_t duet_prefix_hash_chain(const int32_t *tokens, int64_t n, int64_t page_tokens, uint64_t *out,
                              size_t max_out);

#endif
