/*
 * duet-test-worker: a TEST TOOL, not a worker. It speaks the router's worker protocol
 * (proto/duet.proto over proto/frame.h) with fake compute, so the registry, placement, heartbeat
 * loss, drain and the router's request path can be tested with real processes and no model.
 *
 * Deterministic output: the tokens of a request are its prompt ids reversed (cycling when
 * max_tokens is longer), one Tokens message per token; with --script-ids, a scripted answer
 * (a tool call, say) instead. A ctx test worker answers Prefill with
 * the first of them; a gen test worker answers Reserve with a fake reservation
 * ("test-reservation:<request id>"; with --group-ranks N, N - 1 more, "test-reservation:<request
 * id>:<rank>", as a Helix group's rank 0 sends them), then PrefillDone with the rest, or Generate
 * with all of them. A ctx test worker's event for a Prefill lists every reservation it came with.
 * A seeded request's Reserve / Generate also logs "seed <id> <seed>". Fault flags stop heartbeats,
 * exit abruptly after N tokens, stall (silent but connected) after N tokens, or refuse every
 * reservation or the first N (with a retry hint, or for good). --prefix-ids makes its heartbeats
 * carry a prefix cache's summary (the hash of every whole 16-token block prefix of those ids,
 * common/prefix_hash.h), as if it had cached them, for the router's placement by cached prefix.
 * --events FILE appends one line per message received
 * ("reserve 7", "cancel 7 client disconnected", "drain", ...) for tests to inspect.
 *
 * Blocking sockets and poll(): a tool, so plain and obvious beats an event library.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "proto/envelope.h"
#include "proto/frame.h"
#include "common/prefix_hash.h"
#include "common/version.h"

#define TW_MAX_REQ        512
#define TW_PAGE_TOKENS    16   /* the page size it registers */
#define TW_MAX_PREFIX_IDS 4096 /* --prefix-ids */

typedef struct {
    uint64_t rid;     /* 0 = free slot */
    uint32_t *tokens; /* (n_tokens) the prompt, owned */
    size_t n_tokens;
    uint32_t max_tokens;
    uint32_t produced; /* tokens of this request emitted so far (by anyone) */
    uint32_t limit;    /* emit until produced == limit */
    int active;        /* emitting */
    int scripted;      /* answers with --script-ids */
    uint64_t next_us;  /* when the next token is due (CLOCK_MONOTONIC, µs) */
} tw_req_t;

static struct {
    const char *router;
    int role; /* 1 ctx, 2 gen */
    const char *name;
    const char *fingerprint;
    uint32_t version;
    int heartbeat_ms;
    int delay_ms;
    long die_after;   /* -1 = never */
    long stall_after; /* -1 = never */
    int refuse;
    long refuse_first;        /* refuse this many Reserves, then take them (-1: --refuse's) */
    uint32_t refuse_retry_ms; /* the refusals' retry hint (0: refused for good) */
    uint32_t group_ranks; /* reservations per Reserved (a fake Helix group): 1 + the extra ones */
    uint32_t kv_pages;
    const char *events;
    int quiet;
    uint32_t script[256]; /* --script-ids */
    size_t n_script;
    long script_unless;                        /* -1 = none */
    uint64_t prefix[DUET_PROTO_PREFIX_HASHES]; /* --prefix-ids: the summary heartbeats carry */
    size_t n_prefix;
} opt = {.script_unless = -1,
         .refuse_first = -1,
         .refuse_retry_ms = 2000,
         .role = 0,
         .name = "test-worker",
         .version = DUET_PROTO_VERSION,
         .heartbeat_ms = 200,
         .die_after = -1,
         .stall_after = -1,
         .group_ranks = 1,
         .kv_pages = 1000};

static tw_req_t tw_reqs[TW_MAX_REQ];
static long tw_emitted; /* tokens emitted, all requests */
static int tw_stalled, tw_draining;

/* Token pacing runs on microseconds: with whole milliseconds (truncated) a token could go out
 * up to 1 ms before its --delay-ms had passed. */
static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

static uint64_t now_ms(void)
{
    return now_us() / 1000;
}

/* When a request's next token is due: --delay-ms from now; at once with --delay-ms 0 (a due
 * time of "now" would be later than emit_due's clock reading, and cost a poll round of 1 ms). */
static uint64_t token_due(void)
{
    return opt.delay_ms == 0 ? 0 : now_us() + 1000 * (uint64_t)opt.delay_ms;
}

static void event(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void event(const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (!opt.quiet)
        fprintf(stderr, "duet-test-worker %s: %s\n", opt.name, line);
    if (opt.events != NULL) {
        FILE *f = fopen(opt.events, "a");
        if (f != NULL) {
            fprintf(f, "%s\n", line);
            fclose(f);
        }
    }
}

/* "seed <request id> <seed>" for a seeded request's Reserve / Generate (the router gives choice i
 * of a request seed + i). */
static void event_seed(uint64_t rid, const Duet__Sampling *s)
{
    if (s != NULL && s->has_seed)
        event("seed %llu %llu", (unsigned long long)rid, (unsigned long long)s->seed);
}

static void send_env(int fd, Duet__Envelope *env)
{
    env->version = opt.version; /* --proto-version: the router must refuse another version */
    size_t n = duet_frame_size(env);
    uint8_t *buf = malloc(n);
    size_t len = 0;
    if (buf == NULL || duet_frame_encode(env, buf, n, &len) < 0) {
        fprintf(stderr, "duet-test-worker: cannot encode a frame\n");
        exit(2);
    }
    for (size_t off = 0; off < len;) {
        ssize_t w = write(fd, buf + off, len - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            event("write failed: %s", strerror(errno));
            exit(3);
        }
        off += (size_t)w;
    }
    free(buf);
}

static tw_req_t *req_find(uint64_t rid)
{
    for (int i = 0; i < TW_MAX_REQ; i++)
        if (tw_reqs[i].rid == rid)
            return &tw_reqs[i];
    return NULL;
}

static void req_free(tw_req_t *r)
{
    free(r->tokens);
    memset(r, 0, sizeof(*r));
}

static tw_req_t *req_new(uint64_t rid, const uint32_t *t, size_t n, uint32_t max_tokens)
{
    tw_req_t *r = req_find(rid);
    if (r != NULL)
        req_free(r);
    r = req_find(0);
    if (r == NULL)
        return NULL;
    r->rid = rid;
    r->tokens = malloc((n > 0 ? n : 1) * sizeof(uint32_t));
    r->n_tokens = n;
    r->max_tokens = max_tokens;
    if (n > 0)
        memcpy(r->tokens, t, n * sizeof(uint32_t));
    /* --script-ids answers a prompt that does not hold --script-unless's id */
    r->scripted = opt.n_script > 0;
    for (size_t i = 0; i < n && r->scripted && opt.script_unless >= 0; i++)
        r->scripted = t[i] != (uint32_t)opt.script_unless;
    return r;
}

static void send_tokens(int fd, uint64_t rid, const uint32_t *ids, size_t n, int finish,
                        const char *error)
{
    Duet__Tokens t = DUET__TOKENS__INIT;
    t.request_id = rid;
    t.ids = (uint32_t *)ids;
    t.n_ids = n;
    t.finish_reason = finish;
    t.error = (char *)(error != NULL ? error : "");
    Duet__Envelope env = duet_envelope_tokens(&t);
    send_env(fd, &env);
}

static void on_message(int fd, Duet__Envelope *env)
{
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_REGISTER_ACK:
        if (!env->register_ack->accepted) {
            event("refused: %s", env->register_ack->reason);
            exit(4);
        }
        event("registered as worker %llu", (unsigned long long)env->register_ack->worker_id);
        return;
    case DUET__ENVELOPE__BODY_RESERVE: {
        Duet__Reserve *m = env->reserve;
        event("reserve %llu", (unsigned long long)m->request_id);
        event_seed(m->request_id, m->sampling);
        const int first = opt.refuse_first > 0;
        if (opt.refuse || first || tw_draining) {
            Duet__Refused rf = DUET__REFUSED__INIT;
            rf.request_id = m->request_id;
            rf.reason = tw_draining ? "draining"
                        : first     ? "test worker has no room yet (--refuse-first)"
                                    : "test worker refuses every reservation";
            rf.retry_after_ms = tw_draining ? 2000 : opt.refuse_retry_ms;
            if (first && !tw_draining)
                opt.refuse_first--;
            Duet__Envelope e = duet_envelope_refused(&rf);
            send_env(fd, &e);
            return;
        }
        tw_req_t *r = req_new(m->request_id, m->tokens, m->n_tokens, m->max_tokens);
        char res[64];
        snprintf(res, sizeof(res), "test-reservation:%llu", (unsigned long long)m->request_id);
        Duet__Reserved rs = DUET__RESERVED__INIT;
        rs.request_id = m->request_id;
        rs.reservation.data = (uint8_t *)res;
        rs.reservation.len = strlen(res);
        size_t n_more = opt.group_ranks - 1;
        ProtobufCBinaryData *more = calloc(n_more + 1, sizeof(*more));
        char(*more_text)[64] = calloc(n_more + 1, sizeof(*more_text));
        if (more == NULL || more_text == NULL) {
            fprintf(stderr, "duet-test-worker: out of memory\n");
            exit(6);
        }
        for (size_t k = 0; k < n_more; k++) {
            snprintf(more_text[k], sizeof(more_text[k]), "test-reservation:%llu:%zu",
                     (unsigned long long)m->request_id, k + 1);
            more[k] =
                (ProtobufCBinaryData){.len = strlen(more_text[k]), .data = (uint8_t *)more_text[k]};
        }
        rs.n_more_reservations = n_more;
        rs.more_reservations = more;
        Duet__Envelope e = duet_envelope_reserved(&rs);
        (void)r;
        send_env(fd, &e);
        free(more);
        free(more_text);
        return;
    }
    case DUET__ENVELOPE__BODY_PREFILL_DONE: {
        Duet__PrefillDone *m = env->prefill_done;
        event("prefill_done %llu %u", (unsigned long long)m->request_id, m->first_token);
        tw_req_t *r = req_find(m->request_id);
        if (r == NULL) {
            send_tokens(fd, m->request_id, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                        "test worker: PrefillDone for a request without a reservation");
            return;
        }
        r->produced = 1;
        r->limit = r->max_tokens;
        r->active = 1;
        r->next_us = token_due();
        return;
    }
    case DUET__ENVELOPE__BODY_PREFILL:
    case DUET__ENVELOPE__BODY_GENERATE: {
        int prefill = env->body_case == DUET__ENVELOPE__BODY_PREFILL;
        uint64_t rid = prefill ? env->prefill->request_id : env->generate->request_id;
        uint32_t *t = prefill ? env->prefill->tokens : env->generate->tokens;
        size_t n = prefill ? env->prefill->n_tokens : env->generate->n_tokens;
        uint32_t maxt = prefill ? env->prefill->max_tokens : env->generate->max_tokens;
        event("%s %llu %zu", prefill ? "prefill" : "generate", (unsigned long long)rid, n);
        if (!prefill)
            event_seed(rid, env->generate->sampling);
        if (prefill) { /* the reservations as they came, rank 0's first */
            const Duet__Prefill *p = env->prefill;
            char line[4096];
            int at = snprintf(line, sizeof(line), "reservations %llu %.*s", (unsigned long long)rid,
                              (int)p->reservation.len, (const char *)p->reservation.data);
            for (size_t k = 0; k < p->n_more_reservations && at > 0 && (size_t)at < sizeof(line);
                 k++)
                at += snprintf(line + at, sizeof(line) - (size_t)at, " %.*s",
                               (int)p->more_reservations[k].len,
                               (const char *)p->more_reservations[k].data);
            event("%s", line);
        }
        if (opt.die_after == 0) {
            event("dying as told (--die-after 0)");
            exit(5);
        }
        if (prefill && env->prefill->reservation.len == 0) {
            send_tokens(fd, rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                        "test worker: Prefill without a reservation");
            return;
        }
        tw_req_t *r = req_new(rid, t, n, maxt);
        if (r == NULL) {
            send_tokens(fd, rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR, "test worker full");
            return;
        }
        r->limit = prefill ? 1 : maxt;
        r->active = 1;
        r->next_us = token_due();
        return;
    }
    case DUET__ENVELOPE__BODY_CANCEL: {
        Duet__Cancel *m = env->cancel;
        event("cancel %llu %s", (unsigned long long)m->request_id, m->reason);
        tw_req_t *r = req_find(m->request_id);
        if (r != NULL) {
            send_tokens(fd, m->request_id, NULL, 0, DUET__TOKENS__FINISH_REASON__CANCELLED, NULL);
            req_free(r);
        }
        return;
    }
    case DUET__ENVELOPE__BODY_DRAIN:
        event("drain");
        tw_draining = 1;
        return;
    case DUET__ENVELOPE__BODY_UNDRAIN:
        event("undrain");
        tw_draining = 0;
        return;
    default:
        event("unexpected body %d", (int)env->body_case);
        return;
    }
}

/* Emit every token that is due. Returns the ms until the next one (-1 = none pending). */
static int emit_due(int fd)
{
    uint64_t now = now_us();
    int wait = -1;
    for (int i = 0; i < TW_MAX_REQ; i++) {
        tw_req_t *r = &tw_reqs[i];
        while (r->rid != 0 && r->active && !tw_stalled && r->next_us <= now) {
            if (opt.die_after >= 0 && tw_emitted >= opt.die_after) {
                event("dying as told (--die-after %ld)", opt.die_after);
                exit(5);
            }
            if (opt.stall_after >= 0 && tw_emitted >= opt.stall_after) {
                event("stalling as told (--stall-after %ld)", opt.stall_after);
                tw_stalled = 1;
                break;
            }
            uint32_t id = r->scripted       ? opt.script[r->produced % opt.n_script]
                          : r->n_tokens > 0 ? r->tokens[r->n_tokens - 1 - r->produced % r->n_tokens]
                                            : 0;
            r->produced++;
            tw_emitted++;
            int last = r->produced >= r->limit;
            int finish = r->produced >= r->max_tokens ? DUET__TOKENS__FINISH_REASON__LENGTH
                                                      : DUET__TOKENS__FINISH_REASON__NONE;
            if (r->scripted && r->produced >= opt.n_script && r->produced < r->max_tokens) {
                finish = DUET__TOKENS__FINISH_REASON__STOP; /* the script's end: as an EOS */
                last = 1;
            }
            send_tokens(fd, r->rid, &id, 1, finish, NULL);
            if (last) {
                req_free(r);
                break;
            }
            /* from this token's send, so that no gap is shorter than the delay */
            r->next_us = token_due();
        }
        if (r->rid != 0 && r->active && !tw_stalled) {
            /* poll's timeout in whole ms, rounded up: never wakes before the token is due */
            int w = r->next_us > now ? (int)((r->next_us - now + 999) / 1000) : 0;
            if (wait < 0 || w < wait)
                wait = w;
        }
    }
    return wait;
}

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: duet-test-worker --router HOST:PORT --role ctx|gen [options]\n"
        "\n"
        "A TEST TOOL: a fake context or generation worker that speaks duet's worker protocol\n"
        "with deterministic tokens (the prompt ids reversed), for router tests. Not a worker.\n"
        "\n"
        "  --router HOST:PORT     the router's worker port (required)\n"
        "  --role ctx|gen         which kind of worker to pretend to be (required)\n"
        "  --name NAME            worker_name in Register (default test-worker)\n"
        "  --fingerprint FP       model_fingerprint in Register (default \"test\")\n"
        "  --proto-version N      protocol version to claim (default %u)\n"
        "  --kv-pages N           capacity and free pages to report (default 1000)\n"
        "  --heartbeat-ms N       heartbeat period; 0 = never heartbeat (default 200)\n"
        "  --delay-ms N           delay before each token (default 0)\n"
        "  --die-after N          exit abruptly once N tokens were emitted (0: on the first\n"
        "                         Prefill/Generate)\n"
        "  --stall-after N        after N tokens stop heartbeats and tokens, stay connected\n"
        "  --refuse               answer every Reserve with Refused\n"
        "  --refuse-first N       answer the first N Reserves with Refused, then take them\n"
        "  --refuse-retry-ms N    those refusals' retry hint: 0 says refused for good (default\n"
        "                         2000)\n"
        "  --group-ranks N        answer Reserve with N reservations, as a Helix group of N\n"
        "                         ranks (default 1)\n"
        "  --events FILE          append one line per message received\n"
        "  --quiet                no log lines on stderr\n"
        "  --model DIR            accepted and ignored (so `duet up` can start it as a worker)\n"
        "  --script-ids I,J,...   answer with these ids (at most 256), then stop (as an EOS)\n"
        "  --script-unless ID     but give the default answer to a prompt that holds ID (a\n"
        "                         conversation that had the scripted answer already)\n"
        "  --prefix-ids I,J,...   heartbeats carry a prefix cache summary holding these ids'\n"
        "                         whole 16-token blocks (at most 4096 ids; no cache is kept)\n"
        "  -h, --help             this text\n"
        "  --version              the version, git commit and CUDA build\n",
        DUET_PROTO_VERSION);
}

int main(int argc, char **argv)
{
    static const struct option lo[] = {
        {"router", 1, 0, 'r'},
        {"role", 1, 0, 'o'},
        {"name", 1, 0, 'n'},
        {"fingerprint", 1, 0, 'f'},
        {"proto-version", 1, 0, 'v'},
        {"kv-pages", 1, 0, 'k'},
        {"heartbeat-ms", 1, 0, 'b'},
        {"delay-ms", 1, 0, 'd'},
        {"die-after", 1, 0, 'x'},
        {"stall-after", 1, 0, 's'},
        {"refuse", 0, 0, 'R'},
        {"group-ranks", 1, 0, 'G'},
        {"events", 1, 0, 'e'},
        {"quiet", 0, 0, 'q'},
        {"help", 0, 0, 'h'},
        {"model", 1, 0, 'm'},
        {"version", 0, 0, 'V'},
        {"script-ids", 1, 0, 'S'},
        {"script-unless", 1, 0, 'U'},
        {"prefix-ids", 1, 0, 'P'},
        {"refuse-first", 1, 0, 'F'},
        {"refuse-retry-ms", 1, 0, 'T'},
        {0, 0, 0, 0},
    };
    opt.fingerprint = "test";
    int c;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (c) {
        case 'r':
            opt.router = optarg;
            break;
        case 'o':
            opt.role = strcmp(optarg, "ctx") == 0 ? 1 : strcmp(optarg, "gen") == 0 ? 2 : -1;
            break;
        case 'n':
            opt.name = optarg;
            break;
        case 'f':
            opt.fingerprint = optarg;
            break;
        case 'v':
            opt.version = (uint32_t)strtoul(optarg, NULL, 10);
            break;
        case 'k':
            opt.kv_pages = (uint32_t)strtoul(optarg, NULL, 10);
            break;
        case 'b':
            opt.heartbeat_ms = atoi(optarg);
            break;
        case 'd':
            opt.delay_ms = atoi(optarg);
            break;
        case 'x':
            opt.die_after = atol(optarg);
            break;
        case 's':
            opt.stall_after = atol(optarg);
            break;
        case 'R':
            opt.refuse = 1;
            break;
        case 'F':
            opt.refuse_first = atol(optarg);
            break;
        case 'T':
            opt.refuse_retry_ms = (uint32_t)strtoul(optarg, NULL, 10);
            break;
        case 'G':
            opt.group_ranks = (uint32_t)strtoul(optarg, NULL, 10);
            if (opt.group_ranks < 1 || opt.group_ranks > 1000) {
                fprintf(stderr, "duet-test-worker: --group-ranks must be 1..1000\n");
                return 1;
            }
            break;
        case 'e':
            opt.events = optarg;
            break;
        case 'q':
            opt.quiet = 1;
            break;
        case 'V':
            duet_version_print("duet-test-worker");
            return 0;
        case 'm':
            break; /* workers take the model folder; the fake one has no use for it */
        case 'U':
            opt.script_unless = atol(optarg);
            break;
        case 'S': {
            char *p = optarg;
            opt.n_script = 0;
            while (*p != '\0' && opt.n_script < sizeof(opt.script) / sizeof(opt.script[0])) {
                char *e;
                unsigned long v = strtoul(p, &e, 10);
                if (e == p || (*e != ',' && *e != '\0')) {
                    fprintf(stderr, "duet-test-worker: --script-ids takes ids like 1,2,3\n");
                    return 1;
                }
                opt.script[opt.n_script++] = (uint32_t)v;
                p = *e == ',' ? e + 1 : e;
            }
            break;
        }
        case 'P': {
            static int32_t ids[TW_MAX_PREFIX_IDS];
            size_t n = 0;
            char *p = optarg;
            while (*p != '\0') {
                char *e;
                long v = strtol(p, &e, 10);
                if (e == p || (*e != ',' && *e != '\0') || n == TW_MAX_PREFIX_IDS) {
                    fprintf(stderr,
                            "duet-test-worker: --prefix-ids takes up to %d ids like 1,2,3\n",
                            TW_MAX_PREFIX_IDS);
                    return 1;
                }
                ids[n++] = (int32_t)v;
                p = *e == ',' ? e + 1 : e;
            }
            opt.n_prefix = duet_prefix_hash_chain(ids, (int64_t)n, TW_PAGE_TOKENS, opt.prefix,
                                                  DUET_PROTO_PREFIX_HASHES);
            break;
        }
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 1;
        }
    }
    if (opt.router == NULL || opt.role <= 0) {
        usage(stderr);
        return 1;
    }
    /* a line before registering (not an event): whoever waits for the registration has seen
     * this worker speak, however fast the rest goes */
    if (!opt.quiet)
        fprintf(stderr, "duet-test-worker %s: connecting to %s\n", opt.name, opt.router);
    char host[256];
    snprintf(host, sizeof(host), "%s", opt.router);
    char *colon = strrchr(host, ':');
    if (colon == NULL) {
        fprintf(stderr, "duet-test-worker: --router must be HOST:PORT\n");
        return 1;
    }
    *colon = '\0';
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    if (getaddrinfo(host, colon + 1, &hints, &ai) != 0) {
        fprintf(stderr, "duet-test-worker: cannot resolve %s\n", opt.router);
        return 1;
    }
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        fprintf(stderr, "duet-test-worker: cannot connect to %s: %s\n", opt.router,
                strerror(errno));
        return 1;
    }
    freeaddrinfo(ai);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));

    Duet__Capacity cap = DUET__CAPACITY__INIT;
    cap.kv_pages = opt.kv_pages;
    cap.page_tokens = TW_PAGE_TOKENS;
    cap.max_seqs = 64;
    cap.max_batch_tokens = 2048;
    Duet__Register reg = DUET__REGISTER__INIT;
    reg.role = opt.role;
    reg.worker_name = (char *)opt.name;
    reg.version = opt.version;
    reg.model_fingerprint = (char *)opt.fingerprint;
    reg.capacity = &cap;
    Duet__Envelope env = duet_envelope_register_(&reg);
    send_env(fd, &env);

    duet_frame_decoder_t dec;
    duet_frame_decoder_init(&dec, 0);
    uint64_t next_hb = now_ms() + (uint64_t)opt.heartbeat_ms;
    for (;;) {
        int wait = emit_due(fd);
        if (opt.heartbeat_ms > 0 && !tw_stalled) {
            uint64_t now = now_ms();
            if (now >= next_hb) {
                Duet__Heartbeat hb = DUET__HEARTBEAT__INIT;
                hb.free_pages = opt.kv_pages;
                hb.draining = tw_draining;
                for (int i = 0; i < TW_MAX_REQ; i++)
                    hb.running += tw_reqs[i].rid != 0;
                hb.prefix_hashes = opt.prefix;
                hb.n_prefix_hashes = opt.n_prefix;
                hb.prefix_page_tokens = opt.n_prefix > 0 ? TW_PAGE_TOKENS : 0;
                Duet__Envelope he = duet_envelope_heartbeat(&hb);
                send_env(fd, &he);
                next_hb = now + (uint64_t)opt.heartbeat_ms;
            }
            int hw = (int)(next_hb - now_ms());
            if (hw < 0)
                hw = 0;
            if (wait < 0 || hw < wait)
                wait = hw;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, wait);
        if (r < 0 && errno != EINTR)
            return 6;
        if (r <= 0)
            continue;
        uint8_t buf[65536];
        ssize_t n = read(fd, buf, sizeof(buf));
        if (n <= 0) {
            event("router closed the connection");
            return 0;
        }
        const uint8_t *q = buf;
        size_t m = (size_t)n;
        while (m > 0) {
            size_t used = 0;
            Duet__Envelope *in = NULL;
            if (duet_frame_decoder_feed(&dec, q, m, &used, &in) < 0) {
                event("malformed frame from the router");
                return 7;
            }
            q += used;
            m -= used;
            if (in != NULL) {
                on_message(fd, in);
                duet_envelope_free(in);
            }
        }
    }
}
