/*
 * common/utf8: duet_utf8_char against an encoder written from Unicode's definition (every scalar
 * value encodes, decodes back, and is the only well-formed reading of its bytes), counts of the
 * well-formed sequences of each length over every byte string of that length, and the ill-formed
 * cases named in Unicode's Table 3-7 (overlongs, surrogates, past U+10FFFF, truncation).
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "common/utf8.h"

/* The shortest UTF-8 form of a scalar value, from the bit patterns of Unicode's Table 3-6. */
static size_t encode(uint32_t cp, uint8_t *out)
{
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xc0 | cp >> 6);
        out[1] = (uint8_t)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xe0 | cp >> 12);
        out[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3f));
        out[2] = (uint8_t)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (uint8_t)(0xf0 | cp >> 18);
    out[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3f));
    out[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3f));
    out[3] = (uint8_t)(0x80 | (cp & 0x3f));
    return 4;
}

Test(common_utf8, every_scalar_value_round_trips, .timeout = 30)
{
    size_t n = 0;
    for (uint32_t cp = 0; cp <= 0x10ffff; cp++) {
        if (cp >= 0xd800 && cp <= 0xdfff)
            continue;
        uint8_t b[4];
        size_t len = encode(cp, b);
        int32_t got = -2;
        cr_assert_eq(duet_utf8_char(b, len, &got), len, "U+%04X", cp);
        cr_assert_eq(got, (int32_t)cp);
        cr_assert_eq(duet_utf8_char(b, len, NULL), len);
        cr_assert(duet_utf8_valid((const char *)b, len));
        if (len > 1) /* truncated: ill-formed */
            cr_assert_eq(duet_utf8_char(b, len - 1, &got), 0, "U+%04X cut", cp);
        n++;
    }
    cr_assert_eq(n, 0x110000 - 0x800, "the scalar values");
}

/* Over every byte string of 2 and 3 bytes, and every 4-byte string with a lead of F0..F4, the
 * well-formed full-length readings are exactly the scalar values of that length. */
Test(common_utf8, well_formed_counts, .timeout = 60)
{
    size_t n2 = 0, n3 = 0, n4 = 0;
    uint8_t b[4];
    for (uint32_t x = 0; x < 1u << 16; x++) {
        b[0] = (uint8_t)(x >> 8), b[1] = (uint8_t)x;
        n2 += duet_utf8_char(b, 2, NULL) == 2;
    }
    for (uint32_t x = 0; x < 1u << 24; x++) {
        b[0] = (uint8_t)(x >> 16), b[1] = (uint8_t)(x >> 8), b[2] = (uint8_t)x;
        n3 += duet_utf8_char(b, 3, NULL) == 3;
    }
    for (uint32_t lead = 0xf0; lead <= 0xf4; lead++)
        for (uint32_t x = 0; x < 1u << 24; x++) {
            b[0] = (uint8_t)lead, b[1] = (uint8_t)(x >> 16), b[2] = (uint8_t)(x >> 8);
            b[3] = (uint8_t)x;
            n4 += duet_utf8_char(b, 4, NULL) == 4;
        }
    cr_assert_eq(n2, 0x800 - 0x80);
    cr_assert_eq(n3, 0x10000 - 0x800 - 0x800); /* less the surrogates */
    cr_assert_eq(n4, 0x110000 - 0x10000);
}

Test(common_utf8, ill_formed, .timeout = 10)
{
    static const struct {
        const char *bytes;
        size_t len;
    } bad[] = {
        {"\xc0\xaf", 2},
        {"\xc1\xbf", 2},
        {"\xe0\x9f\xbf", 3}, /* overlongs */
        {"\xf0\x8f\xbf\xbf", 4},
        {"\xed\xa0\x80", 3},
        {"\xed\xbf\xbf", 3}, /* surrogates */
        {"\xf4\x90\x80\x80", 4},
        {"\xf5\x80\x80\x80", 4},
        {"\xff", 1}, /* too large */
        {"\x80", 1},
        {"\xbf", 1},
        {"\xe2\x82", 2}, /* stray, cut */
        {"\xe2\x28\xa1", 3},
        {"\xf0\x9f\x98", 3},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int32_t cp = 7;
        cr_assert_eq(duet_utf8_char((const uint8_t *)bad[i].bytes, bad[i].len, &cp), 0, "case %zu",
                     i);
        cr_assert_eq(cp, -1);
        cr_assert(!duet_utf8_valid(bad[i].bytes, bad[i].len), "case %zu", i);
    }
    cr_assert(duet_utf8_valid("a\0b \xe2\x82\xac \xf0\x9f\x98\x80", 12), "NULs are well formed");
    cr_assert(duet_utf8_valid("", 0));
}

Test(common_utf8, isspace_is_pythons, .timeout = 10)
{
    /* str.isspace() is true for exactly these (Python 3.11, every code point checked). */
    static const uint32_t space[] = {0x09,   0x0a,   0x0b,   0x0c,   0x0d,   0x1c,   0x1d,   0x1e,
                                     0x1f,   0x20,   0x85,   0xa0,   0x1680, 0x2000, 0x2001, 0x2002,
                                     0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a,
                                     0x2028, 0x2029, 0x202f, 0x205f, 0x3000};
    size_t n = 0;
    for (uint32_t cp = 0; cp <= 0x10ffff; cp++)
        n += duet_unicode_isspace(cp);
    cr_assert_eq(n, sizeof(space) / sizeof(space[0]));
    for (size_t i = 0; i < sizeof(space) / sizeof(space[0]); i++)
        cr_assert(duet_unicode_isspace(space[i]), "U+%04X", space[i]);
    cr_assert(!duet_unicode_isspace(0x180e) && !duet_unicode_isspace(0x200b));
}
