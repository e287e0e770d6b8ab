/*
 * The check the HTTP-facing fuzz targets (fuzz_http, fuzz_admin) share: what a server wrote to a
 * client must be a valid stream of HTTP/1.x responses. Parsed with http-parser in response mode
 * (an independent reader, not the server's writer); a broken stream aborts (a finding).
 */
#ifndef DUET_FUZZ_HTTP_CHECK_H
#define DUET_FUZZ_HTTP_CHECK_H

#include <stdbool.h>
#include <stddef.h>

typedef struct {
    /* Response k's status line and headers are in: return true when it answers a HEAD request
     * (its body is then not read). May be NULL (no HEAD requests). */
    bool (*is_head)(void *user, size_t k, int status);
    /* Response k is complete: its status, Content-Type ("" when none) and body. May be NULL. */
    void (*on_response)(void *user, size_t k, int status, const char *ctype, const char *body,
                        size_t len);
    void *user;
} fuzz_http_resp_cb_t;

/* Check out[0..len) (the client's EOF follows it); returns the number of complete responses. */
size_t fuzz_http_check_responses(const char *out, size_t len, const fuzz_http_resp_cb_t *cb);

#endif
