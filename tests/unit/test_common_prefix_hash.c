/*
 * common/prefix_hash: the chain the workers' prefix caches and the router's placement share.
 * Reference: FNV-1a 64 over the tokens' little-endian int32 bytes, computed by Python's struct
 * module (struct.pack('<4i', ...)) for the vector below, and a chain rebuilt block by block.
 */
#include <criterion/criterion.h>

#include "common/prefix_hash.h"

static const int32_t toks[9] = {1, 2, 3, 4, 5, -1, 100000, 7, 8};

Test(prefix_hash, chain_matches_fnv1a_over_little_endian_ids)
{
    uint64_t out[4] = {0};
    /* 9 tokens, blocks of 4: two whole blocks, each leaving a token after it */
    cr_assert_eq(duet_prefix_hash_chain(toks, 9, 4, out, 4), 2);
    cr_assert_eq(out[0], 0x84c39a079fc08121ull);
    cr_assert_eq(out[1], 0x4824a7e40229cc0cull);
    cr_assert_eq(duet_prefix_hash_block(out[0], toks + 4, 4), out[1]);
}

Test(prefix_hash, a_block_must_leave_a_token_after_it)
{
    uint64_t out[4] = {0};
    cr_assert_eq(duet_prefix_hash_chain(toks, 8, 4, out, 4), 1); /* 8 = 2 blocks, none left */
    cr_assert_eq(duet_prefix_hash_chain(toks, 4, 4, out, 4), 0);
    cr_assert_eq(duet_prefix_hash_chain(toks, 9, 4, out, 1), 1); /* max_out caps it */
    cr_assert_eq(duet_prefix_hash_chain(toks, 9, 0, out, 4), 0);
    cr_assert_eq(duet_prefix_hash_chain(toks, 9, -3, out, 4), 0);
}

Test(prefix_hash, one_token_changed_changes_its_block_and_every_later_one)
{
    int32_t t[13];
    for (int i = 0; i < 13; i++)
        t[i] = i * 31;
    uint64_t a[3], b[3];
    cr_assert_eq(duet_prefix_hash_chain(t, 13, 4, a, 3), 3);
    t[5] ^= 1 << 20;
    cr_assert_eq(duet_prefix_hash_chain(t, 13, 4, b, 3), 3);
    cr_assert_eq(a[0], b[0]);
    cr_assert_neq(a[1], b[1]);
    cr_assert_neq(a[2], b[2]);
}
