/*
 * Incremental reader of an OpenAI streaming response (Server-Sent Events) for duet-bench.
 *
 * Bytes arrive in whatever pieces the socket gives (a chunk may split a line, a "\r\n", a UTF-8
 * sequence or a JSON string anywhere); serving_stream_feed() takes each piece with the time it
 * arrived and keeps what the metrics need: when the first text chunk came, the gaps between
 * text chunks, and usage from the final chunk. The SSE framing follows the WHATWG rules that
 * matter here: lines end in "\n", "\r\n" or "\r"; "data:" lines (one optional space after the
 * colon) of one event are joined with "\n"; a blank line ends the event; ":" lines are comments;
 * "event: error" marks an error event; other fields are ignored.
 *
 * Each event's data is "[DONE]" or one JSON object: a completions chunk (choices[i].text), a
 * chat chunk (choices[i].delta.content), a usage chunk (usage.{prompt,completion}_tokens, with
 * empty choices), or an error ({"error": {...}}). A chunk "carries text" when some choice's text
 * is a non-empty string.
 *
 * Anything else is a failure with a reason, never a crash: malformed JSON, a non-object, wrong
 * types, an error event, a line over SERVING_SSE_MAX_LINE bytes, data after [DONE], a stream that
 * ends before [DONE]. After the first failure the stream ignores further input.
 *
 * The struct is public so requests can embed it; treat the fields as read-only.
 */
#ifndef DUET_BENCH_SERVING_SSE_H
#define DUET_BENCH_SERVING_SSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define SERVING_SSE_MAX_LINE (1u << 20) /* longest line accepted, bytes */

typedef struct {
    /* framing */
    char *line; /* owned: the line being assembled */
    size_t line_len, line_cap;
    char *data; /* owned: the data lines of the current event, joined with '\n' */
    size_t data_len, data_cap;
    bool has_data;    /* the current event had a data line */
    bool event_error; /* the current event was "event: error" */
    bool prev_cr;     /* the last byte was '\r': a following '\n' belongs to it */
    /* what the stream said */
    bool done;              /* "[DONE]" seen */
    bool failed;            /* see error */
    char error[256];        /* the reason, when failed */
    uint32_t n_text_chunks; /* chunks that carried text */
    uint64_t first_text_ns; /* arrival time of the first of them (0 = none yet) */
    uint64_t last_text_ns;
    double *itl_ms; /* owned, (n_itl): gaps between successive text chunks */
    size_t n_itl, itl_cap;
    char *text; /* owned, (text_len) + NUL: the text of every choice, concatenated in order
                   (NULL until some text came) */
    size_t text_len, text_cap;
    bool has_usage; /* a usage object with completion_tokens was seen */
    uint32_t usage_prompt_tokens;
    uint32_t usage_completion_tokens;
} serving_stream_t;

/* An empty stream reader. */
void serving_stream_init(serving_stream_t *s);

/* Free what the reader owns and return it to the empty state. Accepts NULL. */
void serving_stream_free(serving_stream_t *s);

/*
 * Consume len bytes that arrived at now_ns (any monotonic clock in ns). Returns DUET_OK, or
 * DUET_ERR_FORMAT / DUET_ERR_NOMEM once the stream failed (the reason is in s->error; later calls
 * return the same without reading).
 */
duet_status_t serving_stream_feed(serving_stream_t *s, const char *data, size_t len,
                                  uint64_t now_ns);

/*
 * The response ended (EOF or end of the HTTP body). DUET_OK when the stream was complete
 * ([DONE] seen, nothing pending), else DUET_ERR_FORMAT with the reason in s->error.
 */
duet_status_t serving_stream_finish(serving_stream_t *s);

/* Mark the stream failed with a reason (printf format) unless it failed already. */
duet_status_t serving_stream_fail(serving_stream_t *s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
