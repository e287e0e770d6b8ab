/*
 * tune.c: the generic autotuner of tune.h: candidate registry, the profiling split over a
 * group's ranks, the chosen table and its text file.
 *
 * Both the candidates and the chosen table are arrays sorted by key: the sort gives every rank the
 * same canonical pair order whatever order its caller registered shapes in, and lets the per-op
 * lookup be a binary search with no allocation.
 */
#include "kernels/tune.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/kernels.h"

#define DUET__TUNE_VERSION     1
#define DUET__TUNE_MAX_MACHINE 256
/* A tactic id is a small int; candidates of one shape are kept as a bit set. */
#define DUET__TUNE_MAX_TACTICS 64

typedef struct {
    duet_tune_key_t key;
    uint64_t cand; /* candidates: bit i = tactic i */
} duet__tune_cand_t;

typedef struct {
    duet_tune_key_t key;
    int tactic;
} duet__tune_entry_t;

struct duet_tune {
    duet_tune_space_t space;
    char machine[DUET__TUNE_MAX_MACHINE];
    duet__tune_cand_t *cand; /* sorted by key */
    int64_t n_cand, cap_cand;
    duet__tune_entry_t *ent; /* sorted by key */
    int64_t n_ent, cap_ent;
};

static const char *const duet__tune_op_names[DUET_TUNE_OP_COUNT] = {"cpu_matmul", "cuda_gemm"};
static const char *const duet__tune_bucket_names[DUET_TUNE_M_BUCKETS] = {"1",    "2-4",   "5-8",
                                                                         "9-16", "17-64", "65+"};
static const int64_t duet__tune_bucket_max[DUET_TUNE_M_BUCKETS] = {1, 4, 8, 16, 64, INT64_MAX};

int32_t duet_tune_m_bucket(int64_t m)
{
    int32_t b = 0;
    while (b < DUET_TUNE_M_BUCKETS - 1 && m > duet__tune_bucket_max[b])
        b++;
    return b;
}

int64_t duet_tune_m_bucket_max(int32_t b)
{
    return b >= 0 && b < DUET_TUNE_M_BUCKETS ? duet__tune_bucket_max[b] : 0;
}

const char *duet_tune_op_name(int32_t op)
{
    return op >= 0 && op < DUET_TUNE_OP_COUNT ? duet__tune_op_names[op] : NULL;
}

int duet_tune_key_cmp(const duet_tune_key_t *a, const duet_tune_key_t *b)
{
#define DUET__CMP(f)                                                                               \
    if (a->f != b->f)                                                                              \
        return a->f < b->f ? -1 : 1;
    DUET__CMP(op)
    DUET__CMP(dtype)
    DUET__CMP(m)
    DUET__CMP(n)
    DUET__CMP(k)
#undef DUET__CMP
    return 0;
}

static int duet__tune_cand_cmp(const void *a, const void *b)
{
    return duet_tune_key_cmp(&((const duet__tune_cand_t *)a)->key,
                             &((const duet__tune_cand_t *)b)->key);
}

static int duet__tune_ent_cmp(const void *a, const void *b)
{
    return duet_tune_key_cmp(&((const duet__tune_entry_t *)a)->key,
                             &((const duet__tune_entry_t *)b)->key);
}

/* Whether `key` is a shape the space allows; fills why (for errors) when not. */
static int duet__tune_key_ok(const duet_tune_space_t *sp, const duet_tune_key_t *key,
                             const char **why)
{
    if (key->op < 0 || key->op >= DUET_TUNE_OP_COUNT || sp->n_tactics[key->op] <= 0)
        *why = "unknown op";
    else if (key->dtype < DUET_DTYPE_F32 || key->dtype > DUET_DTYPE_F16)
        *why = "unknown dtype";
    else if (key->m < 0 || key->m >= DUET_TUNE_M_BUCKETS)
        *why = "bad M bucket";
    else if (key->n < 1 || key->k < 1)
        *why = "n and k must be >= 1";
    else
        return 1;
    return 0;
}

duet_status_t duet_tune_create(const duet_tune_space_t *space, const char *machine,
                               duet_tune_t **t_p)
{
    if (space == NULL || machine == NULL || machine[0] == '\0' ||
        strlen(machine) >= DUET__TUNE_MAX_MACHINE || strpbrk(machine, "\r\n") != NULL)
        return duet_error_set(DUET_ERR_INVALID, "tune: machine must be one non-empty line of "
                                                "fewer than 256 bytes");
    for (int op = 0; op < DUET_TUNE_OP_COUNT; op++)
        if (space->n_tactics[op] < 0 || space->n_tactics[op] > DUET__TUNE_MAX_TACTICS)
            return duet_error_set(DUET_ERR_INVALID, "tune: op %s has %d tactics (0..%d)",
                                  duet__tune_op_names[op], space->n_tactics[op],
                                  DUET__TUNE_MAX_TACTICS);
    duet_tune_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "tune: out of memory");
    t->space = *space;
    snprintf(t->machine, sizeof(t->machine), "%s", machine);
    *t_p = t;
    return DUET_OK;
}

void duet_tune_destroy(duet_tune_t *t)
{
    if (t == NULL)
        return;
    free(t->cand);
    free(t->ent);
    free(t);
}

const char *duet_tune_machine(const duet_tune_t *t)
{
    return t->machine;
}

/* Grow an array of `size`-byte items to hold `need`. */
static duet_status_t duet__tune_reserve(void **arr, int64_t *cap, int64_t need, size_t size)
{
    if (need <= *cap)
        return DUET_OK;
    int64_t nc = *cap > 0 ? *cap * 2 : 16;
    while (nc < need)
        nc *= 2;
    void *p = realloc(*arr, (size_t)nc * size);
    if (p == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "tune: out of memory");
    *arr = p;
    *cap = nc;
    return DUET_OK;
}

duet_status_t duet_tune_add(duet_tune_t *t, const duet_tune_key_t *key, const int *tactics,
                            int n_tactics)
{
    const char *why = NULL;
    if (!duet__tune_key_ok(&t->space, key, &why))
        return duet_error_set(DUET_ERR_INVALID, "tune: add: %s", why);
    uint64_t set = 0;
    for (int i = 0; i < n_tactics; i++) {
        if (tactics[i] < 0 || tactics[i] >= t->space.n_tactics[key->op])
            return duet_error_set(DUET_ERR_INVALID, "tune: add: tactic %d of op %s (0..%d)",
                                  tactics[i], duet__tune_op_names[key->op],
                                  t->space.n_tactics[key->op] - 1);
        if (set & (UINT64_C(1) << tactics[i]))
            return duet_error_set(DUET_ERR_INVALID, "tune: add: tactic %d given twice", tactics[i]);
        set |= UINT64_C(1) << tactics[i];
    }
    if (set == 0)
        return duet_error_set(DUET_ERR_INVALID, "tune: add: no candidate tactics");
    duet__tune_cand_t probe = {.key = *key};
    /* bsearch and qsort take no NULL array, even with no elements: an empty table has none */
    duet__tune_cand_t *hit = t->n_cand == 0 ? NULL
                                            : bsearch(&probe, t->cand, (size_t)t->n_cand,
                                                      sizeof(*t->cand), duet__tune_cand_cmp);
    if (hit != NULL) {
        hit->cand |= set;
        return DUET_OK;
    }
    duet_status_t st =
        duet__tune_reserve((void **)&t->cand, &t->cap_cand, t->n_cand + 1, sizeof(*t->cand));
    if (st != DUET_OK)
        return st;
    /* insertion keeps the array sorted (registration is a one-time few hundred shapes) */
    int64_t at = t->n_cand;
    while (at > 0 && duet_tune_key_cmp(&t->cand[at - 1].key, key) > 0) {
        t->cand[at] = t->cand[at - 1];
        at--;
    }
    t->cand[at] = (duet__tune_cand_t){.key = *key, .cand = set};
    t->n_cand++;
    return DUET_OK;
}

/* Set (insert or replace) the chosen tactic of `key`. */
static duet_status_t duet__tune_put(duet_tune_t *t, const duet_tune_key_t *key, int tactic)
{
    duet__tune_entry_t probe = {.key = *key};
    duet__tune_entry_t *hit = t->n_ent == 0 ? NULL
                                            : bsearch(&probe, t->ent, (size_t)t->n_ent,
                                                      sizeof(*t->ent), duet__tune_ent_cmp);
    if (hit != NULL) {
        hit->tactic = tactic;
        return DUET_OK;
    }
    duet_status_t st =
        duet__tune_reserve((void **)&t->ent, &t->cap_ent, t->n_ent + 1, sizeof(*t->ent));
    if (st != DUET_OK)
        return st;
    int64_t at = t->n_ent;
    while (at > 0 && duet_tune_key_cmp(&t->ent[at - 1].key, key) > 0) {
        t->ent[at] = t->ent[at - 1];
        at--;
    }
    t->ent[at] = (duet__tune_entry_t){.key = *key, .tactic = tactic};
    t->n_ent++;
    return DUET_OK;
}

static double duet__tune_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* FNV-1a over the canonical pair list: equal on two ranks iff (almost surely) the lists are. */
static uint64_t duet__tune_digest(const duet_tune_t *t)
{
    uint64_t h = UINT64_C(1469598103934665603);
    for (int64_t i = 0; i < t->n_cand; i++) {
        const duet__tune_cand_t *c = &t->cand[i];
        int64_t f[6] = {c->key.op, c->key.dtype, c->key.m, c->key.n, c->key.k, (int64_t)c->cand};
        const unsigned char *p = (const unsigned char *)f;
        for (size_t b = 0; b < sizeof(f); b++)
            h = (h ^ p[b]) * UINT64_C(1099511628211);
    }
    return h;
}

duet_status_t duet_tune_run(duet_tune_t *t, duet_comm_t *comm, duet_tune_profile_fn profile,
                            void *user, duet_tune_stats_t *stats)
{
    const int rank = comm != NULL ? comm->rank : 0, size = comm != NULL ? comm->size : 1;
    const double t0 = duet__tune_now();
    duet_status_t st = DUET_OK;
    double *mine = NULL, *all = NULL;
    uint64_t *digests = NULL;
    duet_tune_stats_t s = {.shapes = t->n_cand};

    /* every shape's tactics in ascending order: pair i of the canonical list */
    for (int64_t c = 0; c < t->n_cand; c++)
        s.pairs += __builtin_popcountll(t->cand[c].cand);

    if (comm != NULL && size > 1) {
        uint64_t d[2] = {duet__tune_digest(t), (uint64_t)s.pairs};
        digests = malloc(sizeof(d) * (size_t)size);
        if (digests == NULL) {
            st = duet_error_set(DUET_ERR_NOMEM, "tune: out of memory");
            goto done;
        }
        if ((st = comm->ops->allgather(comm, d, digests, sizeof(d))) != DUET_OK)
            goto done;
        for (int r = 0; r < size; r++)
            if (digests[2 * r] != d[0] || digests[2 * r + 1] != d[1]) {
                st = duet_error_set(DUET_ERR_INVALID,
                                    "tune: rank %d registered other candidates than rank %d "
                                    "(%" PRIu64 " pairs against %" PRId64 ")",
                                    r, rank, digests[2 * r + 1], s.pairs);
                goto done;
            }
    }

    mine = malloc(sizeof(double) * (size_t)(s.pairs > 0 ? s.pairs : 1));
    all = malloc(sizeof(double) * (size_t)(s.pairs > 0 ? s.pairs : 1) * (size_t)size);
    if (mine == NULL || all == NULL) {
        st = duet_error_set(DUET_ERR_NOMEM, "tune: out of memory");
        goto done;
    }
    int64_t i = 0;
    for (int64_t c = 0; c < t->n_cand; c++) {
        const int single = __builtin_popcountll(t->cand[c].cand) == 1;
        for (int tac = 0; tac < DUET__TUNE_MAX_TACTICS; tac++) {
            if (!(t->cand[c].cand & (UINT64_C(1) << tac)))
                continue;
            mine[i] = NAN;
            if (i % size == rank) {
                if (single) {
                    mine[i] = 0.0; /* nothing to choose between */
                } else {
                    double sec = profile(user, &t->cand[c].key, tac);
                    mine[i] = isfinite(sec) && sec >= 0.0 ? sec : INFINITY;
                    s.profiled++;
                }
            }
            i++;
        }
    }
    if (comm != NULL && size > 1) {
        if ((st = comm->ops->allgather(comm, mine, all, sizeof(double) * (size_t)s.pairs)) !=
            DUET_OK)
            goto done;
    } else {
        memcpy(all, mine, sizeof(double) * (size_t)s.pairs);
    }

    i = 0;
    for (int64_t c = 0; c < t->n_cand; c++) {
        int best = -1;
        double best_s = INFINITY;
        for (int tac = 0; tac < DUET__TUNE_MAX_TACTICS; tac++) {
            if (!(t->cand[c].cand & (UINT64_C(1) << tac)))
                continue;
            /* pair i's one measured value: on the rank that owns it */
            double v = all[(i % size) * s.pairs + i];
            if (isnan(v)) {
                st = duet_error_set(DUET_ERR_INTERNAL, "tune: pair %" PRId64 " has no timing", i);
                goto done;
            }
            if (v < best_s) /* strict: a tie keeps the lower tactic */
                best = tac, best_s = v;
            i++;
        }
        if (best >= 0 && (st = duet__tune_put(t, &t->cand[c].key, best)) != DUET_OK)
            goto done;
    }
    t->n_cand = 0;

done:
    s.seconds = duet__tune_now() - t0;
    if (st == DUET_OK)
        DUET_LOG_INFO("tune: rank %d of %d profiled %" PRId64 " of %" PRId64 " pairs (%" PRId64
                      " shapes) in %.3f s",
                      rank, size, s.profiled, s.pairs, s.shapes, s.seconds);
    if (stats != NULL)
        *stats = s;
    free(mine);
    free(all);
    free(digests);
    return st;
}

int duet_tune_get(const duet_tune_t *t, const duet_tune_key_t *key)
{
    if (t == NULL || t->n_ent == 0)
        return -1;
    int64_t lo = 0, hi = t->n_ent;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int c = duet_tune_key_cmp(&t->ent[mid].key, key);
        if (c == 0)
            return t->ent[mid].tactic;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

int64_t duet_tune_count(const duet_tune_t *t)
{
    return t->n_ent;
}

void duet_tune_entry(const duet_tune_t *t, int64_t i, duet_tune_key_t *key, int *tactic)
{
    *key = t->ent[i].key;
    *tactic = t->ent[i].tactic;
}

/* ---- the text file ----------------------------------------------------------------------------
 */

duet_status_t duet_tune_save(const duet_tune_t *t, const char *path)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof(tmp))
        return duet_error_set(DUET_ERR_IO, "tune: path too long: %s", path);
    FILE *f = fopen(tmp, "w");
    if (f == NULL)
        return duet_error_set(DUET_ERR_IO, "tune: cannot write %s: %s", tmp, strerror(errno));
    fprintf(f, "duet-tune %d %s\n", DUET__TUNE_VERSION, t->machine);
    for (int64_t i = 0; i < t->n_ent; i++) {
        const duet__tune_entry_t *e = &t->ent[i];
        fprintf(f, "%s %s %s %" PRId64 " %" PRId64 " %d\n", duet__tune_op_names[e->key.op],
                duet_dtype_name((duet_dtype_t)e->key.dtype), duet__tune_bucket_names[e->key.m],
                e->key.n, e->key.k, e->tactic);
    }
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) {
        remove(tmp);
        return duet_error_set(DUET_ERR_IO, "tune: cannot write %s", tmp);
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        remove(tmp);
        return duet_error_set(DUET_ERR_IO, "tune: cannot rename %s to %s: %s", tmp, path,
                              strerror(e));
    }
    return DUET_OK;
}

/* A decimal integer in [lo, hi] spelled exactly (no sign, no leading zeros, no spaces). */
static int duet__tune_parse_int(const char *s, int64_t lo, int64_t hi, int64_t *v)
{
    if (s[0] < '0' || s[0] > '9' || (s[0] == '0' && s[1] != '\0'))
        return 0;
    int64_t x = 0;
    for (const char *p = s; *p != '\0'; p++) {
        if (*p < '0' || *p > '9' || x > (INT64_MAX - 9) / 10)
            return 0;
        x = x * 10 + (*p - '0');
    }
    if (x < lo || x > hi)
        return 0;
    *v = x;
    return 1;
}

static int duet__tune_lookup_name(const char *s, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    return -1;
}

/* Split a line (NUL-terminated, no newline) at single spaces into at most max fields; returns
 * the count, or -1 for an empty field (two spaces, a leading or trailing space). */
static int duet__tune_split(char *line, char **f, int max)
{
    int n = 0;
    char *p = line;
    for (;;) {
        char *sp = strchr(p, ' ');
        if (sp != NULL)
            *sp = '\0';
        if (*p == '\0')
            return -1;
        if (n == max)
            return max + 1;
        f[n++] = p;
        if (sp == NULL)
            return n;
        p = sp + 1;
    }
}

duet_status_t duet_tune_load_text(duet_tune_t *t, const char *text, size_t len, const char *name)
{
    static const char *const dtypes[] = {"F32", "BF16", "F16"};
    duet__tune_entry_t *ent = NULL;
    int64_t n_ent = 0, cap_ent = 0;
    char *line = NULL;
    duet_status_t st = DUET_OK;
    size_t pos = 0;
    int64_t lineno = 0;

    if (memchr(text, '\0', len) != NULL)
        return duet_error_set(DUET_ERR_FORMAT, "tune: %s: holds a NUL byte (not a tune file)",
                              name);
    while (pos < len) {
        lineno++;
        const char *nl = memchr(text + pos, '\n', len - pos);
        if (nl == NULL) {
            st = duet_error_set(DUET_ERR_FORMAT,
                                "tune: %s: line %" PRId64 ": truncated (no newline at the end)",
                                name, lineno);
            goto done;
        }
        size_t ll = (size_t)(nl - (text + pos));
        free(line);
        line = malloc(ll + 1);
        if (line == NULL) {
            st = duet_error_set(DUET_ERR_NOMEM, "tune: out of memory");
            goto done;
        }
        memcpy(line, text + pos, ll);
        line[ll] = '\0';
        pos += ll + 1;

        if (lineno == 1) {
            static const char magic[] = "duet-tune ";
            if (strncmp(line, magic, sizeof(magic) - 1) != 0) {
                st = duet_error_set(DUET_ERR_FORMAT,
                                    "tune: %s: line 1: not a tune file (no \"duet-tune\" header)",
                                    name);
                goto done;
            }
            char *ver = line + sizeof(magic) - 1, *sp = strchr(ver, ' ');
            if (sp != NULL)
                *sp = '\0';
            int64_t v;
            if (!duet__tune_parse_int(ver, 0, INT32_MAX, &v) || v != DUET__TUNE_VERSION) {
                st = duet_error_set(DUET_ERR_FORMAT,
                                    "tune: %s: line 1: format version \"%s\", this build reads %d",
                                    name, ver, DUET__TUNE_VERSION);
                goto done;
            }
            if (sp == NULL || strcmp(sp + 1, t->machine) != 0) {
                st = duet_error_set(DUET_ERR_FORMAT,
                                    "tune: %s: line 1: made on \"%s\", this is \"%s\"", name,
                                    sp != NULL ? sp + 1 : "", t->machine);
                goto done;
            }
            continue;
        }

        char *f[6];
        int nf = duet__tune_split(line, f, 6);
        if (nf != 6) {
            st = duet_error_set(DUET_ERR_FORMAT,
                                "tune: %s: line %" PRId64 ": want 6 fields separated by single "
                                "spaces (op dtype m n k tactic)",
                                name, lineno);
            goto done;
        }
        duet_tune_key_t key;
        int64_t n, k, tac;
        key.op = duet__tune_lookup_name(f[0], duet__tune_op_names, DUET_TUNE_OP_COUNT);
        key.dtype = duet__tune_lookup_name(f[1], dtypes, 3);
        key.m = duet__tune_lookup_name(f[2], duet__tune_bucket_names, DUET_TUNE_M_BUCKETS);
        const char *bad = NULL;
        if (key.op < 0 || t->space.n_tactics[key.op] <= 0)
            bad = "unknown op";
        else if (key.dtype < 0)
            bad = "unknown dtype";
        else if (key.m < 0)
            bad = "unknown M bucket";
        else if (!duet__tune_parse_int(f[3], 1, INT32_MAX, &n))
            bad = "bad n";
        else if (!duet__tune_parse_int(f[4], 1, INT32_MAX, &k))
            bad = "bad k";
        else if (!duet__tune_parse_int(f[5], 0, t->space.n_tactics[key.op] - 1, &tac))
            bad = "tactic out of range for the op";
        if (bad != NULL) {
            st = duet_error_set(DUET_ERR_FORMAT, "tune: %s: line %" PRId64 ": %s", name, lineno,
                                bad);
            goto done;
        }
        key.n = n;
        key.k = k;
        for (int64_t i = 0; i < n_ent; i++)
            if (duet_tune_key_cmp(&ent[i].key, &key) == 0) {
                st = duet_error_set(DUET_ERR_FORMAT,
                                    "tune: %s: line %" PRId64 ": the same shape as an earlier line",
                                    name, lineno);
                goto done;
            }
        if ((st = duet__tune_reserve((void **)&ent, &cap_ent, n_ent + 1, sizeof(*ent))) != DUET_OK)
            goto done;
        ent[n_ent++] = (duet__tune_entry_t){.key = key, .tactic = (int)tac};
    }
    if (lineno == 0) {
        st = duet_error_set(DUET_ERR_FORMAT, "tune: %s: empty (no header line)", name);
        goto done;
    }
    if (n_ent > 0) /* a file of its header alone leaves ent NULL */
        qsort(ent, (size_t)n_ent, sizeof(*ent), duet__tune_ent_cmp);
    free(t->ent);
    t->ent = ent;
    t->n_ent = n_ent;
    t->cap_ent = cap_ent;
    ent = NULL;

done:
    free(line);
    free(ent);
    return st;
}

duet_status_t duet_tune_load(duet_tune_t *t, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return duet_error_set(errno == ENOENT ? DUET_ERR_NOT_FOUND : DUET_ERR_IO,
                              "tune: cannot open %s: %s", path, strerror(errno));
    char *buf = NULL;
    size_t len = 0, cap = 0;
    duet_status_t st = DUET_OK;
    for (;;) {
        if (len == cap) {
            size_t nc = cap > 0 ? cap * 2 : 4096;
            if (nc > ((size_t)64 << 20)) {
                st = duet_error_set(DUET_ERR_FORMAT, "tune: %s: larger than 64 MiB", path);
                goto done;
            }
            char *p = realloc(buf, nc);
            if (p == NULL) {
                st = duet_error_set(DUET_ERR_NOMEM, "tune: out of memory");
                goto done;
            }
            buf = p;
            cap = nc;
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) {
            if (ferror(f))
                st = duet_error_set(DUET_ERR_IO, "tune: cannot read %s", path);
            break;
        }
    }
    if (st == DUET_OK)
        st = duet_tune_load_text(t, buf, len, path);
done:
    fclose(f);
    free(buf);
    return st;
}

/* FNV-1a over the chosen table (the load_group check that ranks hold the same one). */
static uint64_t duet__tune_table_digest(const duet_tune_t *t)
{
    uint64_t h = UINT64_C(1469598103934665603);
    for (int64_t i = 0; i < t->n_ent; i++) {
        const duet__tune_entry_t *e = &t->ent[i];
        int64_t f[6] = {e->key.op, e->key.dtype, e->key.m, e->key.n, e->key.k, e->tactic};
        const unsigned char *p = (const unsigned char *)f;
        for (size_t b = 0; b < sizeof(f); b++)
            h = (h ^ p[b]) * UINT64_C(1099511628211);
    }
    return h;
}

duet_status_t duet_tune_load_group(duet_tune_t *t, const char *path, duet_comm_t *comm)
{
    duet_status_t st = duet_tune_load(t, path);
    if (comm == NULL || comm->size <= 1) {
        if (st == DUET_ERR_NOT_FOUND)
            t->n_ent = 0;
        return st;
    }
    /* 0 loaded, 1 no file, 2 another error; then the table's digest */
    uint64_t mine[2] = {st == DUET_OK              ? 0u
                        : st == DUET_ERR_NOT_FOUND ? 1u
                                                   : 2u,
                        duet__tune_table_digest(t)};
    uint64_t *all = malloc(sizeof(mine) * (size_t)comm->size);
    if (all == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "tune: out of memory");
    duet_status_t cst = comm->ops->allgather(comm, mine, all, sizeof(mine));
    if (cst != DUET_OK) {
        free(all);
        return cst;
    }
    int failed = -1, missing = -1, differs = -1;
    for (int r = 0; r < comm->size; r++) {
        if (all[2 * r] == 2 && failed < 0)
            failed = r;
        if (all[2 * r] == 1 && missing < 0)
            missing = r;
        if (all[2 * r] == 0 && mine[0] == 0 && all[2 * r + 1] != mine[1] && differs < 0)
            differs = r;
    }
    free(all);
    if (mine[0] == 2)
        return st; /* this rank's own error, already set */
    if (failed >= 0)
        return duet_error_set(DUET_ERR_INVALID, "tune: rank %d could not load %s", failed, path);
    if (missing >= 0) {
        t->n_ent = 0;
        return duet_error_set(DUET_ERR_NOT_FOUND, "tune: rank %d has no %s: the group profiles",
                              missing, path);
    }
    if (differs >= 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "tune: rank %d loaded another table from %s than rank %d", differs,
                              path, comm->rank);
    return DUET_OK;
}
