/*
 * Fuzz target: the cluster file of `duet up` / `duet sbatch` (deploy/launcher/cluster.c,
 * duet_cluster_load_string over common/yaml.c), then the Slurm batch script made from it
 * (deploy/launcher/sbatch.c).
 *
 * Input: the file's bytes. Checked besides no crash / sanitizer report (libyaml aliases make
 * cycles and exponential fan-out: a hang here is a finding):
 *  - a failure sets a detail and leaves *spec_p NULL;
 *  - a loaded cluster keeps the documented ranges: router count 1, ctx 0..64, gen 1..64 groups
 *    of cp x tp ranks with cp, tp >= 1 and cp * tp <= 64 (ctx and the router 1 x 1), ports
 *    1..65535 with http != workers, timeouts 1..3600 s and 1..600 s, sample.max_tokens 1..4096,
 *    every path and string set, every flattened argument a "--name" flag;
 *  - the batch script is written for it.
 */
#include "fuzz/fuzz.h"

#include "common/status.h"
#include "common/strbuf.h"
#include "deploy/launcher/cluster.h"
#include "deploy/launcher/sbatch.h"

static void check_role(const duet_cluster_role_t *r, const char *what, int min, int max)
{
    FUZZ_CHECK(r->binary != NULL && r->binary[0] != '\0', "%s: binary", what);
    FUZZ_CHECK(r->count >= min && r->count <= max, "%s: count %d", what, r->count);
    FUZZ_CHECK(r->cp >= 1 && r->tp >= 1 && r->cp * r->tp <= DUET_CLUSTER_MAX_RANKS,
               "%s: cp %d tp %d", what, r->cp, r->tp);
    FUZZ_CHECK(r->n_args == 0 || r->args != NULL, "%s: args", what);
    for (size_t i = 0; i < r->n_args; i++)
        FUZZ_CHECK(r->args[i] != NULL && strncmp(r->args[i], "--", 2) == 0 && r->args[i][2] != '\0',
                   "%s: argument %zu \"%s\" is not a flag", what, i, r->args[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    const duet_cluster_paths_t paths = {.root = "/srv/duet", .binaries = NULL};
    duet_cluster_t *spec = NULL;
    duet_error_clear();
    duet_status_t st =
        duet_cluster_load_string((const char *)data, size, "cluster.yaml", &paths, &spec);
    if (st != DUET_OK) {
        FUZZ_CHECK(st < 0 && spec == NULL, "failure %d left a cluster", (int)st);
        FUZZ_CHECK(duet_error_last()[0] != '\0', "failure without a detail");
        return 0;
    }
    FUZZ_CHECK(spec != NULL && spec->file != NULL && spec->model != NULL && spec->model[0] != '\0',
               "model");
    FUZZ_CHECK(spec->binaries != NULL && spec->http_host != NULL && spec->workers_host != NULL &&
                   spec->sample_prompt != NULL,
               "strings");
    check_role(&spec->router, "router", 1, 1);
    check_role(&spec->ctx, "ctx", 0, DUET_CLUSTER_MAX_WORKERS);
    check_role(&spec->gen, "gen", 1, DUET_CLUSTER_MAX_WORKERS);
    FUZZ_CHECK(spec->router.cp == 1 && spec->router.tp == 1 && spec->ctx.cp == 1 &&
                   spec->ctx.tp == 1,
               "only gen workers are groups");
    FUZZ_CHECK(spec->http_port >= 1 && spec->http_port <= 65535 && spec->workers_port >= 1 &&
                   spec->workers_port <= 65535 && spec->http_port != spec->workers_port,
               "ports %d %d", spec->http_port, spec->workers_port);
    FUZZ_CHECK(spec->startup_timeout_s >= 1 && spec->startup_timeout_s <= 3600,
               "startup_timeout_s %d", spec->startup_timeout_s);
    FUZZ_CHECK(spec->stop_timeout_s >= 1 && spec->stop_timeout_s <= 600, "stop_timeout_s %d",
               spec->stop_timeout_s);
    FUZZ_CHECK(spec->sample_max_tokens >= 1 && spec->sample_max_tokens <= 4096,
               "sample.max_tokens %d", spec->sample_max_tokens);

    duet_strbuf_t out;
    duet_strbuf_init(&out);
    const duet_sbatch_opts_t so = {.nodes = 2, .gpus_per_node = 1, .time = "01:00:00"};
    st = duet_sbatch_write(spec, &so, &out);
    FUZZ_CHECK(st == DUET_OK && out.len > 0, "sbatch: %s", duet_error_last());
    duet_strbuf_free(&out);
    duet_cluster_destroy(spec);
    return 0;
}
