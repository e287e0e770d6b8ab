/*
 * The cluster file of `duet up` (deploy/launcher/cluster.h): a full file and the defaults,
 * flattening of nested router/worker keys into --a.b=c flags (dotted keys, bare `true`), every
 * refusal with its name:line (unknown keys, wrong types, lists, nulls, counts, gen's Helix cp / tp,
 * ports, keys the launcher sets itself, duplicates, syntax, several documents, alias bombs), the
 * repository's own deploy/configs/local.yaml, and a few hundred random mutations of a valid file
 * that must each end in a valid parse or an error with a detail, never a crash.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "deploy/launcher/cluster.h"

static const duet_cluster_paths_t paths = {.root = "/repo", .binaries = "/repo/build-x"};

static duet_cluster_t *load_ok(const char *text)
{
    duet_cluster_t *spec = NULL;
    duet_status_t st = duet_cluster_load_string(text, strlen(text), "t.yaml", &paths, &spec);
    cr_assert_eq(st, DUET_OK, "parse failed: %s", duet_error_last());
    cr_assert_not_null(spec);
    return spec;
}

/* Expect status `want` and a detail containing `needle`. */
static void load_err(const char *text, duet_status_t want, const char *needle)
{
    duet_cluster_t *spec = (duet_cluster_t *)0x1;
    duet_status_t st = duet_cluster_load_string(text, strlen(text), "t.yaml", &paths, &spec);
    cr_assert_eq(st, want, "want %s, got %s (%s) for:\n%s", duet_status_name(want),
                 duet_status_name(st), duet_error_last(), text);
    cr_assert_eq(spec, (duet_cluster_t *)0x1, "out-param written on failure");
    cr_assert_not_null(strstr(duet_error_last(), needle), "detail \"%s\" lacks \"%s\"",
                       duet_error_last(), needle);
}

static void assert_args(const duet_cluster_role_t *r, const char *const *want, size_t n)
{
    cr_assert_eq(r->n_args, n, "want %zu args, got %zu", n, r->n_args);
    for (size_t i = 0; i < n; i++)
        cr_assert_str_eq(r->args[i], want[i]);
}

Test(launcher_cluster, full_file)
{
    duet_cluster_t *s = load_ok("model: models/duet-demo\n"
                                "binaries: /opt/duet/build\n"
                                "router:\n"
                                "  http: {host: 0.0.0.0, port: 9000}\n"
                                "  workers: {host: 127.0.0.1, port: 9100}\n"
                                "  placement: {local_prefill_tokens: 64, policy: round_robin}\n"
                                "  admin: {insecure_no_token: true}\n"
                                "  model: {fingerprint: test}\n"
                                "ctx:\n"
                                "  count: 2\n"
                                "  binary: tools/fake-ctx\n"
                                "  args: {threads: 1, role: ctx}\n"
                                "gen:\n"
                                "  count: 3\n"
                                "  args: {cache: {budget: 1GiB}, spec: {enabled: 'true'}}\n"
                                "startup_timeout_s: 30\n"
                                "stop_timeout_s: 5\n"
                                "sample: {prompt: \"hi 'there'\", max_tokens: 7}\n");
    cr_assert_str_eq(s->file, "t.yaml");
    cr_assert_str_eq(s->model, "/repo/models/duet-demo");
    cr_assert_str_eq(s->binaries, "/opt/duet/build");
    cr_assert_str_eq(s->router.binary, "/opt/duet/build/router/duet-router");
    cr_assert_str_eq(s->ctx.binary, "/repo/tools/fake-ctx");
    cr_assert_str_eq(s->gen.binary, "/opt/duet/build/gen_worker/duet-gen");
    cr_assert_eq(s->router.count, 1);
    cr_assert_eq(s->ctx.count, 2);
    cr_assert_eq(s->gen.count, 3);
    cr_assert_str_eq(s->http_host, "0.0.0.0");
    cr_assert_eq(s->http_port, 9000);
    cr_assert_str_eq(s->workers_host, "127.0.0.1");
    cr_assert_eq(s->workers_port, 9100);
    cr_assert_eq(s->startup_timeout_s, 30);
    cr_assert_eq(s->stop_timeout_s, 5);
    cr_assert_str_eq(s->sample_prompt, "hi 'there'");
    cr_assert_eq(s->sample_max_tokens, 7);
    const char *const router[] = {"--http.host=0.0.0.0",
                                  "--http.port=9000",
                                  "--workers.host=127.0.0.1",
                                  "--workers.port=9100",
                                  "--placement.local_prefill_tokens=64",
                                  "--placement.policy=round_robin",
                                  "--admin.insecure_no_token",
                                  "--model.fingerprint=test"};
    assert_args(&s->router, router, 8);
    const char *const ctx[] = {"--threads=1", "--role=ctx"};
    assert_args(&s->ctx, ctx, 2);
    /* a quoted 'true' is a value, not a bare flag */
    const char *const gen[] = {"--cache.budget=1GiB", "--spec.enabled=true"};
    assert_args(&s->gen, gen, 2);
    duet_cluster_destroy(s);
}

Test(launcher_cluster, defaults)
{
    duet_cluster_t *s = load_ok("model: /models/m\n");
    cr_assert_str_eq(s->model, "/models/m");
    cr_assert_str_eq(s->binaries, "/repo/build-x");
    cr_assert_str_eq(s->router.binary, "/repo/build-x/router/duet-router");
    cr_assert_str_eq(s->ctx.binary, "/repo/build-x/ctx_worker/duet-ctx");
    cr_assert_str_eq(s->gen.binary, "/repo/build-x/gen_worker/duet-gen");
    cr_assert_eq(s->ctx.count, 1);
    cr_assert_eq(s->gen.count, 1);
    cr_assert_eq(s->router.n_args, 0);
    cr_assert_eq(s->ctx.n_args, 0);
    cr_assert_not_null(s->ctx.args);
    cr_assert_str_eq(s->http_host, "127.0.0.1");
    cr_assert_eq(s->http_port, 8000);
    cr_assert_eq(s->workers_port, 8100);
    cr_assert_eq(s->startup_timeout_s, 120);
    cr_assert_eq(s->stop_timeout_s, 10);
    cr_assert_eq(s->sample_max_tokens, 40);
    cr_assert_gt(strlen(s->sample_prompt), 0);
    duet_cluster_destroy(s);

    /* no paths at all: relative stays relative, binaries default to build */
    duet_cluster_t *t = NULL;
    cr_assert_eq(duet_cluster_load_string("model: m\nctx: {count: 0}\n", 24, "x", NULL, &t),
                 DUET_OK, "%s", duet_error_last());
    cr_assert_str_eq(t->model, "m");
    cr_assert_str_eq(t->binaries, "build");
    cr_assert_eq(t->ctx.count, 0);
    duet_cluster_destroy(t);
    duet_cluster_destroy(NULL);
}

Test(launcher_cluster, nested_and_dotted_keys_flatten)
{
    duet_cluster_t *s = load_ok("model: m\n"
                                "router:\n"
                                "  a:\n"
                                "    b:\n"
                                "      c: 1\n"
                                "    d-e: x y\n"
                                "  placement.local_prefill_tokens: 32\n"
                                "gen:\n"
                                "  args:\n"
                                "    heartbeat-ms: 100\n"
                                "    quiet: true\n"
                                "    off: false\n"
                                "    empty: ''\n");
    const char *const router[] = {"--a.b.c=1", "--a.d-e=x y",
                                  "--placement.local_prefill_tokens=32"};
    assert_args(&s->router, router, 3);
    const char *const gen[] = {"--heartbeat-ms=100", "--quiet", "--off=false", "--empty="};
    assert_args(&s->gen, gen, 4);
    duet_cluster_destroy(s);
}

Test(launcher_cluster, lists_refused)
{
    load_err("model: m\nctx:\n  args:\n    devices: [0, 1]\n", DUET_ERR_FORMAT,
             "t.yaml:4: ctx.args.devices: lists are not supported");
    load_err("model: m\nrouter:\n  http:\n    host:\n      - a\n", DUET_ERR_FORMAT,
             "t.yaml:5: router.http.host: lists are not supported");
    load_err("model: [a, b]\n", DUET_ERR_FORMAT, "t.yaml:1: model: expected a string, got a list");
    load_err("- model: m\n", DUET_ERR_FORMAT, "t.yaml:1: the top level must be a mapping");
}

Test(launcher_cluster, unknown_keys_refused)
{
    load_err("model: m\n\nbogus: 1\n", DUET_ERR_NOT_FOUND, "t.yaml:3: unknown key \"bogus\"");
    load_err("model: m\nctx:\n  count: 1\n  threads: 2\n", DUET_ERR_NOT_FOUND,
             "t.yaml:4: ctx: unknown key \"threads\" (known: count, args, binary)");
    load_err("model: m\nsample: {temperature: 1}\n", DUET_ERR_NOT_FOUND,
             "t.yaml:2: sample: unknown key \"temperature\"");
    load_err("model: m\nrouter: {\"bad key\": 1}\n", DUET_ERR_FORMAT, "is not a plain name");
    load_err("model: m\nrouter: {-x: 1}\n", DUET_ERR_FORMAT, "is not a plain name");
    load_err("model: m\nrouter: {a..b: 1}\n", DUET_ERR_FORMAT, "is not a plain name");
    load_err("model: m\nrouter: {[a]: 1}\n", DUET_ERR_FORMAT, "a key must be a plain name");
}

Test(launcher_cluster, counts_and_numbers_out_of_range)
{
    load_err("model: m\nctx: {count: 65}\n", DUET_ERR_RANGE,
             "t.yaml:2: ctx.count: 65 is out of range (0..64)");
    load_err("model: m\nctx: {count: -1}\n", DUET_ERR_RANGE, "ctx.count: -1 is out of range");
    load_err("model: m\ngen: {count: 0}\n", DUET_ERR_RANGE,
             "t.yaml:2: gen.count: 0 is out of range (1..64)");
    load_err("model: m\ngen:\n  count: two\n", DUET_ERR_FORMAT,
             "t.yaml:3: gen.count: expected an integer, got \"two\"");
    load_err("model: m\ngen:\n  count: 1.5\n", DUET_ERR_FORMAT, "expected an integer");
    load_err("model: m\ngen:\n  count: 99999999999999999999\n", DUET_ERR_FORMAT,
             "expected an integer");
    load_err("model: m\ngen:\n  count: {a: 1}\n", DUET_ERR_FORMAT,
             "t.yaml:3: gen.count: expected an integer, got a mapping");
    load_err("model: m\nstartup_timeout_s: 0\n", DUET_ERR_RANGE, "startup_timeout_s: 0");
    load_err("model: m\nstop_timeout_s: 601\n", DUET_ERR_RANGE, "stop_timeout_s: 601");
    load_err("model: m\nsample: {max_tokens: 5000}\n", DUET_ERR_RANGE, "sample.max_tokens");
}

Test(launcher_cluster, ports)
{
    load_err("model: m\nrouter:\n  http: {port: 0}\n", DUET_ERR_RANGE,
             "t.yaml:3: router.http.port: 0 (an ephemeral port) is not supported");
    load_err("model: m\nrouter:\n  workers:\n    port: 70000\n", DUET_ERR_RANGE,
             "t.yaml:4: router.workers.port: 70000 is out of range (0..65535)");
    load_err("model: m\nrouter:\n  workers: {port: abc}\n", DUET_ERR_FORMAT,
             "router.workers.port: expected an integer");
    load_err("model: m\nrouter:\n  http: {port: 8100}\n", DUET_ERR_INVALID,
             "http.port and workers.port are both 8100");
    load_err("model: m\nrouter:\n  http: {host: true}\n", DUET_ERR_INVALID,
             "router.http.host: expected an address");
}

Test(launcher_cluster, model_required_and_reserved_keys)
{
    load_err("ctx: {count: 1}\n", DUET_ERR_INVALID, "t.yaml: model: missing");
    load_err("", DUET_ERR_INVALID, "model: missing");
    load_err("# only a comment\n", DUET_ERR_INVALID, "model: missing");
    load_err("model:\n", DUET_ERR_INVALID, "t.yaml:1: model: no value given");
    load_err("model: ~\n", DUET_ERR_INVALID, "no value given");
    load_err("model: m\nrouter:\n  model: {dir: /x}\n", DUET_ERR_INVALID,
             "t.yaml:3: router.model.dir: set by duet up from the top-level `model:`");
    load_err("model: m\nrouter: {model.dir: /x}\n", DUET_ERR_INVALID, "router.model.dir");
    load_err("model: m\nctx:\n  args: {name: x}\n", DUET_ERR_INVALID,
             "t.yaml:3: ctx.args.name: set by duet up");
    load_err("model: m\ngen:\n  args: {router: 'h:1'}\n", DUET_ERR_INVALID, "gen.args.router");
    load_err("model: m\ngen:\n  args: {model: {dir: d}}\n", DUET_ERR_INVALID, "gen.args.model");
}

Test(launcher_cluster, structure_errors)
{
    load_err("model: m\nrouter: 5\n", DUET_ERR_FORMAT,
             "t.yaml:2: router: expected a mapping, got a single value");
    load_err("model: m\nctx: [1]\n", DUET_ERR_FORMAT, "ctx: expected a mapping, got a list");
    load_err("model: {a: b}\n", DUET_ERR_FORMAT, "model: expected a string, got a mapping");
    load_err("model: m\nrouter: {a: {}}\n", DUET_ERR_FORMAT, "router.a: empty mapping");
    load_err("model: m\nrouter: {a: ~}\n", DUET_ERR_INVALID, "router.a: no value given");
    load_err("model: m\nmodel: n\n", DUET_ERR_FORMAT,
             "t.yaml:2: model: given twice (first at "
             "line 1)");
    load_err("model: m\nrouter:\n  http: {port: 1}\n  http.port: 2\n", DUET_ERR_FORMAT,
             "t.yaml:4: router.http.port: given twice (first at line 3)");
    load_err("model: m\nrouter: {a: \"x\\0y\"}\n", DUET_ERR_FORMAT, "NUL byte");
    load_err("model: m\n---\nmodel: n\n", DUET_ERR_FORMAT, "more than one YAML document");
    load_err("model: m\nrouter: {a: [\n", DUET_ERR_FORMAT, "YAML syntax error");
    load_err("model: m\n\tctx: 1\n", DUET_ERR_FORMAT, "YAML syntax error");
    char deep[2048] = "model: m\nrouter:\n";
    for (int i = 0; i < 20; i++) {
        char line[64];
        snprintf(line, sizeof(line), "%*sk%d:\n", 2 * (i + 1), "", i);
        strcat(deep, line);
    }
    strcat(deep, "                                           v: 1\n");
    load_err(deep, DUET_ERR_FORMAT, "nested deeper than");
}

Test(launcher_cluster, alias_bomb_bounded)
{
    /* 10 levels of 10 aliases each: 10^10 leaves if walked naively */
    char text[8192] = "model: m\n";
    strcat(text, "a0: &a0 {x: 1, y: 2, z: 3, w: 4, v: 5, u: 6, t: 7, s: 8, r: 9, q: 10}\n");
    size_t at = strlen(text);
    for (int i = 1; i < 10; i++)
        at += (size_t)snprintf(text + at, sizeof(text) - at,
                               "a%d: &a%d {b0: *a%d, b1: *a%d, b2: *a%d, b3: *a%d, b4: *a%d, b5: "
                               "*a%d, b6: *a%d, b7: *a%d, b8: *a%d, b9: *a%d}\n",
                               i, i, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1,
                               i - 1);
    /* at the top level they are unknown keys; under router they must hit a bound */
    load_err(text, DUET_ERR_NOT_FOUND, "unknown key \"a0\"");
    char bomb[8192] = "model: m\nrouter:\n";
    strcat(bomb, "  a0: &a0 {x: 1, y: 2, z: 3, w: 4, v: 5, u: 6, t: 7, s: 8, r: 9, q: 10}\n");
    at = strlen(bomb);
    for (int i = 1; i < 8; i++)
        at += (size_t)snprintf(bomb + at, sizeof(bomb) - at,
                               "  a%d: &a%d {b0: *a%d, b1: *a%d, b2: *a%d, b3: *a%d, b4: *a%d, "
                               "b5: *a%d, b6: *a%d, b7: *a%d, b8: *a%d, b9: *a%d}\n",
                               i, i, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1,
                               i - 1);
    load_err(bomb, DUET_ERR_FORMAT, "alias bomb");
}

Test(launcher_cluster, repository_local_yaml)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/deploy/configs/local.yaml", DUET_SOURCE_DIR);
    duet_cluster_paths_t p = {.root = DUET_SOURCE_DIR, .binaries = DUET_BINARY_DIR};
    duet_cluster_t *spec = NULL;
    cr_assert_eq(duet_cluster_load_file(path, &p, &spec), DUET_OK, "%s", duet_error_last());
    char model[1024];
    snprintf(model, sizeof(model), "%s/models/duet-demo", DUET_SOURCE_DIR);
    cr_assert_str_eq(spec->model, model);
    cr_assert_eq(spec->ctx.count, 1);
    cr_assert_eq(spec->gen.count, 1);
    cr_assert_eq(spec->http_port, 8000);
    cr_assert_eq(spec->workers_port, 8100);
    bool found = false;
    for (size_t i = 0; i < spec->router.n_args; i++)
        found = found || strcmp(spec->router.args[i], "--placement.local_prefill_tokens=32") == 0;
    cr_assert(found, "local.yaml sets placement.local_prefill_tokens 32");
    duet_cluster_destroy(spec);

    cr_assert_eq(duet_cluster_load_file("/nonexistent/cluster.yaml", &p, &spec), DUET_ERR_IO);
    cr_assert_not_null(strstr(duet_error_last(), "/nonexistent/cluster.yaml"));
}

/* gen's Helix shape: cp and tp default to 1 (and stay 1 elsewhere), each 1..64, product <= 64,
 * only under gen:, and helix.cp / helix.tp inside args (nested or dotted) are the launcher's */
Test(launcher_cluster, helix_group_shape)
{
    duet_cluster_t *s = load_ok("model: m\n");
    cr_assert_eq(s->gen.cp, 1);
    cr_assert_eq(s->gen.tp, 1);
    cr_assert_eq(s->ctx.cp * s->ctx.tp * s->router.cp * s->router.tp, 1);
    duet_cluster_destroy(s);

    s = load_ok("model: m\ngen: {count: 2, cp: 4, tp: 2, args: {threads: 2}}\n");
    cr_assert_eq(s->gen.count, 2);
    cr_assert_eq(s->gen.cp, 4);
    cr_assert_eq(s->gen.tp, 2);
    const char *const args[] = {"--threads=2"};
    assert_args(&s->gen, args, 1);
    duet_cluster_destroy(s);

    s = load_ok("model: m\ngen:\n  cp: 64\n");
    cr_assert_eq(s->gen.cp, 64);
    cr_assert_eq(s->gen.tp, 1);
    duet_cluster_destroy(s);
    s = load_ok("model: m\ngen:\n  tp: 8\n  cp: 8\n");
    cr_assert_eq(s->gen.cp * s->gen.tp, 64);
    duet_cluster_destroy(s);

    load_err("model: m\ngen:\n  cp: 0\n", DUET_ERR_RANGE,
             "t.yaml:3: gen.cp: 0 is out of range (1..64)");
    load_err("model: m\ngen:\n  count: 1\n  tp: 65\n", DUET_ERR_RANGE,
             "t.yaml:4: gen.tp: 65 is out of range (1..64)");
    load_err("model: m\ngen: {tp: -2}\n", DUET_ERR_RANGE, "gen.tp: -2 is out of range");
    load_err("model: m\ngen:\n  cp: two\n", DUET_ERR_FORMAT,
             "t.yaml:3: gen.cp: expected an integer, got \"two\"");
    load_err("model: m\ngen:\n  cp: {a: 1}\n", DUET_ERR_FORMAT, "gen.cp: expected an integer");
    load_err("model: m\ngen:\n  cp: 16\n  tp: 8\n", DUET_ERR_RANGE,
             "t.yaml:4: gen: cp 16 x tp 8 = 128 ranks per group is more than 64");
    load_err("model: m\ngen:\n  tp: 5\n  count: 3\n  cp: 13\n", DUET_ERR_RANGE,
             "t.yaml:5: gen: cp 13 x tp 5 = 65 ranks");
    load_err("model: m\nctx:\n  cp: 2\n", DUET_ERR_NOT_FOUND,
             "t.yaml:3: ctx: unknown key \"cp\" (known: count, args, binary)");
    load_err("model: m\ngen:\n  dp: 2\n", DUET_ERR_NOT_FOUND,
             "t.yaml:3: gen: unknown key \"dp\" (known: count, cp, tp, args, binary)");
    load_err("model: m\ngen:\n  args:\n    helix: {cp: 2}\n", DUET_ERR_INVALID,
             "t.yaml:4: gen.args.helix.cp: set by duet up (--router, --model, --name; "
             "--helix.cp / --helix.tp from gen.cp / gen.tp)");
    load_err("model: m\ngen:\n  args: {helix.tp: 2}\n", DUET_ERR_INVALID,
             "t.yaml:3: gen.args.helix.tp: set by duet up");
    load_err("model: m\ngen:\n  cp: 2\n  args: {threads: 1, helix: {tp: 1}}\n", DUET_ERR_INVALID,
             "gen.args.helix.tp");
    load_err("model: m\ngen:\n  args: {name: g}\n", DUET_ERR_INVALID,
             "t.yaml:3: gen.args.name: set by duet up");
}

/* local-cp2.yaml: local.yaml's cluster with one generation worker made a CP=2 Helix group */
Test(launcher_cluster, repository_local_cp2_yaml)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/deploy/configs/local-cp2.yaml", DUET_SOURCE_DIR);
    duet_cluster_paths_t p = {.root = DUET_SOURCE_DIR, .binaries = DUET_BINARY_DIR};
    duet_cluster_t *spec = NULL;
    cr_assert_eq(duet_cluster_load_file(path, &p, &spec), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(spec->ctx.count, 1);
    cr_assert_eq(spec->ctx.cp * spec->ctx.tp, 1);
    cr_assert_eq(spec->gen.count, 1);
    cr_assert_eq(spec->gen.cp, 2);
    cr_assert_eq(spec->gen.tp, 1);
    const char *const args[] = {"--threads=1"};
    assert_args(&spec->gen, args, 1);
    duet_cluster_destroy(spec);
}

/* deploy/slurm/cluster.yaml: wildcard binds for workers on other nodes, UCX over tcp */
Test(launcher_cluster, repository_slurm_cluster_yaml)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/deploy/slurm/cluster.yaml", DUET_SOURCE_DIR);
    duet_cluster_paths_t p = {.root = DUET_SOURCE_DIR, .binaries = DUET_BINARY_DIR};
    duet_cluster_t *spec = NULL;
    cr_assert_eq(duet_cluster_load_file(path, &p, &spec), DUET_OK, "%s", duet_error_last());
    cr_assert_str_eq(spec->http_host, "0.0.0.0");
    cr_assert_str_eq(spec->workers_host, "0.0.0.0");
    cr_assert_eq(spec->ctx.count, 2);
    cr_assert_eq(spec->gen.count, 2);
    const char *const args[] = {"--threads=4", "--ucx.tls=tcp"};
    assert_args(&spec->ctx, args, 2);
    assert_args(&spec->gen, args, 2);
    duet_cluster_destroy(spec);
}

/* local-spec.yaml: local.yaml's cluster, the gen worker speculating with the draft model, whose
 * root-relative folder reaches the worker joined to the root (workers run in the launcher's
 * working directory) */
Test(launcher_cluster, repository_local_spec_yaml)
{
    char path[1024], draft[1100];
    snprintf(path, sizeof(path), "%s/deploy/configs/local-spec.yaml", DUET_SOURCE_DIR);
    duet_cluster_paths_t p = {.root = DUET_SOURCE_DIR, .binaries = DUET_BINARY_DIR};
    duet_cluster_t *spec = NULL;
    cr_assert_eq(duet_cluster_load_file(path, &p, &spec), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(spec->ctx.count, 1);
    cr_assert_eq(spec->gen.count, 1);
    snprintf(draft, sizeof(draft), "--spec.draft_model=%s/models/duet-demo-draft", DUET_SOURCE_DIR);
    static const char *const want[] = {"--device=cpu", "--spec.method=draft", "--spec.k=4", NULL};
    for (int k = 0; want[k] != NULL; k++) {
        bool found = false;
        for (size_t i = 0; i < spec->gen.n_args; i++)
            found = found || strcmp(spec->gen.args[i], want[k]) == 0;
        cr_expect(found, "local-spec.yaml gives the gen worker %s", want[k]);
    }
    bool found = false;
    for (size_t i = 0; i < spec->gen.n_args; i++)
        found = found || strcmp(spec->gen.args[i], draft) == 0;
    cr_expect(found, "the draft model's folder is joined to the root: %s", draft);
    duet_cluster_destroy(spec);
}

/* Only spec.draft_model's value is a path: an absolute one stays, other keys' values are not
 * joined to the root */
Test(launcher_cluster, draft_model_path_joined_to_root)
{
    static const char text[] = "model: m\n"
                               "gen:\n"
                               "  args: {spec: {draft_model: /abs/draft, method: models/x}}\n";
    duet_cluster_paths_t p = {.root = "/root/dir", .binaries = "/bin/dir"};
    duet_cluster_t *spec = NULL;
    cr_assert_eq(duet_cluster_load_string(text, strlen(text), "t.yaml", &p, &spec), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(spec->gen.n_args, 2);
    cr_expect_str_eq(spec->gen.args[0], "--spec.draft_model=/abs/draft");
    cr_expect_str_eq(spec->gen.args[1], "--spec.method=models/x");
    duet_cluster_destroy(spec);
    static const char rel[] = "model: m\ngen: {args: {spec.draft_model: d/raft}}\n";
    cr_assert_eq(duet_cluster_load_string(rel, strlen(rel), "t.yaml", &p, &spec), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(spec->gen.n_args, 1);
    cr_expect_str_eq(spec->gen.args[0], "--spec.draft_model=/root/dir/d/raft");
    duet_cluster_destroy(spec);
}

/* xorshift: the same mutations on every run */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)rng_state;
}

Test(launcher_cluster, fuzz_mutations_never_crash)
{
    static const char valid[] = "model: models/duet-demo\n"
                                "router:\n"
                                "  http: {host: 127.0.0.1, port: 8000}\n"
                                "  workers: {host: 127.0.0.1, port: 8100}\n"
                                "  placement: {local_prefill_tokens: 32}\n"
                                "ctx:\n"
                                "  count: 2\n"
                                "  args: {threads: 1, role: ctx}\n"
                                "gen:\n"
                                "  count: 1\n"
                                "  args:\n"
                                "    threads: 1\n"
                                "startup_timeout_s: 120\n"
                                "sample: {prompt: \"a b\", max_tokens: 4}\n";
    static const char specials[] = ":-{}[],&*!|>'\"%@`#? \n\t0123456789.~\\";
    size_t n_ok = 0, n_err = 0;
    for (int iter = 0; iter < 600; iter++) {
        char buf[1024];
        size_t len = sizeof(valid) - 1;
        memcpy(buf, valid, len);
        int n_mut = 1 + (int)(rng() % 4);
        for (int m = 0; m < n_mut && len > 0; m++) {
            size_t at = rng() % len;
            switch (rng() % 5) {
            case 0: /* replace with a YAML-significant byte */
                buf[at] = specials[rng() % (sizeof(specials) - 1)];
                break;
            case 1: /* random byte, NUL included */
                buf[at] = (char)(rng() & 0xff);
                break;
            case 2: /* delete */
                memmove(buf + at, buf + at + 1, len - at - 1);
                len--;
                break;
            case 3: /* insert */
                if (len + 1 < sizeof(buf)) {
                    memmove(buf + at + 1, buf + at, len - at);
                    buf[at] = specials[rng() % (sizeof(specials) - 1)];
                    len++;
                }
                break;
            default: /* truncate */
                len = at;
                break;
            }
        }
        duet_cluster_t *spec = NULL;
        duet_error_clear();
        duet_status_t st = duet_cluster_load_string(buf, len, "fuzz.yaml", &paths, &spec);
        if (st == DUET_OK) {
            n_ok++;
            cr_assert_not_null(spec);
            cr_assert_not_null(spec->model);
            cr_assert(spec->ctx.count >= 0 && spec->ctx.count <= DUET_CLUSTER_MAX_WORKERS);
            cr_assert(spec->gen.count >= 1 && spec->gen.count <= DUET_CLUSTER_MAX_WORKERS);
            cr_assert(spec->http_port >= 1 && spec->http_port <= 65535);
            cr_assert(spec->workers_port >= 1 && spec->workers_port <= 65535);
            cr_assert_neq(spec->http_port, spec->workers_port);
            for (size_t i = 0; i < spec->router.n_args; i++)
                cr_assert_eq(strncmp(spec->router.args[i], "--", 2), 0);
            duet_cluster_destroy(spec);
        } else {
            n_err++;
            cr_assert_lt(st, 0);
            cr_assert_gt(strlen(duet_error_last()), 0, "error %s without a detail",
                         duet_status_name(st));
        }
    }
    cr_log_info("fuzz: %zu valid, %zu refused", n_ok, n_err);
    cr_assert_gt(n_ok, 0);
    cr_assert_gt(n_err, 0);
}
