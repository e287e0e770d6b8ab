/*
 * UTF-8 as Unicode defines it well-formed (no overlong forms, no surrogates, nothing past
 * U+10FFFF): the one validator the router, the Jinja engine and the tokenizer share, and the one
 * whitespace test they share. (The
 * streaming detokenizer keeps its own byte-at-a-time state machine, tokenizer/detok.c.)
 */
#ifndef DUET_COMMON_UTF8_H
#define DUET_COMMON_UTF8_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/*
 * The character at s (n > 0 bytes available): its length in bytes (1..4), with its code point
 * in *cp_p when cp_p is not NULL; 0 when the bytes there are ill-formed or truncated (*cp_p is
 * then -1).
 */
size_t duet_utf8_char(const uint8_t *s, size_t n, int32_t *cp_p);

/* Whether the len bytes at s are well-formed UTF-8 (NULs included). */
bool duet_utf8_valid(const char *s, size_t len);

/*
 * Python's str.isspace() for one code point: general category Zs, or bidirectional class WS, B
 * or S (what Jinja's string methods and Kimi's tokenizer run splitting test). The set has not
 * changed since Unicode 6.3 took U+180E out of Zs.
 */
bool duet_unicode_isspace(uint32_t cp);

/* The value of one hexadecimal digit (0-9, a-f, A-F), -1 for any other byte. */
int duet_hex_digit(int c);

#endif
