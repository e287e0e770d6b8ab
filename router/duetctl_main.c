/*
 * duetctl: the operator's command-line client for the router's admin API (router/cluster/admin.h).
 *
 *   duetctl [--admin URL] [--token T] [--json] status
 *   duetctl drain <worker> [--migrate] [--wait] [--timeout S]
 *   duetctl undrain <worker>
 *   duetctl admission pause | resume | set [--max-inflight N] [--max-queue N]
 *   duetctl log-level [LEVEL]
 *
 * --json (any command) prints the admin API's answer as one JSON document instead of text.
 *
 * The HTTP client is deliberately small and blocking: one connection per call with
 * "Connection: close", a connect and an overall deadline enforced with poll(2), a cap on the
 * response size, and a parser for the status line, Content-Length, chunked bodies and
 * read-until-close. Exit codes: 0 ok, 1 usage error, 2 connection or HTTP protocol error,
 * 3 the server answered with an error status (its message is printed).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "router/cluster/admin.h"
#include "common/version.h"

#define EXIT_OK      0
#define EXIT_USAGE   1
#define EXIT_CONN    2
#define EXIT_REFUSED 3

#define MAX_RESPONSE_BYTES (4u << 20)
#define CONNECT_TIMEOUT_MS 5000
#define REQUEST_TIMEOUT_MS 30000

static const char *const usage_main =
    "usage: duetctl [--admin URL] [--token T] COMMAND [ARGS]\n"
    "\n"
    "Operate a duet router through its admin API.\n"
    "\n"
    "commands:\n"
    "  status                          workers (role, state, load) and admission\n"
    "  drain <worker> [--migrate] [--wait] [--timeout S]\n"
    "                                  stop placing new requests on a worker (--migrate: move\n"
    "                                  its running requests to other generation workers)\n"
    "  undrain <worker>                put a drained worker back in service\n"
    "  admission pause|resume          refuse / accept new requests (503 while paused)\n"
    "  admission set [--max-inflight N] [--max-queue N]\n"
    "                                  change admission limits at run time\n"
    "  log-level [LEVEL]               show, or set (error, warn, info, debug, trace), the log\n"
    "                                  level of the router and its workers at run time\n"
    "\n"
    "options:\n"
    "  --admin URL   admin API address (default: the admin file's, else\n"
    "                http://127.0.0.1:8081)\n"
    "  --token T     bearer token (default: $DUET_ADMIN_TOKEN, else the admin file's)\n"
    "  --json        print the answer as JSON (any command)\n"
    "  -h, --help    this help; 'duetctl COMMAND --help' for a command\n"
    "  --version     the version, git commit and CUDA build\n"
    "\n"
    "The admin file ($DUET_ADMIN_FILE, else ~/.duet/admin) is where `duet up` leaves its\n"
    "router's admin URL and token, so that plain `duetctl status` reaches it.\n"
    "\n"
    "exit status: 0 ok, 1 usage error, 2 connection or HTTP error, 3 the server refused\n"
    "(401 bad token, 404 unknown worker, 409 conflict, 504 drain wait timed out, ...).\n";

static const char *const usage_status =
    "usage: duetctl status\n"
    "\n"
    "Print every worker the router knows (name, role, state live/draining/dead, address,\n"
    "device and dtype, uptime, age of its last heartbeat, utilisation = time in forward steps,\n"
    "KV cache use, running and queued requests) and the admission state.\n";

static const char *const usage_log_level =
    "usage: duetctl log-level [error|warn|info|debug|trace]\n"
    "\n"
    "Without an argument, print the router's log level; with one, set it at once on the\n"
    "router and on every live worker (until they restart: the log.level key is the default).\n";

static const char *const usage_drain =
    "usage: duetctl drain <worker> [--migrate] [--wait] [--timeout S]\n"
    "\n"
    "Mark a worker draining: the router places no new requests on it; running ones finish.\n"
    "  --migrate     a generation worker: move its running requests, mid-decode, to other\n"
    "                generation workers (their caches go over UCX; a client's stream only\n"
    "                pauses); a request no other worker can take finishes where it is\n"
    "  --wait        return only when the worker has no running requests\n"
    "  --timeout S   with --wait: give up after S seconds (exit 3; the worker stays draining)\n";

static const char *const usage_undrain = "usage: duetctl undrain <worker>\n"
                                         "\n"
                                         "Put a draining worker back in service.\n";

static const char *const usage_admission =
    "usage: duetctl admission pause | resume | set [--max-inflight N] [--max-queue N]\n"
    "\n"
    "  pause                 new requests get 503 (queued ones wait for resume or deadline)\n"
    "  resume                accept new requests again\n"
    "  set                   change the limits: --max-inflight N (>= 1) requests running at\n"
    "                        once, --max-queue N (>= 0) waiting; lowering never cuts running\n"
    "                        requests\n";

static void die_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static void die_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("duetctl: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs("\n(see duetctl --help)\n", stderr);
    va_end(ap);
    exit(EXIT_USAGE);
}

/* ------------------------------------------------------------------ URL */

typedef struct {
    char host[256];
    char port[8];
    char prefix[256]; /* path prefix without trailing '/', "" for none */
    char text[600];   /* as given, for messages */
} url_t;

static bool url_parse(const char *s, url_t *u, char *err, size_t cap)
{
    memset(u, 0, sizeof(*u));
    snprintf(u->text, sizeof(u->text), "%s", s);
    const char *p = s;
    if (strncasecmp(p, "http://", 7) == 0) {
        p += 7;
    } else if (strstr(p, "://") != NULL) {
        snprintf(err, cap, "unsupported URL scheme in \"%s\" (only http:// is supported)", s);
        return false;
    }
    const char *host = p, *host_end;
    if (*p == '[') {
        host = p + 1;
        host_end = strchr(host, ']');
        if (host_end == NULL) {
            snprintf(err, cap, "bad URL \"%s\": unterminated [IPv6 address]", s);
            return false;
        }
        p = host_end + 1;
    } else {
        host_end = p + strcspn(p, ":/");
        p = host_end;
    }
    size_t hl = (size_t)(host_end - host);
    if (hl == 0 || hl >= sizeof(u->host)) {
        snprintf(err, cap, "bad URL \"%s\": missing or too long host", s);
        return false;
    }
    memcpy(u->host, host, hl);
    snprintf(u->port, sizeof(u->port), "%d", DUET_ADMIN_DEFAULT_PORT);
    if (*p == ':') {
        p++;
        char *end = NULL;
        long port = strtol(p, &end, 10);
        if (end == p || port < 1 || port > 65535 || (*end != '\0' && *end != '/')) {
            snprintf(err, cap, "bad URL \"%s\": port must be 1..65535", s);
            return false;
        }
        snprintf(u->port, sizeof(u->port), "%ld", port);
        p = end;
    } else if (*p != '\0' && *p != '/') {
        snprintf(err, cap, "bad URL \"%s\"", s);
        return false;
    }
    size_t pl = strlen(p);
    while (pl > 0 && p[pl - 1] == '/')
        pl--;
    if (pl >= sizeof(u->prefix)) {
        snprintf(err, cap, "bad URL \"%s\": path too long", s);
        return false;
    }
    memcpy(u->prefix, p, pl);
    return true;
}

/* ------------------------------------------------------------------ HTTP client */

typedef struct {
    int status;
    char *body; /* malloc'd, NUL-terminated */
    size_t body_len;
} http_response_t;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait for fd to become ready for `events` until deadline; false on timeout or error. */
static bool wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        int64_t left = deadline - now_ms();
        if (left <= 0)
            return false;
        struct pollfd p = {fd, events, 0};
        int r = poll(&p, 1, (int)(left > 1000000 ? 1000000 : left));
        if (r > 0)
            return true;
        if (r < 0 && errno != EINTR)
            return false;
    }
}

static int connect_to(const url_t *u, int64_t deadline, char *err, size_t cap)
{
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int gai = getaddrinfo(u->host, u->port, &hints, &res);
    if (gai != 0) {
        snprintf(err, cap, "cannot resolve %s: %s", u->host, gai_strerror(gai));
        return -1;
    }
    int fd = -1, last_errno = 0;
    int64_t connect_deadline = now_ms() + CONNECT_TIMEOUT_MS;
    if (connect_deadline > deadline)
        connect_deadline = deadline;
    for (struct addrinfo *a = res; a != NULL && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
            if (errno != EINPROGRESS) {
                last_errno = errno;
            } else if (!wait_fd(fd, POLLOUT, connect_deadline)) {
                last_errno = ETIMEDOUT;
            } else {
                int so = 0;
                socklen_t sl = sizeof(so);
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl);
                last_errno = so;
            }
            if (last_errno != 0) {
                close(fd);
                fd = -1;
            }
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        snprintf(err, cap, "cannot connect to %s: %s", u->text, strerror(last_errno));
    return fd;
}

/* Decode a chunked body in place; false when malformed. */
static bool dechunk(char *b, size_t len, size_t *out_len)
{
    size_t r = 0, w = 0;
    for (;;) {
        char *eol = memmem(b + r, len - r, "\r\n", 2);
        if (eol == NULL)
            return false;
        char *end = NULL;
        errno = 0;
        unsigned long n = strtoul(b + r, &end, 16);
        if (end == b + r || errno != 0 || (end != eol && *end != ';'))
            return false;
        r = (size_t)(eol - b) + 2;
        if (n == 0)
            break;
        if (n > len - r || len - r - n < 2 || memcmp(b + r + n, "\r\n", 2) != 0)
            return false;
        memmove(b + w, b + r, n);
        w += n;
        r += n + 2;
    }
    b[w] = '\0';
    *out_len = w;
    return true;
}

/*
 * One request. Returns EXIT_OK with *resp filled (any status), or EXIT_CONN with err set.
 */
static int http_call(const url_t *u, const char *method, const char *path, const char *token,
                     const char *body, int64_t timeout_ms, http_response_t *resp, char *err,
                     size_t cap)
{
    int64_t deadline = now_ms() + timeout_ms;
    memset(resp, 0, sizeof(*resp));
    int fd = connect_to(u, deadline, err, cap);
    if (fd < 0)
        return EXIT_CONN;
    size_t body_len = body != NULL ? strlen(body) : 0;
    char *req = NULL;
    int n = asprintf(
        &req,
        "%s %s%s HTTP/1.1\r\nHost: %s:%s\r\nUser-Agent: duetctl\r\nAccept: "
        "application/json\r\nConnection: close\r\n%s%s%s%sContent-Length: %zu\r\n\r\n%s",
        method, u->prefix, path, u->host, u->port, token != NULL ? "Authorization: Bearer " : "",
        token != NULL ? token : "", token != NULL ? "\r\n" : "",
        body_len > 0 ? "Content-Type: application/json\r\n" : "", body_len,
        body != NULL ? body : "");
    if (n < 0) {
        close(fd);
        snprintf(err, cap, "out of memory");
        return EXIT_CONN;
    }
    size_t off = 0;
    while (off < (size_t)n) {
        ssize_t w = send(fd, req + off, (size_t)n - off, MSG_NOSIGNAL);
        if (w > 0) {
            off += (size_t)w;
        } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
            if (!wait_fd(fd, POLLOUT, deadline)) {
                snprintf(err, cap, "%s: timed out sending the request", u->text);
                goto fail;
            }
        } else {
            snprintf(err, cap, "%s: send: %s", u->text, strerror(errno));
            goto fail;
        }
    }
    free(req);
    req = NULL;

    size_t len = 0, cap_b = 8192;
    char *buf = malloc(cap_b);
    if (buf == NULL) {
        snprintf(err, cap, "out of memory");
        goto fail;
    }
    for (;;) {
        if (len + 1 >= cap_b) {
            if (cap_b >= MAX_RESPONSE_BYTES + 1) {
                snprintf(err, cap, "%s: response larger than %u bytes", u->text,
                         MAX_RESPONSE_BYTES);
                free(buf);
                goto fail;
            }
            cap_b *= 2;
            char *nb = realloc(buf, cap_b);
            if (nb == NULL) {
                free(buf);
                snprintf(err, cap, "out of memory");
                goto fail;
            }
            buf = nb;
        }
        ssize_t r = recv(fd, buf + len, cap_b - 1 - len, 0);
        if (r > 0) {
            len += (size_t)r;
        } else if (r == 0) {
            break;
        } else if (errno == EAGAIN || errno == EINTR) {
            if (!wait_fd(fd, POLLIN, deadline)) {
                snprintf(err, cap, "%s: timed out after %.1f s waiting for the response", u->text,
                         timeout_ms / 1000.0);
                free(buf);
                goto fail;
            }
        } else {
            snprintf(err, cap, "%s: connection error: %s", u->text, strerror(errno));
            free(buf);
            goto fail;
        }
    }
    close(fd);
    buf[len] = '\0';

    int major = 0, minor = 0, status = 0;
    char *hdr_end = memmem(buf, len, "\r\n\r\n", 4);
    if (hdr_end == NULL || sscanf(buf, "HTTP/%d.%d %3d", &major, &minor, &status) != 3 ||
        major != 1 || status < 100 || status > 599) {
        snprintf(err, cap, "%s: not an HTTP/1.x response%s", u->text,
                 len == 0 ? " (connection closed without an answer)" : "");
        free(buf);
        return EXIT_CONN;
    }
    *hdr_end = '\0';
    char *b = hdr_end + 4;
    size_t blen = len - (size_t)(b - buf);
    bool chunked = false;
    long long content_length = -1;
    for (char *line = strstr(buf, "\r\n"); line != NULL; line = strstr(line, "\r\n")) {
        line += 2;
        if (strncasecmp(line, "Content-Length:", 15) == 0)
            content_length = strtoll(line + 15, NULL, 10);
        else if (strncasecmp(line, "Transfer-Encoding:", 18) == 0 &&
                 strcasestr(line, "chunked") != NULL)
            chunked = true;
    }
    if (chunked) {
        if (!dechunk(b, blen, &blen)) {
            snprintf(err, cap, "%s: malformed chunked response body", u->text);
            free(buf);
            return EXIT_CONN;
        }
    } else if (content_length >= 0) {
        if ((unsigned long long)content_length > blen) {
            snprintf(err, cap, "%s: response body cut short (%zu of %lld bytes)", u->text, blen,
                     content_length);
            free(buf);
            return EXIT_CONN;
        }
        blen = (size_t)content_length;
    }
    resp->status = status;
    resp->body = malloc(blen + 1);
    if (resp->body == NULL) {
        free(buf);
        snprintf(err, cap, "out of memory");
        return EXIT_CONN;
    }
    memcpy(resp->body, b, blen);
    resp->body[blen] = '\0';
    resp->body_len = blen;
    free(buf);
    return EXIT_OK;

fail:
    free(req);
    close(fd);
    return EXIT_CONN;
}

/* ------------------------------------------------------------------ commands */

typedef struct {
    url_t url;
    const char *token;
    bool json; /* --json: print the answers, not text */
} ctl_t;

/* --json: one answer (or an object of several) as indented JSON on stdout. */
static void print_json(json_t *j)
{
    char *text = json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS);
    if (text != NULL)
        printf("%s\n", text);
    free(text);
}

/*
 * Call the admin API and parse a JSON object answer into *json_p. Prints the error and returns
 * the exit code on failure.
 */
static int admin_call(const ctl_t *c, const char *method, const char *path, const char *body,
                      int64_t timeout_ms, json_t **json_p)
{
    char err[1024];
    http_response_t r;
    int rc = http_call(&c->url, method, path, c->token, body, timeout_ms, &r, err, sizeof(err));
    if (rc != EXIT_OK) {
        fprintf(stderr, "duetctl: %s\n", err);
        return rc;
    }
    json_t *j = json_loadb(r.body, r.body_len, 0, NULL);
    if (r.status < 200 || r.status > 299) {
        json_t *m = json_object_get(json_object_get(j, "error"), "message");
        const char *msg = json_is_string(m) ? json_string_value(m) : r.body;
        fprintf(stderr, "duetctl: server refused (HTTP %d): %s\n", r.status, msg);
        if (r.status == 401)
            fprintf(stderr, "duetctl: pass the admin token with --token or DUET_ADMIN_TOKEN\n");
        json_decref(j);
        free(r.body);
        return EXIT_REFUSED;
    }
    if (!json_is_object(j)) {
        fprintf(stderr, "duetctl: %s%s: the server's answer is not a JSON object\n", c->url.text,
                path);
        json_decref(j);
        free(r.body);
        return EXIT_CONN;
    }
    free(r.body);
    *json_p = j;
    return EXIT_OK;
}

static long long jint(json_t *o, const char *key)
{
    return (long long)json_integer_value(json_object_get(o, key));
}

static const char *jstr(json_t *o, const char *key)
{
    const char *s = json_string_value(json_object_get(o, key));
    return s != NULL ? s : "?";
}

/* A string field, "-" when absent or empty (an older worker did not say). */
static const char *jdash(json_t *o, const char *key)
{
    const char *s = json_string_value(json_object_get(o, key));
    return s != NULL && s[0] != '\0' ? s : "-";
}

/* 42s, 3m07s, 5h02m, 2d03h. */
static void fmt_duration(long long s, char *out, size_t cap)
{
    if (s < 60)
        snprintf(out, cap, "%llds", s);
    else if (s < 3600)
        snprintf(out, cap, "%lldm%02llds", s / 60, s % 60);
    else if (s < 86400)
        snprintf(out, cap, "%lldh%02lldm", s / 3600, s % 3600 / 60);
    else
        snprintf(out, cap, "%lldd%02lldh", s / 86400, s % 86400 / 3600);
}

static void print_admission(json_t *a)
{
    json_t *rej = json_object_get(a, "rejected_total");
    /* the limit is max_inflight unless the generation workers hold fewer requests */
    const long long max = jint(a, "max_inflight"),
                    limit = json_is_integer(json_object_get(a, "limit")) ? jint(a, "limit") : max;
    char why[96] = "";
    if (limit < max)
        snprintf(why, sizeof(why), " (the generation workers' slots; max_inflight %lld)", max);
    printf("admission: %s%s, in flight %lld/%lld%s, queued %lld/%lld; admitted %lld, rejected: "
           "queue_full %lld, paused %lld, no_capacity %lld, expired %lld\n",
           json_is_true(json_object_get(a, "paused")) ? "PAUSED" : "accepting",
           json_is_false(json_object_get(a, "has_capacity")) ? " (no generation capacity)" : "",
           jint(a, "in_flight"), limit, why, jint(a, "queued"), jint(a, "max_queue"),
           jint(a, "admitted_total"), jint(rej, "queue_full"), jint(rej, "paused"),
           jint(rej, "no_capacity"), jint(rej, "expired"));
}

static int cmd_status(const ctl_t *c)
{
    json_t *w = NULL, *a = NULL;
    int rc = admin_call(c, "GET", "/admin/workers", NULL, REQUEST_TIMEOUT_MS, &w);
    if (rc != EXIT_OK)
        return rc;
    rc = admin_call(c, "GET", "/admin/admission", NULL, REQUEST_TIMEOUT_MS, &a);
    if (rc != EXIT_OK) {
        json_decref(w);
        return rc;
    }
    json_t *ws = json_object_get(w, "workers");
    if (c->json) {
        json_t *both = json_pack("{s:O,s:O}", "workers", ws, "admission", a);
        print_json(both);
        json_decref(both);
        json_decref(w);
        json_decref(a);
        return EXIT_OK;
    }
    int name_w = 6;
    for (size_t i = 0; i < json_array_size(ws); i++) {
        int l = (int)strlen(jstr(json_array_get(ws, i), "name"));
        if (l > name_w)
            name_w = l;
    }
    printf("%-*s  %-4s  %-8s  %-21s  %-6s  %-5s  %8s  %6s  %5s  %-17s  %7s  %6s\n", name_w,
           "WORKER", "ROLE", "STATE", "ADDRESS", "DEVICE", "DTYPE", "UPTIME", "HB_AGE", "UTIL",
           "CACHE_USED", "RUNNING", "QUEUED");
    for (size_t i = 0; i < json_array_size(ws); i++) {
        json_t *o = json_array_get(ws, i), *load = json_object_get(o, "load");
        const long long pages = jint(load, "kv_pages"), free_pages = jint(load, "free_pages");
        char up[64], age[64], util[64], cache[96];
        fmt_duration(jint(o, "uptime_s"), up, sizeof(up));
        snprintf(age, sizeof(age), "%.1fs", (double)jint(o, "heartbeat_age_ms") / 1000.0);
        snprintf(util, sizeof(util), "%.0f%%",
                 100.0 * json_number_value(json_object_get(o, "utilisation")));
        if (pages > 0)
            snprintf(cache, sizeof(cache), "%lld/%lld %.0f%%", pages - free_pages, pages,
                     100.0 * (double)(pages - free_pages) / (double)pages);
        else
            snprintf(cache, sizeof(cache), "-");
        printf("%-*s  %-4s  %-8s  %-21s  %-6s  %-5s  %8s  %6s  %5s  %-17s  %7lld  %6lld\n", name_w,
               jstr(o, "name"), jstr(o, "role"), jstr(o, "state"), jdash(o, "address"),
               jdash(o, "device"), jdash(o, "dtype"), up, age, util, cache, jint(load, "running"),
               jint(load, "queued"));
    }
    if (json_array_size(ws) == 0)
        printf("(no workers registered)\n");
    print_admission(a);
    json_decref(w);
    json_decref(a);
    return EXIT_OK;
}

/* Percent-encode a worker name for the path (names are printable ASCII). */
static void encode_name(const char *name, char *out, size_t cap)
{
    size_t k = 0;
    for (const unsigned char *p = (const unsigned char *)name; *p != '\0' && k + 4 < cap; p++) {
        if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
            *p == '-' || *p == '_' || *p == '.' || *p == '~') {
            out[k++] = (char)*p;
        } else {
            k += (size_t)snprintf(out + k, cap - k, "%%%02X", *p);
        }
    }
    out[k] = '\0';
}

static bool parse_number(const char *s, double min, double max, double *v_p)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || errno != 0 || !(v >= min) || !(v <= max))
        return false;
    *v_p = v;
    return true;
}

static int cmd_drain(const ctl_t *c, int argc, char **argv)
{
    const char *worker = NULL;
    bool wait = false, migrate = false;
    double timeout_s = -1;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(usage_drain, stdout);
            return EXIT_OK;
        } else if (strcmp(argv[i], "--wait") == 0) {
            wait = true;
        } else if (strcmp(argv[i], "--migrate") == 0) {
            migrate = true;
        } else if (strcmp(argv[i], "--timeout") == 0 || strncmp(argv[i], "--timeout=", 10) == 0) {
            const char *v = argv[i][9] == '=' ? argv[i] + 10 : (i + 1 < argc ? argv[++i] : NULL);
            if (v == NULL || !parse_number(v, 0.001, 3600, &timeout_s))
                die_usage("drain: --timeout needs seconds in (0, 3600], got \"%s\"",
                          v != NULL ? v : "");
        } else if (argv[i][0] == '-') {
            die_usage("drain: unknown option %s", argv[i]);
        } else if (worker == NULL) {
            worker = argv[i];
        } else {
            die_usage("drain: one worker at a time (got \"%s\" and \"%s\")", worker, argv[i]);
        }
    }
    if (worker == NULL)
        die_usage("drain: which worker? (duetctl status lists them)");
    if (timeout_s > 0 && !wait)
        die_usage("drain: --timeout only applies with --wait");
    char enc[768], path[1024];
    encode_name(worker, enc, sizeof(enc));
    char query[96] = "";
    snprintf(query, sizeof(query), "%s%s", migrate ? "&migrate=1" : "", wait ? "&wait=1" : "");
    if (wait && timeout_s > 0)
        snprintf(query + strlen(query), sizeof(query) - strlen(query), "&timeout_s=%g", timeout_s);
    if (query[0] != '\0')
        query[0] = '?';
    snprintf(path, sizeof(path), "/admin/workers/%s/drain%s", enc, query);
    /* The server ends the wait (its default or --timeout); give it room to answer. */
    int64_t timeout_ms =
        wait ? (int64_t)((timeout_s > 0 ? timeout_s : 3600) * 1000) + 10000 : REQUEST_TIMEOUT_MS;
    if (wait)
        fprintf(stderr, "duetctl: draining %s, waiting for its running requests to %s...\n", worker,
                migrate ? "move or finish" : "finish");
    json_t *j = NULL;
    int rc = admin_call(c, "POST", path, NULL, timeout_ms, &j);
    if (rc != EXIT_OK)
        return rc;
    if (c->json)
        print_json(j);
    else if (wait)
        printf("worker %s: drained (no running requests, waited %.1f s)\n", worker,
               jint(j, "waited_ms") / 1000.0);
    else
        printf("worker %s: draining%s%s\n", worker, migrate ? ", moving its requests" : "",
               json_is_true(json_object_get(j, "idle")) ? " (idle)" : " (requests still running)");
    json_decref(j);
    return EXIT_OK;
}

static int cmd_undrain(const ctl_t *c, int argc, char **argv)
{
    const char *worker = NULL;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(usage_undrain, stdout);
            return EXIT_OK;
        } else if (argv[i][0] == '-') {
            die_usage("undrain: unknown option %s", argv[i]);
        } else if (worker == NULL) {
            worker = argv[i];
        } else {
            die_usage("undrain: one worker at a time");
        }
    }
    if (worker == NULL)
        die_usage("undrain: which worker? (duetctl status lists them)");
    char enc[768], path[1024];
    encode_name(worker, enc, sizeof(enc));
    snprintf(path, sizeof(path), "/admin/workers/%s/undrain", enc);
    json_t *j = NULL;
    int rc = admin_call(c, "POST", path, NULL, REQUEST_TIMEOUT_MS, &j);
    if (rc != EXIT_OK)
        return rc;
    if (c->json)
        print_json(j);
    else
        printf("worker %s: live\n", worker);
    json_decref(j);
    return EXIT_OK;
}

static int cmd_admission(const ctl_t *c, int argc, char **argv)
{
    if (argc == 0)
        die_usage("admission: pause, resume or set?");
    const char *sub = argv[0];
    if (strcmp(sub, "--help") == 0 || strcmp(sub, "-h") == 0) {
        fputs(usage_admission, stdout);
        return EXIT_OK;
    }
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(usage_admission, stdout);
            return EXIT_OK;
        }
    json_t *j = NULL;
    int rc;
    if (strcmp(sub, "pause") == 0 || strcmp(sub, "resume") == 0) {
        if (argc > 1)
            die_usage("admission %s: unexpected argument \"%s\"", sub, argv[1]);
        char path[64];
        snprintf(path, sizeof(path), "/admin/admission/%s", sub);
        rc = admin_call(c, "POST", path, NULL, REQUEST_TIMEOUT_MS, &j);
    } else if (strcmp(sub, "set") == 0) {
        double mi = -1, mq = -1;
        for (int i = 1; i < argc; i++) {
            bool is_mi = strncmp(argv[i], "--max-inflight", 14) == 0 &&
                         (argv[i][14] == '\0' || argv[i][14] == '=');
            bool is_mq = strncmp(argv[i], "--max-queue", 11) == 0 &&
                         (argv[i][11] == '\0' || argv[i][11] == '=');
            if (!is_mi && !is_mq)
                die_usage("admission set: unknown argument \"%s\"", argv[i]);
            const char *eq = strchr(argv[i], '=');
            const char *v = eq != NULL ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
            double x = 0; /* upper bounds are the server's to check and explain */
            if (v == NULL || !parse_number(v, is_mi ? 1 : 0, 1e15, &x) || x != (double)(long long)x)
                die_usage("admission set: %s needs an integer %s, got \"%s\"",
                          is_mi ? "--max-inflight" : "--max-queue", is_mi ? ">= 1" : ">= 0",
                          v != NULL ? v : "");
            if (is_mi)
                mi = x;
            else
                mq = x;
        }
        if (mi < 0 && mq < 0)
            die_usage("admission set: give --max-inflight N and/or --max-queue N");
        json_t *body = json_object();
        if (mi >= 0)
            json_object_set_new(body, "max_inflight", json_integer((json_int_t)mi));
        if (mq >= 0)
            json_object_set_new(body, "max_queue", json_integer((json_int_t)mq));
        char *text = json_dumps(body, JSON_COMPACT);
        json_decref(body);
        rc = admin_call(c, "POST", "/admin/admission", text, REQUEST_TIMEOUT_MS, &j);
        free(text);
    } else {
        die_usage("admission: unknown subcommand \"%s\" (pause, resume or set)", sub);
    }
    if (rc != EXIT_OK)
        return rc;
    if (c->json)
        print_json(j);
    else
        print_admission(j);
    json_decref(j);
    return EXIT_OK;
}

static int cmd_log_level(const ctl_t *c, int argc, char **argv)
{
    const char *level = NULL;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(usage_log_level, stdout);
            return EXIT_OK;
        } else if (argv[i][0] == '-' || level != NULL) {
            die_usage("log-level: unexpected argument \"%s\"", argv[i]);
        }
        level = argv[i];
    }
    static const char *const levels[] = {"error", "warn", "info", "debug", "trace"};
    bool known = level == NULL;
    for (size_t i = 0; !known && i < sizeof(levels) / sizeof(levels[0]); i++)
        known = strcmp(level, levels[i]) == 0;
    if (!known)
        die_usage("log-level: \"%s\" is not one of error, warn, info, debug, trace", level);
    json_t *j = NULL;
    int rc;
    if (level == NULL) {
        rc = admin_call(c, "GET", "/admin/log-level", NULL, REQUEST_TIMEOUT_MS, &j);
    } else {
        json_t *body = json_pack("{s:s}", "level", level);
        char *text = json_dumps(body, JSON_COMPACT);
        json_decref(body);
        rc = admin_call(c, "POST", "/admin/log-level", text, REQUEST_TIMEOUT_MS, &j);
        free(text);
    }
    if (rc != EXIT_OK)
        return rc;
    if (c->json)
        print_json(j);
    else if (level == NULL)
        printf("log level: %s\n", jstr(j, "level"));
    else
        printf("log level: %s (was %s; %lld workers told)\n", jstr(j, "level"), jstr(j, "previous"),
               jint(j, "workers"));
    json_decref(j);
    return EXIT_OK;
}

int main(int argc, char **argv)
{
    ctl_t c = {.json = false};
    const char *admin_url = NULL;
    c.token = getenv("DUET_ADMIN_TOKEN");
    /* Global options may appear anywhere; the rest is the command and its arguments. */
    char **rest = calloc((size_t)argc + 1, sizeof(*rest));
    if (rest == NULL)
        return EXIT_CONN;
    int nrest = 0;
    bool help = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--admin") == 0 || strcmp(a, "--token") == 0) {
            if (i + 1 >= argc)
                die_usage("%s needs a value", a);
            if (a[2] == 'a')
                admin_url = argv[++i];
            else
                c.token = argv[++i];
        } else if (strncmp(a, "--admin=", 8) == 0) {
            admin_url = a + 8;
        } else if (strncmp(a, "--token=", 8) == 0) {
            c.token = a + 8;
        } else if (strcmp(a, "--json") == 0) {
            c.json = true;
        } else if ((strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) && nrest == 0) {
            help = true;
        } else if (duet_version_flag(a) && nrest == 0) {
            duet_version_print("duetctl");
            free(rest);
            return EXIT_OK;
        } else {
            rest[nrest++] = argv[i];
        }
    }
    if (help || nrest == 0) {
        fputs(usage_main, help ? stdout : stderr);
        free(rest);
        return help ? EXIT_OK : EXIT_USAGE;
    }
    if (c.token != NULL && c.token[0] == '\0')
        c.token = NULL;
    /* `duet up` leaves its router's URL and token in the admin file: used when --admin is not
     * given (or names the same router), its token when none was given */
    static char file_url[300], file_token[512];
    char file[4096];
    if (duet_admin_file_path(file, sizeof(file)) && access(file, F_OK) == 0) {
        if (duet_admin_file_read(file, file_url, sizeof(file_url), file_token,
                                 sizeof(file_token)) != DUET_OK)
            fprintf(stderr, "duetctl: ignoring %s\n", duet_error_last());
        else if (admin_url == NULL || strcmp(admin_url, file_url) == 0) {
            if (admin_url == NULL && file_url[0] != '\0')
                admin_url = file_url;
            if (c.token == NULL && file_token[0] != '\0')
                c.token = file_token;
        }
    }
    if (c.token != NULL && strpbrk(c.token, "\r\n") != NULL)
        die_usage("the token must not contain a line break");
    char err[512];
    char def_url[64];
    snprintf(def_url, sizeof(def_url), "http://127.0.0.1:%d", DUET_ADMIN_DEFAULT_PORT);
    if (!url_parse(admin_url != NULL ? admin_url : def_url, &c.url, err, sizeof(err)))
        die_usage("--admin: %s", err);

    const char *cmd = rest[0];
    int rc;
    if (strcmp(cmd, "status") == 0) {
        for (int i = 1; i < nrest; i++) {
            if (strcmp(rest[i], "--help") == 0 || strcmp(rest[i], "-h") == 0) {
                fputs(usage_status, stdout);
                free(rest);
                return EXIT_OK;
            }
            die_usage("status: unexpected argument \"%s\"", rest[i]);
        }
        rc = cmd_status(&c);
    } else if (strcmp(cmd, "drain") == 0) {
        rc = cmd_drain(&c, nrest - 1, rest + 1);
    } else if (strcmp(cmd, "undrain") == 0) {
        rc = cmd_undrain(&c, nrest - 1, rest + 1);
    } else if (strcmp(cmd, "admission") == 0) {
        rc = cmd_admission(&c, nrest - 1, rest + 1);
    } else if (strcmp(cmd, "log-level") == 0) {
        rc = cmd_log_level(&c, nrest - 1, rest + 1);
    } else {
        die_usage("unknown command \"%s\"", cmd);
    }
    free(rest);
    return rc;
}
