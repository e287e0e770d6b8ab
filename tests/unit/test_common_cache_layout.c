/*
 * common/cache_layout.h: every size and offset against the formulas of docs/architecture.md
 * ("Cache pools"), evaluated here in 128-bit integers, over random layouts of every magnitude
 * (so the 64-bit overflow edge is crossed on both sides): a function must give the formula's
 * value when every step of it, taken in the order written below, fits in 64 bits, and refuse
 * (false, *r untouched) exactly when one does not. A conv kernel of 0 is refused. The formulas:
 *   KV:  block = page_tokens * token_bytes, page = block * n_layers,
 *        offset(p, l, s) = ((p * n_layers + l) * page_tokens + s) * token_bytes
 *   KDA: layer = (H*K*K + 3*H*K*(W-1)) * elem, slot = layer * n_layers,
 *        S of head h in (i, l) at (i * n_layers + l) * layer + h*K*K*elem,
 *        channel ch of window c (q, k, v) at that layer's offset + (H*K*K + (c*H*K +
 * ch)*(W-1))*elem
 *   replay: row = (6*H*K + H) * elem, layer = row * rows, slot = layer * n_layers,
 *        row r of (i, l) at ((i * n_layers + l) * rows + r) * row, field f at f*H*K*elem
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>

#include "common/cache_layout.h"

typedef unsigned __int128 u128;

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next64(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* A value of a random magnitude: 0, small, or up to 2^bits for a random bits in [1, 40]. */
static uint64_t any_size(void)
{
    const uint64_t kind = next64() % 8;
    if (kind == 0)
        return 0;
    if (kind < 4)
        return 1 + next64() % 300;
    return next64() >> (64 - (1 + next64() % 40));
}

/* `ok` / `got` (= *r, called first) from a layout function against the formula's value `want`:
 * equal when it fits in 64 bits, refused (and the sentinel left) when it does not. */
static void expect(const char *what, bool ok, uint64_t got, u128 want, int i)
{
    if (want <= UINT64_MAX) {
        cr_assert(ok, "%s #%d: refused a value that fits (%llu)", what, i,
                  (unsigned long long)want);
        cr_assert_eq(got, (uint64_t)want, "%s #%d: %llu, the formula says %llu", what, i,
                     (unsigned long long)got, (unsigned long long)want);
    } else {
        cr_assert(!ok, "%s #%d: accepted a value beyond 64 bits", what, i);
        cr_assert_eq(got, 0xdeadull, "%s #%d: wrote *r on overflow", what, i);
    }
}

Test(common_cache_layout, kv_sizes_and_offsets_follow_the_formula, .timeout = 30)
{
    int n_over = 0, n_fit = 0;
    for (int i = 0; i < 200000; i++) {
        const duet_kv_layout_t l = {
            .page_tokens = any_size(), .n_layers = any_size(), .token_bytes = any_size()};
        const uint64_t p = any_size(), layer = any_size(), s = any_size();
        uint64_t r = 0xdead;
        bool ok;
        u128 want = (u128)l.page_tokens * l.token_bytes;
        ok = duet_kv_layout_block_bytes(&l, &r);
        expect("kv block", ok, r, want, i);
        r = 0xdead;
        want = want > UINT64_MAX ? want : want * l.n_layers;
        ok = duet_kv_layout_page_bytes(&l, &r);
        expect("kv page", ok, r, want, i);
        r = 0xdead;
        /* each step of the formula must fit, as the function computes it step by step */
        u128 o = (u128)p * l.n_layers;
        o = o > UINT64_MAX ? o : o + layer;
        o = o > UINT64_MAX ? o : o * l.page_tokens;
        o = o > UINT64_MAX ? o : o + s;
        o = o > UINT64_MAX ? o : o * l.token_bytes;
        ok = duet_kv_layout_offset(&l, p, layer, s, &r);
        expect("kv offset", ok, r, o, i);
        if (o > UINT64_MAX)
            n_over++;
        else
            n_fit++;
    }
    printf("[common_cache_layout] kv: %d offsets in 64 bits, %d refused as overflowing\n", n_fit,
           n_over);
    cr_assert(n_fit > 10000 && n_over > 10000, "both sides of the overflow edge were visited");
}

/* Saturating 128-bit arithmetic for the KDA formulas (any intermediate beyond 64 bits makes the
 * result "beyond" too, as the functions refuse it). */
static u128 sat(u128 v)
{
    return v > UINT64_MAX ? (u128)UINT64_MAX + 1 : v;
}

static u128 mul(u128 a, u128 b)
{
    return sat(a > UINT64_MAX || b > UINT64_MAX ? (u128)UINT64_MAX + 1 : a * b);
}

static u128 add(u128 a, u128 b)
{
    return sat(a + b);
}

Test(common_cache_layout, kda_sizes_and_offsets_follow_the_formula, .timeout = 30)
{
    int n_over = 0, n_fit = 0;
    for (int i = 0; i < 200000; i++) {
        const duet_kda_layout_t l = {.n_layers = any_size(),
                                     .heads = any_size(),
                                     .head_dim = any_size(),
                                     .conv_kernel = 1 + any_size(),
                                     .elem_bytes = 1 + next64() % 8};
        const uint64_t H = l.heads, K = l.head_dim, W1 = l.conv_kernel - 1, e = l.elem_bytes;
        const uint64_t slot = any_size(), layer = any_size(), head = any_size();
        const uint64_t which = next64() % 3, ch = any_size();
        uint64_t r = 0xdead;
        bool ok;

        const u128 state_h = mul(mul(mul(head, K), K), e);
        ok = duet_kda_layout_state_bytes(&l, head, &r);
        expect("kda state bytes", ok, r, state_h, i);
        r = 0xdead;
        const u128 conv_c = mul(mul(ch, W1), e);
        ok = duet_kda_layout_conv_bytes(&l, ch, &r);
        expect("kda conv bytes", ok, r, conv_c, i);
        r = 0xdead;
        const u128 hk = mul(H, K);
        const u128 lbytes = add(mul(mul(hk, K), e), mul(mul(mul(hk, 3), W1), e));
        ok = duet_kda_layout_layer_bytes(&l, &r);
        expect("kda layer", ok, r, lbytes, i);
        r = 0xdead;
        ok = duet_kda_layout_slot_bytes(&l, &r);
        expect("kda slot", ok, r, mul(lbytes, l.n_layers), i);
        r = 0xdead;
        const u128 base = mul(add(mul(slot, l.n_layers), layer), lbytes);
        const u128 s_off = add(base, state_h);
        ok = duet_kda_layout_state_offset(&l, slot, layer, head, &r);
        expect("kda state offset", ok, r, s_off, i);
        r = 0xdead;
        const u128 c_off =
            add(add(base, mul(mul(hk, K), e)), mul(mul(add(mul(hk, which), ch), W1), e));
        ok = duet_kda_layout_conv_offset(&l, slot, layer, which, ch, &r);
        expect("kda conv offset", ok, r, c_off, i);
        if (c_off > UINT64_MAX)
            n_over++;
        else
            n_fit++;
    }
    printf("[common_cache_layout] kda: %d offsets in 64 bits, %d refused as overflowing\n", n_fit,
           n_over);
    cr_assert(n_fit > 10000 && n_over > 10000, "both sides of the overflow edge were visited");
}

Test(common_cache_layout, replay_sizes_and_offsets_follow_the_formula, .timeout = 30)
{
    int n_over = 0, n_fit = 0;
    for (int i = 0; i < 200000; i++) {
        const duet_replay_layout_t l = {.n_layers = any_size(),
                                        .heads = any_size(),
                                        .head_dim = any_size(),
                                        .rows = any_size(),
                                        .elem_bytes = 1 + next64() % 8};
        const uint64_t slot = any_size(), layer = any_size(), row = any_size();
        const uint64_t field = next64() % 7;
        uint64_t r = 0xdead;
        bool ok;

        const u128 hk = mul(l.heads, l.head_dim);
        const u128 rbytes = mul(add(mul(hk, 6), l.heads), l.elem_bytes);
        ok = duet_replay_layout_row_bytes(&l, &r);
        expect("replay row", ok, r, rbytes, i);
        r = 0xdead;
        const u128 lbytes = mul(rbytes, l.rows);
        ok = duet_replay_layout_layer_bytes(&l, &r);
        expect("replay layer", ok, r, lbytes, i);
        r = 0xdead;
        ok = duet_replay_layout_slot_bytes(&l, &r);
        expect("replay slot", ok, r, mul(lbytes, l.n_layers), i);
        r = 0xdead;
        const u128 off = mul(add(mul(add(mul(slot, l.n_layers), layer), l.rows), row), rbytes);
        ok = duet_replay_layout_row_offset(&l, slot, layer, row, &r);
        expect("replay row offset", ok, r, off, i);
        r = 0xdead;
        ok = duet_replay_layout_field_offset(&l, field, &r);
        expect("replay field offset", ok, r, mul(mul(hk, field), l.elem_bytes), i);
        if (off > UINT64_MAX)
            n_over++;
        else
            n_fit++;
    }
    printf("[common_cache_layout] replay: %d offsets in 64 bits, %d refused as overflowing\n",
           n_fit, n_over);
    cr_assert(n_fit > 10000 && n_over > 10000, "both sides of the overflow edge were visited");
}

/* The fields of a row follow each other and fill it: proj (3 H*K), k, v, g (H*K each), beta (H). */
Test(common_cache_layout, replay_fields_tile_a_row, .timeout = 10)
{
    const duet_replay_layout_t l = {
        .n_layers = 20, .heads = 32, .head_dim = 128, .rows = 5, .elem_bytes = 4};
    const uint64_t hk = 32 * 128 * 4;
    const struct {
        uint64_t field, at;
    } f[] = {{DUET_REPLAY_FIELD_PROJ, 0},
             {DUET_REPLAY_FIELD_K, 3 * hk},
             {DUET_REPLAY_FIELD_V, 4 * hk},
             {DUET_REPLAY_FIELD_G, 5 * hk},
             {DUET_REPLAY_FIELD_BETA, 6 * hk}};
    uint64_t r;
    for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++) {
        cr_assert(duet_replay_layout_field_offset(&l, f[i].field, &r));
        cr_assert_eq(r, f[i].at, "field %llu at %llu, not %llu", (unsigned long long)f[i].field,
                     (unsigned long long)r, (unsigned long long)f[i].at);
    }
    cr_assert(duet_replay_layout_row_bytes(&l, &r));
    cr_assert_eq(r, 6 * hk + 32 * 4, "beta (H values) ends the row");
    /* the 48B model's dimensions, 5 rows: 96.1 KiB a row, 9.4 MiB per slot over 20 layers */
    cr_assert(duet_replay_layout_slot_bytes(&l, &r));
    cr_assert_eq(r, (6 * hk + 32 * 4) * 5 * 20);
}

Test(common_cache_layout, conv_kernel_zero_is_refused, .timeout = 10)
{
    const duet_kda_layout_t l = {
        .n_layers = 2, .heads = 4, .head_dim = 8, .conv_kernel = 0, .elem_bytes = 4};
    uint64_t r = 0xdead;
    cr_assert(!duet_kda_layout_conv_bytes(&l, 1, &r));
    cr_assert(!duet_kda_layout_layer_bytes(&l, &r));
    cr_assert(!duet_kda_layout_slot_bytes(&l, &r));
    cr_assert(!duet_kda_layout_state_offset(&l, 0, 0, 0, &r));
    cr_assert(!duet_kda_layout_conv_offset(&l, 0, 0, 0, 0, &r));
    cr_assert_eq(r, 0xdead);
}

/* The 48B model's numbers from docs/model.md: 2304 B per token per MLA layer (fp32), and a KDA
 * layer of 2 MiB of S plus 144 KiB of conv windows. */
Test(common_cache_layout, kimi_48b_numbers, .timeout = 10)
{
    const duet_kv_layout_t kv = {.page_tokens = 128, .n_layers = 7, .token_bytes = 576 * 4};
    uint64_t r;
    cr_assert(duet_kv_layout_page_bytes(&kv, &r));
    cr_assert_eq(r, 128ull * 16128);
    const duet_kda_layout_t kda = {
        .n_layers = 20, .heads = 32, .head_dim = 128, .conv_kernel = 4, .elem_bytes = 4};
    cr_assert(duet_kda_layout_state_bytes(&kda, 32, &r));
    cr_assert_eq(r, 2ull << 20);
    cr_assert(duet_kda_layout_conv_bytes(&kda, 3 * 32 * 128, &r));
    cr_assert_eq(r, 144ull << 10);
}
