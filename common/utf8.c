/* utf8.c: see utf8.h. The table of well-formed byte sequences is Unicode's Table 3-7. */
#include "common/utf8.h"

size_t duet_utf8_char(const uint8_t *s, size_t n, int32_t *cp_p)
{
    uint8_t c = s[0];
    size_t need;
    uint8_t lo = 0x80, hi = 0xbf; /* the second byte's range */
    if (cp_p != NULL)
        *cp_p = -1;
    if (c < 0x80) {
        if (cp_p != NULL)
            *cp_p = c;
        return 1;
    }
    if (c >= 0xc2 && c <= 0xdf)
        need = 2;
    else if (c == 0xe0)
        need = 3, lo = 0xa0; /* no overlongs */
    else if (c == 0xed)
        need = 3, hi = 0x9f; /* no surrogates */
    else if (c >= 0xe1 && c <= 0xef)
        need = 3;
    else if (c == 0xf0)
        need = 4, lo = 0x90; /* no overlongs */
    else if (c == 0xf4)
        need = 4, hi = 0x8f; /* nothing past U+10FFFF */
    else if (c >= 0xf1 && c <= 0xf3)
        need = 4;
    else
        return 0;
    if (n < need || s[1] < lo || s[1] > hi)
        return 0;
    int32_t cp = c & (0x7f >> need);
    for (size_t i = 1; i < need; i++) {
        if (i > 1 && (s[i] & 0xc0) != 0x80)
            return 0;
        cp = cp << 6 | (s[i] & 0x3f);
    }
    if (cp_p != NULL)
        *cp_p = cp;
    return need;
}

bool duet_utf8_valid(const char *s, size_t len)
{
    const uint8_t *p = (const uint8_t *)s;
    for (size_t i = 0; i < len;) {
        if (p[i] < 0x80) {
            i++;
            continue;
        }
        size_t k = duet_utf8_char(p + i, len - i, NULL);
        if (k == 0)
            return false;
        i += k;
    }
    return true;
}

bool duet_unicode_isspace(uint32_t c)
{
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

int duet_hex_digit(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}
