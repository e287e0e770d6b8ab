/*
 * tune.h: a generic autotuner (issue 39). A backend has, for each op shape, several candidate
 * tactics (ways to run the op that compute the same products at different speeds); they are
 * profiled once at start and the fastest per shape is kept, looked up by shape on every call, and
 * can be saved to and loaded from a file. What "the same" means is the op's: the CPU matmul's
 * tactics (its work split) give the same bits; the CUDA GEMM's (cuBLASLt's algorithms for the
 * shape, kernels/cuda/cuda_gemm.h) round x the same way and agree to the order and split of their
 * fp32 sums only, so a tuned CUDA run is not bit-identical to an untuned one.
 *
 * In a group (common/comm.h) the profiling is split over the ranks: every rank registers the same
 * (shape, tactic) pairs, rank r profiles only its share of them, the timings are all-gathered and
 * every rank keeps the same fastest tactic per shape (the same timings on every rank make the
 * same choice), equal to what one rank profiling everything would choose with the same timings.
 *
 * This file knows no device and no engine: a shape is a key (op, dtype, M bucket, N, K), a tactic
 * a small int the op's owner interprets (kernels/cpu/matmul.c, kernels/cuda/gemm.cu), and the
 * timing a callback.
 */
#ifndef DUET_KERNELS_TUNE_H
#define DUET_KERNELS_TUNE_H

#include <stddef.h>
#include <stdint.h>

#include "common/comm.h"
#include "common/status.h"

/* Ops a tuner may hold (each op's owner defines its tactics; a saved file names the op). */
typedef enum {
    DUET_TUNE_OP_CPU_MATMUL = 0, /* duet_k_matmul: work split (kernels/cpu/matmul.c) */
    DUET_TUNE_OP_CUDA_GEMM = 1,  /* duet_cuda_gemm_matmul: cuBLASLt's t-th algorithm (gemm.cu) */
    DUET_TUNE_OP_COUNT
} duet_tune_op_t;

/* M buckets: rows 1, 2-4, 5-8, 9-16, 17-64, 65+. A shape's M is its bucket's index. */
#define DUET_TUNE_M_BUCKETS 6

/* One shape. Two keys are the same shape when every field is equal. */
typedef struct {
    int32_t op;    /* duet_tune_op_t */
    int32_t dtype; /* the op's operand dtype (duet_dtype_t) */
    int32_t m;     /* M bucket, duet_tune_m_bucket() */
    int64_t n, k;  /* >= 1 */
} duet_tune_key_t;

/* What an op's tactics are: how many (tactic ids are 0 .. n_tactics - 1). */
typedef struct {
    int n_tactics[DUET_TUNE_OP_COUNT]; /* 0: the tuner holds no shape of that op */
} duet_tune_space_t;

typedef struct duet_tune duet_tune_t;

/* Seconds one run of `tactic` on `key` takes (the callback's own median of a few reps). A value
 * that is not finite and >= 0 marks the tactic as unusable on that shape. */
typedef double (*duet_tune_profile_fn)(void *user, const duet_tune_key_t *key, int tactic);

/* What duet_tune_run did on this rank. */
typedef struct {
    int64_t shapes;   /* shapes with candidates */
    int64_t pairs;    /* (shape, tactic) pairs over all ranks */
    int64_t profiled; /* pairs this rank profiled */
    double seconds;   /* wall time of this rank's profiling and the all-gathers */
} duet_tune_stats_t;

/* The bucket of M rows (M >= 1): 0 for 1, 1 for 2-4, 2 for 5-8, 3 for 9-16, 4 for 17-64, 5 for
 * 65 and more. */
int32_t duet_tune_m_bucket(int64_t m);
/* The most rows of bucket b (1, 4, 8, 16, 64; INT64_MAX for the last). */
int64_t duet_tune_m_bucket_max(int32_t b);
/* Order of keys (op, dtype, m, n, k): < 0, 0, > 0. Compare keys with it, never with memcmp (the
 * struct has padding). */
int duet_tune_key_cmp(const duet_tune_key_t *a, const duet_tune_key_t *b);
/* "cpu_matmul", "cuda_gemm"; NULL for an unknown op. */
const char *duet_tune_op_name(int32_t op);

/*
 * An empty tuner for the ops of `space`, on `machine` (one line of text naming the hardware and
 * backend the timings hold for: a file saved on another machine is refused at load; no newline).
 * DUET_ERR_INVALID for a bad space or machine, DUET_ERR_NOMEM.
 */
duet_status_t duet_tune_create(const duet_tune_space_t *space, const char *machine,
                               duet_tune_t **t_p);
void duet_tune_destroy(duet_tune_t *t); /* accepts NULL */
/* The machine line given at create. */
const char *duet_tune_machine(const duet_tune_t *t);

/*
 * Register a shape and its candidate tactics (each in the op's range, no repeats; their order
 * does not matter). A shape registered twice keeps the union of its candidates. Candidates are
 * profiled by the next duet_tune_run. DUET_ERR_INVALID for a bad key or tactic, DUET_ERR_NOMEM.
 */
duet_status_t duet_tune_add(duet_tune_t *t, const duet_tune_key_t *key, const int *tactics,
                            int n_tactics);

/*
 * Profile the registered candidates and keep the fastest tactic of each shape (ties: the lowest
 * tactic id; a shape none of whose tactics is usable keeps no entry). Collective over `comm`
 * (NULL = this process alone), whose ranks must have registered the same candidates: the pairs
 * are put in one canonical order (shapes by key, then tactics ascending), and rank r profiles
 * pair i when i % size == r (interleaved, so that each rank gets a share of every size of shape
 * rather than one contiguous run of the biggest); a shape with a single candidate is not
 * profiled. Two all-gathers follow: a digest of the pair lists (a rank whose list differs makes
 * every rank fail with DUET_ERR_INVALID rather than mix up timings) and the timings (NaN where
 * not measured). Logs at INFO how many pairs this rank profiled and in how long. The candidates
 * are then cleared; chosen tactics replace earlier entries of the same shapes. A comm error is
 * returned as is (the communicator is then broken, common/comm.h).
 */
duet_status_t duet_tune_run(duet_tune_t *t, duet_comm_t *comm, duet_tune_profile_fn profile,
                            void *user, duet_tune_stats_t *stats);

/* The chosen tactic of `key`, or -1 when the tuner has none (the caller then uses its default).
 * Cheap: a binary search, called on every op. Accepts t == NULL (-1). */
int duet_tune_get(const duet_tune_t *t, const duet_tune_key_t *key);
/* Chosen entries held. */
int64_t duet_tune_count(const duet_tune_t *t);
/* Entry i (0 .. count - 1) in key order: its key and tactic. */
void duet_tune_entry(const duet_tune_t *t, int64_t i, duet_tune_key_t *key, int *tactic);

/*
 * Save the chosen entries as text: a header line "duet-tune <version> <machine>" and one line per
 * shape "<op> <dtype> <m bucket> <n> <k> <tactic>" in key order, written to a temporary file
 * beside `path` and renamed over it (ranks of a group on one file system each save the same
 * table; a reader never sees half a file). DUET_ERR_IO.
 */
duet_status_t duet_tune_save(const duet_tune_t *t, const char *path);

/*
 * Load a saved table, replacing the chosen entries (all or nothing). Every field is checked: the
 * header's version and machine (it must equal this tuner's), each line's field count, op, dtype,
 * bucket, n and k, the tactic's range for the op, no shape twice, the last line ends in a newline.
 * DUET_ERR_FORMAT naming the file and line for a malformed or mismatched file, DUET_ERR_IO when it
 * cannot be read (DUET_ERR_NOT_FOUND when it does not exist).
 */
duet_status_t duet_tune_load(duet_tune_t *t, const char *path);
/*
 * duet_tune_load on every rank of `comm` (NULL = alone), so that a group either uses loaded tables
 * on every rank or profiles on every rank (duet_tune_run is collective: one rank profiling alone
 * would wait for the others). Collective. DUET_OK when every rank loaded the same table;
 * DUET_ERR_NOT_FOUND on every rank when some rank has no file (the table is then emptied: profile
 * and save); a rank whose file is malformed returns its own error and the others DUET_ERR_INVALID
 * naming it, as when the ranks' tables differ; a comm error as is.
 */
duet_status_t duet_tune_load_group(duet_tune_t *t, const char *path, duet_comm_t *comm);
/* The same from `len` bytes of `text`; `name` names them in errors. */
duet_status_t duet_tune_load_text(duet_tune_t *t, const char *text, size_t len, const char *name);

#endif /* DUET_KERNELS_TUNE_H */
