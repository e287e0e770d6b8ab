/*
 * Streaming detokenizer: ids in, complete UTF-8 out.
 *
 * Byte-level BPE splits characters across tokens (an emoji is often three ids), so a stream that
 * printed each token's bytes would emit broken characters. This keeps the bytes of an unfinished
 * character (at most 3) and validates as it goes, by the Unicode rules (no overlongs, surrogates
 * or code points past U+10FFFF): an ill-formed sequence becomes one U+FFFD per maximal subpart,
 * the replacement practice of Unicode §3.9 and of WHATWG's decoder, so the router's output is
 * always valid UTF-8. The output buffer is sized once from the longest token: feeding never
 * allocates.
 */
#include "tokenizer/tokenizer_impl.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

struct duet_detok {
    const duet_tokenizer_t *tok; /* not owned; must outlive the detokenizer */
    unsigned flags;
    uint8_t pending[4]; /* bytes of an unfinished character */
    uint8_t n_pending;
    uint8_t need; /* total length of that character */
    char *out;    /* (out_cap) output of the last call, owned */
    size_t out_cap;
};

static const uint8_t duet__detok_fffd[3] = {0xef, 0xbf, 0xbd};

duet_status_t duet_detok_create(const duet_tokenizer_t *tok, unsigned flags, duet_detok_t **detok_p)
{
    if (tok == NULL || detok_p == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "detokenizer: NULL argument");
    duet_detok_t *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "detokenizer: no memory");
    /* Worst case: every held and new byte is ill-formed and becomes 3 bytes of U+FFFD. */
    d->out_cap = 3 * (tok->max_token_len + 4);
    d->out = malloc(d->out_cap);
    if (d->out == NULL) {
        free(d);
        return DUET_FAIL(DUET_ERR_NOMEM, "detokenizer: no memory");
    }
    d->tok = tok;
    d->flags = flags;
    *detok_p = d;
    return DUET_OK;
}

void duet_detok_destroy(duet_detok_t *detok)
{
    if (detok == NULL)
        return;
    free(detok->out);
    free(detok);
}

void duet_detok_reset(duet_detok_t *detok)
{
    detok->n_pending = 0;
    detok->need = 0;
}

/* Whether b may follow the lead byte `lead` as continuation number `pos` (1-based). */
static bool cont_ok(uint8_t lead, size_t pos, uint8_t b)
{
    if (pos == 1) {
        switch (lead) {
        case 0xe0:
            return b >= 0xa0 && b <= 0xbf;
        case 0xed:
            return b >= 0x80 && b <= 0x9f;
        case 0xf0:
            return b >= 0x90 && b <= 0xbf;
        case 0xf4:
            return b >= 0x80 && b <= 0x8f;
        default:
            break;
        }
    }
    return b >= 0x80 && b <= 0xbf;
}

static void put(duet_detok_t *d, size_t *n, const uint8_t *p, size_t len)
{
    DUET_ASSERT(*n + len <= d->out_cap);
    memcpy(d->out + *n, p, len);
    *n += len;
}

/* Run one byte through the validator, appending what it completes. */
static void push_byte(duet_detok_t *d, uint8_t b, size_t *n)
{
    if (d->n_pending > 0) {
        if (cont_ok(d->pending[0], d->n_pending, b)) {
            d->pending[d->n_pending++] = b;
            if (d->n_pending == d->need) {
                put(d, n, d->pending, d->n_pending);
                d->n_pending = 0;
            }
            return;
        }
        /* The held bytes are a maximal subpart: one U+FFFD; b starts afresh. */
        put(d, n, duet__detok_fffd, 3);
        d->n_pending = 0;
    }
    if (b < 0x80) {
        put(d, n, &b, 1);
    } else if (b >= 0xc2 && b <= 0xf4) {
        d->pending[0] = b;
        d->n_pending = 1;
        d->need = b < 0xe0 ? 2 : b < 0xf0 ? 3 : 4;
    } else {
        put(d, n, duet__detok_fffd, 3); /* stray continuation, C0, C1, F5..FF */
    }
}

duet_status_t duet_detok_feed(duet_detok_t *detok, uint32_t id, const char **text_p, size_t *len_p)
{
    if (detok == NULL || text_p == NULL || len_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "detokenizer feed: NULL argument");
    const uint8_t *p;
    size_t len;
    duet_status_t st = duet_tokenizer_token_bytes(detok->tok, id, &p, &len);
    if (st < 0)
        return st;
    size_t n = 0;
    if (!((detok->flags & DUET_DETOK_SKIP_SPECIAL) && duet_tokenizer_is_skipped(detok->tok, id)))
        for (size_t i = 0; i < len; i++)
            push_byte(detok, p[i], &n);
    *text_p = detok->out;
    *len_p = n;
    return DUET_OK;
}

duet_status_t duet_detok_flush(duet_detok_t *detok, const char **text_p, size_t *len_p)
{
    if (detok == NULL || text_p == NULL || len_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "detokenizer flush: NULL argument");
    size_t n = 0;
    if (detok->n_pending > 0)
        put(detok, &n, duet__detok_fffd, 3);
    duet_detok_reset(detok);
    *text_p = detok->out;
    *len_p = n;
    return DUET_OK;
}
