/*
 * test_tune.c: the autotuner (kernels/tune.h, issue 39).
 *
 *  - The profiling split: a fake in-process communicator (N threads, each with its own
 *    duet_comm_t whose allgather meets the others at a barrier; a test-only transport) and an
 *    injected deterministic cost model that records which rank profiled which pair. Checked for
 *    N = 1..4: each pair profiled exactly once overall, each rank about 1/N of them, every rank's
 *    table the same and equal to an argmin computed here from the cost model (ties: lowest
 *    tactic), and to the N = 1 run; ranks that registered other candidates all fail.
 *  - The file: save -> load round trip, and malformed files refused with DUET_ERR_FORMAT naming the
 *    line; the ops' names, and a table of both ops (cuda_gemm's lines, its 4 tactics' range); in a
 * group, every rank loads or every rank profiles (duet_tune_load_group).
 *  - The CPU matmul's tactics: every tactic gives the bits of the default split, on odd shapes,
 *    every weight dtype, each ISA path this CPU has.
 *  - The engine option: a model loaded with tune on (profiling, then from the saved file, then
 *    from a file of pooled tactics only) gives the bits of one loaded without, over a batched
 *    prefill and decode on a fixture.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "engine/model.h"
#include "kernels/cpu/cpu_impl.h"
#include "kernels/kernels.h"
#include "kernels/tune.h"
#include "test_rng.h"

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            cr_assert(0, "check failed: " #cond " " __VA_ARGS__);                                  \
    } while (0)

/* ---- the fake communicator ------------------------------------------------------------------ */

#define FAKE_MAX_RANKS 8

typedef struct {
    int size;
    pthread_barrier_t bar;
    void *slots[FAKE_MAX_RANKS]; /* each rank's send buffer during an allgather */
    size_t bytes[FAKE_MAX_RANKS];
} fake_group_t;

typedef struct {
    duet_comm_t base;
    fake_group_t *g;
} fake_comm_t;

static duet_status_t fake_allgather(duet_comm_t *c, const void *send, void *recv, size_t bytes)
{
    fake_comm_t *f = (fake_comm_t *)c;
    fake_group_t *g = f->g;
    g->slots[c->rank] = (void *)send;
    g->bytes[c->rank] = bytes;
    pthread_barrier_wait(&g->bar);
    for (int r = 0; r < g->size; r++)
        if (g->bytes[r] != bytes) {
            pthread_barrier_wait(&g->bar);
            return duet_error_set(DUET_ERR_INVALID,
                                  "fake allgather: rank %d sends %zu bytes, "
                                  "rank %d %zu",
                                  r, g->bytes[r], c->rank, bytes);
        }
    for (int r = 0; r < g->size; r++)
        memcpy((char *)recv + (size_t)r * bytes, g->slots[r], bytes);
    pthread_barrier_wait(&g->bar); /* nobody reuses its send buffer before all have read it */
    return DUET_OK;
}

static duet_status_t fake_barrier(duet_comm_t *c)
{
    pthread_barrier_wait(&((fake_comm_t *)c)->g->bar);
    return DUET_OK;
}

static void fake_destroy(duet_comm_t *c)
{
    free(c);
}

/* Only what the tuner uses; the other ops are absent, so a call to one would crash the test. */
static const duet_comm_ops_t fake_ops = {
    .name = "fake",
    .allgather = fake_allgather,
    .barrier = fake_barrier,
    .destroy = fake_destroy,
};

/* ---- the split ------------------------------------------------------------------------------ */

#define N_SHAPES 9
#define N_TAC    11

typedef struct {
    duet_tune_key_t key;
    int tactics[N_TAC];
    int n;
} shape_t;

/* Shapes of every op field kind; a few with one candidate, one with every tactic. */
static void make_shapes(shape_t *s)
{
    for (int i = 0; i < N_SHAPES; i++) {
        s[i].key = (duet_tune_key_t){.op = DUET_TUNE_OP_CPU_MATMUL,
                                     .dtype = i % 3,
                                     .m = i % DUET_TUNE_M_BUCKETS,
                                     .n = 16 + 7 * i,
                                     .k = 1000 - 13 * i};
        s[i].n = 0;
        int n_want = i == 4 ? N_TAC : (i % 4 == 1 ? 1 : 2 + i % 5);
        for (int t = 0; t < N_TAC && s[i].n < n_want; t++)
            if ((t * 7 + i) % 3 != 0 || n_want == N_TAC || n_want > 6)
                s[i].tactics[s[i].n++] = t;
        if (s[i].n == 0)
            s[i].tactics[s[i].n++] = i % N_TAC;
    }
}

/* The injected cost: few distinct values so that ties are common. */
static double cost(const duet_tune_key_t *k, int tactic)
{
    uint64_t h = (uint64_t)k->op * 0x9e3779b97f4a7c15u ^ (uint64_t)k->dtype * 0xbf58476d1ce4e5b9u ^
                 (uint64_t)k->m * 0x94d049bb133111ebu ^ (uint64_t)k->n * 0x2545f4914f6cdd1du ^
                 (uint64_t)k->k * 0x5851f42d4c957f2du ^ (uint64_t)tactic * 0x14057b7ef767814fu;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9u;
    h ^= h >> 32;
    return 1e-6 * (double)(1 + h % 4);
}

typedef struct {
    const shape_t *shapes;
    _Atomic int count[N_SHAPES][N_TAC]; /* profiles of each pair, all ranks */
    _Atomic int by_rank[FAKE_MAX_RANKS];
    int mismatch_rank; /* >= 0: that rank registers one more candidate */
} record_t;

typedef struct {
    record_t *rec;
    int rank, size;
    fake_group_t *g;
    int table[N_SHAPES]; /* out: chosen tactic per shape */
    duet_status_t st;
    duet_tune_stats_t stats;
} rank_arg_t;

typedef struct {
    record_t *rec;
    int rank;
} prof_user_t;

static double record_profile(void *user, const duet_tune_key_t *key, int tactic)
{
    prof_user_t *u = user;
    for (int i = 0; i < N_SHAPES; i++)
        if (duet_tune_key_cmp(&u->rec->shapes[i].key, key) == 0) {
            atomic_fetch_add(&u->rec->count[i][tactic], 1);
            atomic_fetch_add(&u->rec->by_rank[u->rank], 1);
            return cost(key, tactic);
        }
    return NAN;
}

static duet_tune_t *new_tuner(void)
{
    duet_tune_space_t sp = {0};
    sp.n_tactics[DUET_TUNE_OP_CPU_MATMUL] = N_TAC;
    duet_tune_t *t = NULL;
    CHECK(duet_tune_create(&sp, "test machine 1", &t) == DUET_OK, "%s", duet_error_last());
    return t;
}

static void *rank_main(void *arg)
{
    rank_arg_t *a = arg;
    fake_comm_t *fc = calloc(1, sizeof(*fc));
    fc->base = (duet_comm_t){.ops = &fake_ops, .rank = a->rank, .size = a->size, .timeout_ms = 0};
    fc->g = a->g;
    duet_comm_t *comm = a->size > 1 ? &fc->base : NULL; /* N = 1: the tuner alone */
    duet_tune_t *t = new_tuner();
    /* each rank registers the shapes in its own order: the canonical order must not care */
    for (int j = 0; j < N_SHAPES; j++) {
        const shape_t *s = &a->rec->shapes[(j + 3 * a->rank) % N_SHAPES];
        a->st = duet_tune_add(t, &s->key, s->tactics, s->n);
        if (a->st != DUET_OK)
            goto out;
    }
    if (a->rank == a->rec->mismatch_rank) {
        duet_tune_key_t extra = a->rec->shapes[0].key;
        extra.n += 1;
        int tac[2] = {0, 1};
        a->st = duet_tune_add(t, &extra, tac, 2);
        if (a->st != DUET_OK)
            goto out;
    }
    prof_user_t u = {.rec = a->rec, .rank = a->rank};
    a->st = duet_tune_run(t, comm, record_profile, &u, &a->stats);
    for (int i = 0; i < N_SHAPES; i++)
        a->table[i] = duet_tune_get(t, &a->rec->shapes[i].key);
out:
    duet_tune_destroy(t);
    fake_destroy(&fc->base);
    return NULL;
}

/* Run the tuner on `size` fake ranks; a[] gets each rank's result. */
static void run_group(record_t *rec, int size, rank_arg_t *a)
{
    fake_group_t g = {.size = size};
    pthread_barrier_init(&g.bar, NULL, (unsigned)size);
    pthread_t th[FAKE_MAX_RANKS];
    for (int r = 0; r < size; r++) {
        a[r] = (rank_arg_t){.rec = rec, .rank = r, .size = size, .g = &g};
        CHECK(pthread_create(&th[r], NULL, rank_main, &a[r]) == 0);
    }
    for (int r = 0; r < size; r++)
        pthread_join(th[r], NULL);
    pthread_barrier_destroy(&g.bar);
}

Test(tune, split_over_fake_group)
{
    shape_t shapes[N_SHAPES];
    make_shapes(shapes);

    /* the reference choice, from the cost model directly: argmin, ties to the lowest tactic */
    int want[N_SHAPES], pairs = 0, singles = 0, ties = 0;
    for (int i = 0; i < N_SHAPES; i++) {
        int best = -1;
        double bc = INFINITY;
        for (int t = 0; t < N_TAC; t++)
            for (int j = 0; j < shapes[i].n; j++)
                if (shapes[i].tactics[j] == t) {
                    double c = cost(&shapes[i].key, t);
                    ties += c == bc;
                    if (c < bc)
                        best = t, bc = c;
                }
        want[i] = best;
        pairs += shapes[i].n;
        singles += shapes[i].n == 1;
    }
    cr_assert_gt(ties, 0, "the cost model gives no ties: the tie rule goes untested");
    cr_assert_gt(singles, 0);

    int table1[N_SHAPES];
    for (int size = 1; size <= 4; size++) {
        record_t *rec = calloc(1, sizeof(*rec));
        rec->shapes = shapes;
        rec->mismatch_rank = -1;
        rank_arg_t a[FAKE_MAX_RANKS];
        run_group(rec, size, a);
        int total = 0;
        for (int r = 0; r < size; r++) {
            cr_assert_eq(a[r].st, DUET_OK, "N=%d rank %d: %s", size, r, duet_error_last());
            cr_assert_eq(a[r].stats.pairs, pairs);
            cr_assert_eq(a[r].stats.profiled, atomic_load(&rec->by_rank[r]),
                         "N=%d rank %d: stats say %lld profiled", size, r,
                         (long long)a[r].stats.profiled);
            total += atomic_load(&rec->by_rank[r]);
        }
        cr_assert_eq(total, pairs - singles, "N=%d: %d profiles for %d pairs", size, total,
                     pairs - singles);
        for (int i = 0; i < N_SHAPES; i++)
            for (int t = 0; t < N_TAC; t++) {
                int listed = 0;
                for (int j = 0; j < shapes[i].n; j++)
                    listed |= shapes[i].tactics[j] == t;
                int want_n = listed && shapes[i].n > 1 ? 1 : 0;
                cr_assert_eq(atomic_load(&rec->count[i][t]), want_n,
                             "N=%d shape %d tactic %d profiled %d times", size, i, t,
                             atomic_load(&rec->count[i][t]));
            }
        /* round robin: every rank within the singles (assigned but not profiled) of P / N */
        for (int r = 0; r < size; r++) {
            int got = atomic_load(&rec->by_rank[r]);
            double share = (double)pairs / size;
            cr_assert(got >= (int)floor(share) - singles && got <= (int)ceil(share),
                      "N=%d rank %d profiled %d of %d pairs", size, r, got, pairs);
        }
        for (int r = 0; r < size; r++)
            for (int i = 0; i < N_SHAPES; i++) {
                cr_assert_eq(a[r].table[i], want[i], "N=%d rank %d shape %d: %d, want %d", size, r,
                             i, a[r].table[i], want[i]);
                if (size == 1)
                    table1[i] = a[r].table[i];
                else
                    cr_assert_eq(a[r].table[i], table1[i]);
            }
        free(rec);
    }
}

Test(tune, ranks_with_other_candidates_all_fail)
{
    shape_t shapes[N_SHAPES];
    make_shapes(shapes);
    for (int size = 2; size <= 3; size++) {
        record_t *rec = calloc(1, sizeof(*rec));
        rec->shapes = shapes;
        rec->mismatch_rank = size - 1;
        rank_arg_t a[FAKE_MAX_RANKS];
        run_group(rec, size, a);
        for (int r = 0; r < size; r++) {
            cr_assert_eq(a[r].st, DUET_ERR_INVALID, "N=%d rank %d: %d", size, r, a[r].st);
            cr_assert_eq(atomic_load(&rec->by_rank[r]), 0, "nothing profiled before the check");
        }
        free(rec);
    }
}

Test(tune, unusable_tactics_and_lookup)
{
    duet_tune_t *t = new_tuner();
    duet_tune_key_t k = {.op = 0, .dtype = 1, .m = 2, .n = 64, .k = 32};
    int tac[3] = {5, 2, 9};
    cr_assert_eq(duet_tune_add(t, &k, tac, 3), DUET_OK);
    int bad[2] = {1, 1};
    cr_assert_eq(duet_tune_add(t, &k, bad, 2), DUET_ERR_INVALID, "a repeated tactic");
    int oor = N_TAC;
    cr_assert_eq(duet_tune_add(t, &k, &oor, 1), DUET_ERR_INVALID, "a tactic out of range");
    duet_tune_key_t kb = k;
    kb.m = DUET_TUNE_M_BUCKETS;
    cr_assert_eq(duet_tune_add(t, &kb, tac, 3), DUET_ERR_INVALID, "a bad bucket");
    cr_assert_eq(duet_tune_get(t, &k), -1, "no choice before run");
    duet_tune_destroy(t);
}

/* every tactic but 9 fails (NaN, negative): 9 is chosen though it is not the lowest */
static double only_nine(void *user, const duet_tune_key_t *key, int tactic)
{
    (void)user, (void)key;
    return tactic == 9 ? 1.0 : tactic == 2 ? -1.0 : NAN;
}

Test(tune, unusable_tactics_are_never_chosen)
{
    duet_tune_t *t = new_tuner();
    duet_tune_key_t k = {.op = 0, .dtype = 0, .m = 0, .n = 8, .k = 8};
    int tac[3] = {5, 2, 9};
    cr_assert_eq(duet_tune_add(t, &k, tac, 3), DUET_OK);
    cr_assert_eq(duet_tune_run(t, NULL, only_nine, NULL, NULL), DUET_OK);
    cr_assert_eq(duet_tune_get(t, &k), 9);
    cr_assert_eq(duet_tune_get(NULL, &k), -1);
    duet_tune_destroy(t);
}

Test(tune, m_buckets)
{
    const int64_t m[] = {1, 2, 4, 5, 8, 9, 16, 17, 64, 65, 100000};
    const int32_t b[] = {0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5};
    for (size_t i = 0; i < sizeof(m) / sizeof(m[0]); i++)
        cr_assert_eq(duet_tune_m_bucket(m[i]), b[i], "M=%lld", (long long)m[i]);
}

/* ---- the file ------------------------------------------------------------------------------- */

/* Saved files name the op: the names are the file format's, and stay what they are. */
Test(tune, op_names)
{
    cr_assert_str_eq(duet_tune_op_name(DUET_TUNE_OP_CPU_MATMUL), "cpu_matmul");
    cr_assert_str_eq(duet_tune_op_name(DUET_TUNE_OP_CUDA_GEMM), "cuda_gemm");
    cr_assert_null(duet_tune_op_name(DUET_TUNE_OP_COUNT));
    cr_assert_null(duet_tune_op_name(-1));
}

/* A tuner of both ops (the CUDA backend's holds cuda_gemm with its 4 cuBLASLt tactics): lines of
 * each op load, save in key order (cpu_matmul's first: op is the key's first field) and load back;
 * a cuda_gemm tactic past 3 is refused, and the op of a line is part of its shape. */
Test(tune, cuda_gemm_lines)
{
    duet_tune_space_t sp = {0};
    sp.n_tactics[DUET_TUNE_OP_CPU_MATMUL] = N_TAC;
    sp.n_tactics[DUET_TUNE_OP_CUDA_GEMM] = 4;
    duet_tune_t *t = NULL, *u = NULL;
    cr_assert_eq(duet_tune_create(&sp, "NVIDIA H200 cuda", &t), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_tune_create(&sp, "NVIDIA H200 cuda", &u), DUET_OK, "%s", duet_error_last());
    const char text[] = "duet-tune 1 NVIDIA H200 cuda\n"
                        "cuda_gemm BF16 65+ 4096 2048 3\n"
                        "cpu_matmul BF16 65+ 4096 2048 7\n"
                        "cuda_gemm F32 9-16 128 64 1\n";
    cr_assert_eq(duet_tune_load_text(t, text, strlen(text), "t"), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_tune_count(t), 3);
    duet_tune_key_t kg = {
        .op = DUET_TUNE_OP_CUDA_GEMM, .dtype = DUET_DTYPE_BF16, .m = 5, .n = 4096, .k = 2048};
    duet_tune_key_t kc = kg, kf = {.op = DUET_TUNE_OP_CUDA_GEMM,
                                   .dtype = DUET_DTYPE_F32,
                                   .m = 3,
                                   .n = 128,
                                   .k = 64};
    kc.op = DUET_TUNE_OP_CPU_MATMUL;
    cr_assert_eq(duet_tune_get(t, &kg), 3);
    cr_assert_eq(duet_tune_get(t, &kc), 7);
    cr_assert_eq(duet_tune_get(t, &kf), 1);
    kf.m = 2; /* another bucket: no entry */
    cr_assert_eq(duet_tune_get(t, &kf), -1);
    duet_tune_key_t k0;
    int tac;
    duet_tune_entry(t, 0, &k0, &tac);
    cr_assert_eq(k0.op, DUET_TUNE_OP_CPU_MATMUL);

    char path[] = "/tmp/duet_test_tune_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(duet_tune_save(t, path), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_tune_load(u, path), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_tune_count(u), 3);
    cr_assert_eq(duet_tune_get(u, &kg), 3);
    cr_assert_eq(duet_tune_get(u, &kc), 7);
    unlink(path);

    const char past[] = "duet-tune 1 NVIDIA H200 cuda\ncuda_gemm BF16 65+ 4096 2048 4\n";
    cr_assert_eq(duet_tune_load_text(u, past, strlen(past), "past"), DUET_ERR_FORMAT);
    cr_assert_not_null(strstr(duet_error_last(), "line 2: tactic out of range"), "%s",
                       duet_error_last());
    cr_assert_eq(duet_tune_get(u, &kg), 3, "a refused file left the table as it was");
    duet_tune_destroy(t);
    duet_tune_destroy(u);
}

static double by_cost(void *user, const duet_tune_key_t *key, int tactic)
{
    (void)user;
    return cost(key, tactic);
}

Test(tune, save_load_round_trip)
{
    shape_t shapes[N_SHAPES];
    make_shapes(shapes);
    duet_tune_t *t = new_tuner();
    for (int i = 0; i < N_SHAPES; i++)
        cr_assert_eq(duet_tune_add(t, &shapes[i].key, shapes[i].tactics, shapes[i].n), DUET_OK);
    cr_assert_eq(duet_tune_run(t, NULL, by_cost, NULL, NULL), DUET_OK);
    cr_assert_eq(duet_tune_count(t), N_SHAPES);
    char path[] = "/tmp/duet_test_tune_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(duet_tune_save(t, path), DUET_OK, "%s", duet_error_last());
    duet_tune_t *u = new_tuner();
    cr_assert_eq(duet_tune_load(u, path), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_tune_count(u), duet_tune_count(t));
    for (int64_t i = 0; i < duet_tune_count(t); i++) {
        duet_tune_key_t ka, kb;
        int ta, tb;
        duet_tune_entry(t, i, &ka, &ta);
        duet_tune_entry(u, i, &kb, &tb);
        cr_assert_eq(duet_tune_key_cmp(&ka, &kb), 0, "entry %lld", (long long)i);
        cr_assert_eq(ta, tb);
    }
    for (int i = 0; i < N_SHAPES; i++)
        cr_assert_eq(duet_tune_get(u, &shapes[i].key), duet_tune_get(t, &shapes[i].key));
    unlink(path);
    cr_assert_eq(duet_tune_load(u, path), DUET_ERR_NOT_FOUND);
    duet_tune_destroy(t);
    duet_tune_destroy(u);
}

Test(tune, malformed_files_refused)
{
    static const struct {
        const char *text, *what, *says;
    } bad[] = {
        {"", "empty", "empty"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 1 16 32 3", "no final newline",
         "line 2: truncated"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 1 16 32\n", "a truncated line", "line 2"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 1 16 32 3 4\n", "a field too many", "line 2"},
        {"duet-tune 1 test machine 1\ncpu_matmul  F32 1 16 32 3\n", "two spaces", "line 2"},
        {"duet-tune 2 test machine 1\n", "bad version", "line 1: format version"},
        {"duet-tune x test machine 1\n", "bad version", "line 1: format version"},
        {"duet-tune 1 another machine\n", "wrong machine", "line 1: made on"},
        {"duet-tune 1\n", "no machine", "line 1: made on"},
        {"tune 1 test machine 1\n", "no magic", "line 1"},
        {"duet-tune 1 test machine 1\ncuda_gemm F32 1 16 32 3\n", "op not in this tuner",
         "line 2: unknown op"},
        {"duet-tune 1 test machine 1\nrocm_gemm F32 1 16 32 3\n", "unknown op",
         "line 2: unknown op"},
        {"duet-tune 1 test machine 1\ncpu_matmul F64 1 16 32 3\n", "unknown dtype",
         "line 2: unknown dtype"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 3 16 32 3\n", "unknown bucket",
         "line 2: unknown M bucket"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 1 0 32 3\n", "n = 0", "line 2: bad n"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 1 -16 32 3\n", "negative n", "line 2: bad n"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 1 016 32 3\n", "leading zero",
         "line 2: bad n"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 1 16 99999999999999999999 3\n", "k overflow",
         "line 2: bad k"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 1 16 32 11\n", "tactic out of range",
         "line 2: tactic out of range"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 1 16 32 -1\n", "negative tactic",
         "line 2: tactic out of range"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 1 16 32 3\ncpu_matmul BF16 1 16 32 3\n"
         "cpu_matmul F32 1 16 32 4\n",
         "duplicate shape", "line 4: the same shape"},
        {"duet-tune 1 test machine 1\ncpu_matmul F32 1 16 32 3\n\n", "empty line", "line 3"},
    };
    duet_tune_t *t = new_tuner();
    /* a good table first: a refused file must leave it as it was */
    const char good[] = "duet-tune 1 test machine 1\ncpu_matmul BF16 9-16 48 96 7\n";
    cr_assert_eq(duet_tune_load_text(t, good, strlen(good), "good"), DUET_OK, "%s",
                 duet_error_last());
    duet_tune_key_t gk = {.op = 0, .dtype = 1, .m = 3, .n = 48, .k = 96};
    cr_assert_eq(duet_tune_get(t, &gk), 7);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        duet_status_t st = duet_tune_load_text(t, bad[i].text, strlen(bad[i].text), "f");
        cr_assert_eq(st, DUET_ERR_FORMAT, "%s: status %d", bad[i].what, st);
        cr_assert_not_null(strstr(duet_error_last(), bad[i].says), "%s: error \"%s\" lacks \"%s\"",
                           bad[i].what, duet_error_last(), bad[i].says);
        cr_assert_eq(duet_tune_get(t, &gk), 7, "%s: the table changed", bad[i].what);
    }
    const char nul[] = "duet-tune 1 test machine 1\ncpu_matmul F32 1 16\0 32 3\n";
    cr_assert_eq(duet_tune_load_text(t, nul, sizeof(nul) - 1, "f"), DUET_ERR_FORMAT);
    duet_tune_destroy(t);
}

/* A file of its header alone is a table with no entries (it once reached qsort with a NULL array,
 * which UBSan reports): it loads and replaces a table that had entries. */
Test(tune, header_only_file_is_an_empty_table)
{
    duet_tune_t *t = new_tuner();
    const char good[] = "duet-tune 1 test machine 1\ncpu_matmul BF16 9-16 48 96 7\n";
    cr_assert_eq(duet_tune_load_text(t, good, strlen(good), "good"), DUET_OK, "%s",
                 duet_error_last());
    duet_tune_key_t gk = {.op = 0, .dtype = 1, .m = 3, .n = 48, .k = 96};
    cr_assert_eq(duet_tune_get(t, &gk), 7);
    const char empty[] = "duet-tune 1 test machine 1\n";
    cr_assert_eq(duet_tune_load_text(t, empty, strlen(empty), "empty"), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(duet_tune_count(t), 0);
    cr_assert_eq(duet_tune_get(t, &gk), -1);
    duet_tune_destroy(t);
}

/* load_group: each fake rank loads its own file (path[rank]); the statuses they return. */
typedef struct {
    fake_group_t *g;
    int rank, size;
    const char *path;
    duet_status_t st;
    int64_t count;
} load_arg_t;

static void *load_rank_main(void *arg)
{
    load_arg_t *a = arg;
    fake_comm_t *fc = calloc(1, sizeof(*fc));
    fc->base = (duet_comm_t){.ops = &fake_ops, .rank = a->rank, .size = a->size};
    fc->g = a->g;
    duet_tune_t *t = new_tuner();
    a->st = duet_tune_load_group(t, a->path, &fc->base);
    a->count = duet_tune_count(t);
    duet_tune_destroy(t);
    fake_destroy(&fc->base);
    return NULL;
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

Test(tune, load_group_agrees_on_load_or_profile)
{
    const char *good = "duet-tune 1 test machine 1\ncpu_matmul F32 1 16 32 3\n";
    const char *other = "duet-tune 1 test machine 1\ncpu_matmul F32 1 16 32 4\n";
    const char *bad = "duet-tune 1 test machine 1\ncpu_matmul F32 1 16 32\n";
    enum { GOOD, OTHER, BAD, NONE };
    static const struct {
        int file[3];
        duet_status_t want[3];
    } cases[] = {
        {{GOOD, GOOD, GOOD}, {DUET_OK, DUET_OK, DUET_OK}},
        {{GOOD, NONE, GOOD}, {DUET_ERR_NOT_FOUND, DUET_ERR_NOT_FOUND, DUET_ERR_NOT_FOUND}},
        {{GOOD, GOOD, BAD}, {DUET_ERR_INVALID, DUET_ERR_INVALID, DUET_ERR_FORMAT}},
        {{GOOD, OTHER, GOOD}, {DUET_ERR_INVALID, DUET_ERR_INVALID, DUET_ERR_INVALID}},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        char paths[3][64];
        fake_group_t g = {.size = 3};
        pthread_barrier_init(&g.bar, NULL, 3);
        load_arg_t a[3];
        pthread_t th[3];
        for (int r = 0; r < 3; r++) {
            snprintf(paths[r], sizeof(paths[r]), "/tmp/duet_test_tune_group_%d_%d", (int)getpid(),
                     r);
            int f = cases[c].file[r];
            if (f == NONE)
                unlink(paths[r]);
            else
                write_file(paths[r], f == GOOD ? good : f == OTHER ? other : bad);
            a[r] = (load_arg_t){.g = &g, .rank = r, .size = 3, .path = paths[r]};
            cr_assert_eq(pthread_create(&th[r], NULL, load_rank_main, &a[r]), 0);
        }
        for (int r = 0; r < 3; r++)
            pthread_join(th[r], NULL);
        pthread_barrier_destroy(&g.bar);
        for (int r = 0; r < 3; r++) {
            cr_assert_eq(a[r].st, cases[c].want[r], "case %zu rank %d: %d, want %d", c, r, a[r].st,
                         cases[c].want[r]);
            if (a[r].st == DUET_ERR_NOT_FOUND)
                cr_assert_eq(a[r].count, 0, "case %zu rank %d: the table is emptied", c, r);
            unlink(paths[r]);
        }
    }
}

/* ---- the CPU matmul's tactics ---------------------------------------------------------------- */

static uint32_t f_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

Test(tune, cpu_matmul_tactics_bit_identical, .timeout = 600)
{
    /* odd shapes: M of every bucket (and a 4-row / 2-row tile tail), N not a multiple of any
     * granule, K with a vector tail, one past the K blocking (1536) */
    static const int64_t shapes[][3] = {{1, 257, 67},  {2, 33, 1601},   {3, 130, 31},
                                        {5, 17, 200},  {7, 255, 129},   {13, 1, 77},
                                        {17, 300, 45}, {70, 129, 1543}, {9, 64, 8}};
    const duet__isa_t isas[] = {DUET__ISA_SCALAR, DUET__ISA_AVX2, DUET__ISA_AVX512};
    duet_kernels_t *k = NULL;
    cr_assert_eq(duet_kernels_create(DUET_DEVICE_CPU, 3, &k), DUET_OK);
    int isas_run = 0;
    for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
        if (duet__kernels_cpu_set_isa(k, isas[ii]) != DUET_OK) {
            printf("[tune] isa %s: not on this CPU\n", duet__isa_name(isas[ii]));
            continue;
        }
        isas_run++;
        for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++)
            for (int dt = 0; dt < 3; dt++)
                for (int acc = 0; acc < 2; acc++) {
                    const int64_t M = shapes[si][0], N = shapes[si][1], K = shapes[si][2];
                    const int64_t ldx = K + 3, ldy = N + 5;
                    float *x = malloc(sizeof(float) * (size_t)(M * ldx));
                    float *y0 = malloc(sizeof(float) * (size_t)(M * ldy));
                    float *y1 = malloc(sizeof(float) * (size_t)(M * ldy));
                    void *wd = malloc((size_t)(N * K) * duet_dtype_size((duet_dtype_t)dt));
                    for (int64_t i = 0; i < M * ldx; i++)
                        x[i] = rng_f();
                    for (int64_t i = 0; i < N * K; i++) {
                        float v = rng_f();
                        if (dt == DUET_DTYPE_F32)
                            ((float *)wd)[i] = v;
                        else if (dt == DUET_DTYPE_BF16)
                            ((uint16_t *)wd)[i] = duet_f32_to_bf16(v);
                        else
                            ((uint16_t *)wd)[i] = duet_f32_to_f16(v);
                    }
                    duet_tensor_t w = {.data = wd,
                                       .dtype = (duet_dtype_t)dt,
                                       .device = DUET_DEVICE_CPU,
                                       .ndim = 2,
                                       .shape = {N, K}};
                    for (int64_t i = 0; i < M * ldy; i++)
                        y0[i] = rng_f();
                    memcpy(y1, y0, sizeof(float) * (size_t)(M * ldy));
                    CHECK(duet__matmul_tactic(k, y0, ldy, x, ldx, M, &w, acc, -1) == DUET_OK);
                    float *yin = malloc(sizeof(float) * (size_t)(M * ldy));
                    memcpy(yin, y1, sizeof(float) * (size_t)(M * ldy));
                    for (int tac = 0; tac < DUET__MM_TACTICS; tac++) {
                        memcpy(y1, yin, sizeof(float) * (size_t)(M * ldy));
                        CHECK(duet__matmul_tactic(k, y1, ldy, x, ldx, M, &w, acc, tac) == DUET_OK);
                        for (int64_t i = 0; i < M * ldy; i++)
                            CHECK(f_bits(y0[i]) == f_bits(y1[i]),
                                  "%s M=%lld N=%lld K=%lld %s acc=%d tactic %d: y[%lld] %a vs "
                                  "default %a",
                                  duet__isa_name(isas[ii]), (long long)M, (long long)N,
                                  (long long)K, duet_dtype_name((duet_dtype_t)dt), acc, tac,
                                  (long long)i, y1[i], y0[i]);
                    }
                    free(yin);
                    free(x);
                    free(y0);
                    free(y1);
                    free(wd);
                }
        printf("[tune] isa %s: %d tactics bit-identical to the default\n", duet__isa_name(isas[ii]),
               DUET__MM_TACTICS);
    }
    cr_assert_geq(isas_run, 1, "the scalar path at least");
    duet_kernels_destroy(k);
}

Test(tune, cpu_matmul_consults_the_tuner)
{
    duet_kernels_t *k = NULL;
    cr_assert_eq(duet_kernels_create(DUET_DEVICE_CPU, 2, &k), DUET_OK);
    float wd[40 * 24];
    for (int i = 0; i < 40 * 24; i++)
        wd[i] = (float)(i % 17) - 8.0f;
    duet_tensor_t w = {.data = wd,
                       .dtype = DUET_DTYPE_F32,
                       .device = DUET_DEVICE_CPU,
                       .ndim = 2,
                       .shape = {40, 24}};
    duet_tune_t *t = NULL;
    cr_assert_eq(duet_k_matmul_tuner_create(k, &t), DUET_OK);
    char text[256];
    snprintf(text, sizeof(text), "duet-tune 1 %s\ncpu_matmul F32 5-8 40 24 7\n",
             duet_tune_machine(t));
    cr_assert_eq(duet_tune_load_text(t, text, strlen(text), "t"), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet__matmul_tactic_for(k, 6, &w), -1, "no tuner set yet");
    duet_kernels_set_tuner(k, t);
    cr_assert_eq(duet__matmul_tactic_for(k, 6, &w), 7);
    cr_assert_eq(duet__matmul_tactic_for(k, 9, &w), -1, "another bucket");
    /* and the real profiling entry on a few shapes: a choice for each, in range */
    duet_k_matmul_shape_t sh[3] = {{1, &w}, {4, &w}, {3, &w}};
    duet_tune_t *t2 = NULL;
    cr_assert_eq(duet_k_matmul_tuner_create(k, &t2), DUET_OK);
    duet_tune_stats_t stats;
    cr_assert_eq(duet_k_matmul_tune(k, t2, sh, 3, NULL, &stats), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(stats.shapes, 2, "M=4 and M=3 share the bucket 2-4");
    cr_assert_eq(stats.profiled, 2 * DUET__MM_TACTICS);
    cr_assert_eq(duet_tune_count(t2), 2);
    duet_tune_key_t key = {.op = 0, .dtype = 0, .m = 1, .n = 40, .k = 24};
    int tac = duet_tune_get(t2, &key);
    cr_assert(tac >= 0 && tac < DUET__MM_TACTICS);
    duet_kernels_set_tuner(k, NULL);
    duet_kernels_destroy(k);
    duet_tune_destroy(t);
    duet_tune_destroy(t2);
}

/* ---- the engine option ---------------------------------------------------------------------- */

#define E_SEQS  3
#define E_STEPS 4

/* Logits of a batched prefill of E_SEQS prompts and E_STEPS batched decode steps. */
static float *run_model(const char *dir, int tune, const char *tune_file, int64_t *n_out)
{
    duet_model_opts_t o;
    duet_model_opts_default(&o);
    o.n_threads = 2;
    o.max_seqs = E_SEQS;
    o.max_seq_len = 64;
    o.page_tokens = 16;
    o.tune = tune;
    o.tune_file = tune_file;
    duet_model_t *m = NULL;
    cr_assert_eq(duet_model_load(dir, &o, &m), DUET_OK, "%s", duet_error_last());
    const int64_t V = duet_model_config(m)->vocab_size;
    float *out = calloc((size_t)((E_STEPS + 1) * E_SEQS * V), sizeof(float));
    duet_seq_t seq[E_SEQS];
    duet_batch_item_t it[E_SEQS];
    int32_t prompt[E_SEQS][8], next[E_SEQS];
    for (int s = 0; s < E_SEQS; s++) {
        cr_assert_eq(duet_model_seq_open(m, 64, &seq[s]), DUET_OK, "%s", duet_error_last());
        for (int i = 0; i < 3 + s; i++)
            prompt[s][i] = (int32_t)((7 * i + 11 * s + 1) % V);
    }
    int64_t at = 0;
    for (int step = 0; step <= E_STEPS; step++) {
        for (int s = 0; s < E_SEQS; s++) {
            memset(&it[s], 0, sizeof(it[s]));
            it[s].seq = &seq[s];
            it[s].tokens = step == 0 ? prompt[s] : &next[s];
            it[s].n_tokens = step == 0 ? 3 + s : 1;
            it[s].logits_mode = DUET_LOGITS_LAST;
            it[s].logits = out + (at + s) * V;
        }
        cr_assert_eq(duet_model_forward(m, it, E_SEQS), DUET_OK, "%s", duet_error_last());
        for (int s = 0; s < E_SEQS; s++) {
            const float *l = out + (at + s) * V;
            int best = 0;
            for (int v = 1; v < V; v++)
                if (l[v] > l[best])
                    best = v;
            next[s] = best;
        }
        at += E_SEQS;
    }
    for (int s = 0; s < E_SEQS; s++)
        duet_model_seq_close(m, &seq[s]);
    duet_model_free(m);
    *n_out = at * V;
    return out;
}

Test(tune, engine_tuned_model_gives_the_same_bits, .timeout = 600)
{
    char dir[1024], path[] = "/tmp/duet_test_tune_engine_XXXXXX";
    snprintf(dir, sizeof(dir), "%s/tests/fixtures/kda-first-fp32", DUET_SOURCE_DIR);
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    unlink(path); /* the first tuned load profiles and saves here */
    int64_t n0, n1, n2;
    float *l0 = run_model(dir, 0, NULL, &n0);
    float *l1 = run_model(dir, 1, path, &n1);
    cr_assert_eq(access(path, R_OK), 0, "the tuned table was saved");
    float *l2 = run_model(dir, 1, path, &n2); /* loaded from the file */
    cr_assert_eq(n0, n1);
    cr_assert_eq(n0, n2);
    /* the profiled choice may happen to be the default split everywhere: rewrite the table with
     * pooled tactics only (1..12 in turn), so that non-default splits surely run */
    {
        FILE *f = fopen(path, "r");
        cr_assert_not_null(f);
        char lines[256][160];
        int n = 0;
        while (n < 256 && fgets(lines[n], sizeof(lines[n]), f) != NULL)
            n++;
        fclose(f);
        cr_assert_gt(n, 5, "a header and the shapes");
        f = fopen(path, "w");
        fputs(lines[0], f);
        for (int i = 1; i < n; i++) {
            char *sp = strrchr(lines[i], ' ');
            cr_assert_not_null(sp);
            *sp = '\0';
            fprintf(f, "%s %d\n", lines[i], 1 + (i - 1) % (DUET__MM_TACTICS - 1));
        }
        fclose(f);
    }
    int64_t n3;
    float *l3 = run_model(dir, 1, path, &n3);
    cr_assert_eq(n0, n3);
    int nonzero = 0;
    for (int64_t i = 0; i < n0; i++) {
        CHECK(f_bits(l0[i]) == f_bits(l1[i]), "logit %lld: tuned %a, untuned %a", (long long)i,
              l1[i], l0[i]);
        CHECK(f_bits(l0[i]) == f_bits(l2[i]), "logit %lld: from file %a, untuned %a", (long long)i,
              l2[i], l0[i]);
        CHECK(f_bits(l0[i]) == f_bits(l3[i]), "logit %lld: pooled tactics %a, untuned %a",
              (long long)i, l3[i], l0[i]);
        nonzero += l0[i] != 0.0f;
    }
    cr_assert_gt(nonzero, n0 / 2, "the logits were computed");
    /* a file for another machine fails the load */
    FILE *f = fopen(path, "w");
    fprintf(f, "duet-tune 1 cpu isa=none threads=999\n");
    fclose(f);
    duet_model_opts_t o;
    duet_model_opts_default(&o);
    o.n_threads = 2;
    o.max_seqs = E_SEQS;
    o.max_seq_len = 64;
    o.tune = 1;
    o.tune_file = path;
    duet_model_t *m = NULL;
    cr_assert_eq(duet_model_load(dir, &o, &m), DUET_ERR_FORMAT);
    unlink(path);
    free(l0);
    free(l1);
    free(l2);
    free(l3);
}
