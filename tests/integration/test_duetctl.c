/*
 * duetctl as a real process against an admin API started by the test (with the FAKE ops table of
 * tests/unit/router_admin_fake.h and a real admission controller): every command's output and
 * exit status, --json on each, log-level, --help, usage errors (1), connection refused and
 * protocol errors (2), and the server's refusals (3: wrong token, unknown worker, dead worker,
 * drain wait timeout) with the server's message printed.
 */
#include "tests/unit/router_admin_fake.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/unit/test_run.h"

#define DUETCTL DUET_BINARY_DIR "/router/duetctl"

static char OUT[65536];

/* Run duetctl with args (shell words), stdout+stderr into OUT; returns the exit status. */
static int ctl(const char *args)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "env -u DUET_ADMIN_TOKEN DUET_ADMIN_FILE=/nonexistent %s --admin "
             "http://127.0.0.1:%u %s 2>&1",
             DUETCTL, AH.port, args);
    return test_run(cmd, OUT, sizeof(OUT));
}

#define TOK "--token " TEST_TOKEN " "

#define expect_out(frag)                                                                           \
    cr_expect(strstr(OUT, (frag)) != NULL, "output lacks \"%s\":\n%s", (frag), OUT)

Test(duetctl, help_and_usage_errors, .timeout = 60)
{
    ah_start();
    cr_expect_eq(ctl("--help"), 0);
    expect_out("usage: duetctl");
    expect_out("exit status");
    cr_expect_eq(ctl("drain --help"), 0);
    expect_out("--wait");
    cr_expect_eq(ctl("admission --help"), 0);
    expect_out("--max-inflight");
    cr_expect_eq(ctl("status --help"), 0);
    expect_out("usage: duetctl status");
    cr_expect_eq(ctl("undrain --help"), 0);
    cr_expect_eq(ctl(""), 1);
    expect_out("usage: duetctl");
    cr_expect_eq(ctl("frobnicate"), 1);
    expect_out("unknown command \"frobnicate\"");
    cr_expect_eq(ctl("drain"), 1);
    expect_out("which worker");
    cr_expect_eq(ctl("drain gen-0 --timeout 5"), 1);
    expect_out("--timeout only applies with --wait");
    cr_expect_eq(ctl("drain gen-0 --wait --timeout abc"), 1);
    cr_expect_eq(ctl("drain gen-0 --bogus"), 1);
    cr_expect_eq(ctl("admission"), 1);
    cr_expect_eq(ctl("admission set"), 1);
    expect_out("--max-inflight");
    cr_expect_eq(ctl("admission set --max-inflight 0"), 1);
    cr_expect_eq(ctl("admission set --max-queue -1"), 1);
    cr_expect_eq(ctl("admission set --max-queue 2.5"), 1);
    cr_expect_eq(ctl("admission explode"), 1);
    cr_expect_eq(ctl("--admin ftp://x status"), 1);
    expect_out("only http://");
    cr_expect_eq(ctl("--admin http://127.0.0.1:99999 status"), 1);
    cr_expect_eq(atomic_load(&AH.fake.drains), 0, "usage errors send nothing");
    ah_stop();
}

Test(duetctl, status_prints_workers_and_admission, .timeout = 60)
{
    ah_start();
    cr_expect_eq(ctl(TOK "status"), 0, "%s", OUT);
    expect_out("WORKER");
    expect_out("ADDRESS");
    expect_out("CACHE_USED");
    cr_expect(strstr(OUT, "gen-0   gen   live") != NULL, "%s", OUT);
    /* gen-0: its address, device, dtype, uptime 3725 s, heartbeat 300 ms ago, busy half the
     * time, 1024 of 4096 pages free */
    cr_expect(strstr(OUT, "127.0.0.1:40001        cpu     f32       1h02m    0.3s    50%  "
                          "3072/4096 75%") != NULL,
              "%s", OUT);
    expect_out("2048/4096 50%"); /* gen-1 */
    cr_expect(strstr(OUT, "ctx-0   ctx   dead") != NULL, "%s", OUT);
    expect_out("admission: accepting, in flight 0/8, queued 0/16");
    /* DUET_ADMIN_TOKEN works like --token. */
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "DUET_ADMIN_TOKEN=%s %s --admin http://127.0.0.1:%u status 2>&1",
             TEST_TOKEN, DUETCTL, AH.port);
    FILE *p = popen(cmd, "r");
    size_t n = fread(OUT, 1, sizeof(OUT) - 1, p);
    OUT[n] = '\0';
    cr_expect_eq(WEXITSTATUS(pclose(p)), 0, "%s", OUT);
    expect_out("gen-1");
    ah_stop();
}

/* --json on every command: the admin API's answer, parsed back here. */
static json_t *ctl_json(const char *args)
{
    cr_expect_eq(ctl(args), 0, "%s", OUT);
    json_error_t e;
    json_t *j = json_loads(OUT, 0, &e);
    cr_assert_not_null(j, "duetctl %s: not JSON (%s): %s", args, e.text, OUT);
    return j;
}

Test(duetctl, json_on_every_command, .timeout = 60)
{
    ah_start();
    json_t *j = ctl_json(TOK "--json status");
    json_t *w0 = json_array_get(json_object_get(j, "workers"), 0);
    cr_expect_str_eq(json_string_value(json_object_get(w0, "name")), "gen-0");
    cr_expect_str_eq(json_string_value(json_object_get(w0, "device")), "cpu");
    cr_expect_str_eq(json_string_value(json_object_get(w0, "address")), "127.0.0.1:40001");
    cr_expect_eq(json_integer_value(json_object_get(w0, "uptime_s")), 3725);
    cr_expect_eq(json_integer_value(json_object_get(w0, "metrics_port")), 9100);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(w0, "load"), "free_pages")),
                 1024);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(j, "admission"), "max_queue")),
                 16);
    json_decref(j);
    j = ctl_json(TOK "drain gen-0 --json");
    cr_expect_str_eq(json_string_value(json_object_get(j, "state")), "draining");
    json_decref(j);
    j = ctl_json(TOK "undrain gen-0 --json");
    cr_expect_str_eq(json_string_value(json_object_get(j, "state")), "live");
    json_decref(j);
    j = ctl_json(TOK "--json admission set --max-queue 4");
    cr_expect_eq(json_integer_value(json_object_get(j, "max_queue")), 4);
    json_decref(j);
    j = ctl_json(TOK "--json log-level");
    cr_expect_str_eq(json_string_value(json_object_get(j, "level")), "warn");
    json_decref(j);
    ah_stop();
}

Test(duetctl, log_level_shows_and_sets_at_run_time, .timeout = 60)
{
    ah_start(); /* the admin API runs in this process, at warn */
    cr_expect_eq(ctl(TOK "log-level"), 0, "%s", OUT);
    expect_out("log level: warn");
    cr_expect_eq(ctl(TOK "log-level debug"), 0, "%s", OUT);
    expect_out("log level: debug (was warn; 2 workers told)");
    cr_expect_eq(duet_log_level(), DUET_LOG_LEVEL_DEBUG, "the process's level changed");
    cr_expect_eq(atomic_load(&AH.fake.log_levels), 1, "the workers were told once");
    cr_expect_eq(ctl(TOK "log-level"), 0, "%s", OUT);
    expect_out("log level: debug");
    cr_expect_eq(ctl(TOK "log-level loud"), 1);
    expect_out("not one of error, warn, info, debug, trace");
    cr_expect_eq(ctl(TOK "log-level info warn"), 1);
    cr_expect_eq(ctl(TOK "log-level --help"), 0);
    expect_out("usage: duetctl log-level");
    cr_expect_eq(atomic_load(&AH.fake.log_levels), 1, "usage errors send nothing");
    duet_log_set_level(DUET_LOG_LEVEL_WARN);
    ah_stop();
}

/* The admin file duet up writes: plain `duetctl status` uses its URL and token; a malformed one
 * is named and ignored; another --admin does not get its token. */
Test(duetctl, admin_file_gives_url_and_token, .timeout = 60)
{
    ah_start();
    char path[] = "/tmp/duetctl-admin-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    char url[64];
    snprintf(url, sizeof(url), "http://127.0.0.1:%u", AH.port);
    cr_assert_eq(duet_admin_file_write(path, url, TEST_TOKEN), DUET_OK, "%s", duet_error_last());
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "env -u DUET_ADMIN_TOKEN DUET_ADMIN_FILE=%s %s status 2>&1", path,
             DUETCTL);
    cr_expect_eq(test_run(cmd, OUT, sizeof(OUT)), 0, "%s", OUT);
    expect_out("gen-1");
    snprintf(cmd, sizeof(cmd),
             "env -u DUET_ADMIN_TOKEN DUET_ADMIN_FILE=%s %s --admin http://127.0.0.1:%u/ status "
             "2>&1",
             path, DUETCTL, AH.port);
    cr_expect_eq(test_run(cmd, OUT, sizeof(OUT)), 3, "another URL: no token from the file");
    FILE *f = fopen(path, "w");
    fputs("url=http://127.0.0.1:1\nbogus\n", f);
    fclose(f);
    snprintf(cmd, sizeof(cmd),
             "env -u DUET_ADMIN_TOKEN DUET_ADMIN_FILE=%s %s --admin %s status 2>&1", path, DUETCTL,
             url);
    cr_expect_eq(test_run(cmd, OUT, sizeof(OUT)), 3, "%s", OUT);
    expect_out("ignoring");
    expect_out(":2: expected url=... or token=...");
    unlink(path);
    ah_stop();
}

Test(duetctl, wrong_or_missing_token_is_refused, .timeout = 60)
{
    ah_start();
    cr_expect_eq(ctl("--token wrong status"), 3);
    expect_out("server refused (HTTP 401): invalid admin token");
    cr_expect_eq(ctl("status"), 3);
    expect_out("HTTP 401");
    expect_out("missing Authorization");
    expect_out("--token or DUET_ADMIN_TOKEN");
    ah_stop();
}

Test(duetctl, drain_undrain_and_refusals, .timeout = 60)
{
    ah_start();
    cr_expect_eq(ctl(TOK "drain gen-0"), 0, "%s", OUT);
    expect_out("worker gen-0: draining (requests still running)");
    cr_expect_eq(ctl(TOK "status"), 0);
    cr_expect(strstr(OUT, "gen-0   gen   draining") != NULL, "%s", OUT);
    cr_expect_eq(ctl(TOK "undrain gen-0"), 0, "%s", OUT);
    expect_out("worker gen-0: live");
    cr_expect_eq(ctl(TOK "drain gen-1 --wait"), 0, "%s", OUT);
    expect_out("worker gen-1: drained");
    cr_expect_eq(ctl(TOK "drain nope"), 3);
    expect_out("server refused (HTTP 404): unknown worker \"nope\"");
    cr_expect_eq(ctl(TOK "undrain nope"), 3);
    expect_out("HTTP 404");
    cr_expect_eq(ctl(TOK "drain ctx-0"), 3);
    expect_out("server refused (HTTP 409)");
    expect_out("dead");
    cr_expect_eq(atomic_load(&AH.fake.migrates), 0);
    cr_expect_eq(ctl(TOK "drain gen-0 --migrate"), 0, "%s", OUT);
    expect_out("worker gen-0: draining, moving its requests (requests still running)");
    cr_expect_eq(ctl(TOK "drain gen-1 --migrate --wait"), 0, "%s", OUT);
    expect_out("worker gen-1: drained");
    cr_expect_eq(atomic_load(&AH.fake.migrates), 2, "--migrate reached the router twice");
    ah_stop();
}

Test(duetctl, drain_wait_completes_and_times_out, .timeout = 60)
{
    ah_start();
    /* Completes when the fake reports gen-0 idle half a second in. */
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "%s --admin http://127.0.0.1:%u --token %s drain gen-0 --wait 2>&1",
             DUETCTL, AH.port, TEST_TOKEN);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    for (int i = 0; i < 300 && atomic_load(&AH.fake.drains) == 0; i++)
        usleep(10000);
    usleep(300000);
    ah_make_idle("gen-0");
    size_t n = fread(OUT, 1, sizeof(OUT) - 1, p);
    OUT[n] = '\0';
    cr_expect_eq(WEXITSTATUS(pclose(p)), 0, "%s", OUT);
    expect_out("worker gen-0: drained (no running requests");

    /* gen-0 is idle now; make a fresh busy worker time out. */
    cr_expect_eq(ctl(TOK "undrain gen-0"), 0);
    ah_stop();
    ah_start();
    cr_expect_eq(ctl(TOK "drain gen-0 --wait --timeout 0.5"), 3, "%s", OUT);
    expect_out("server refused (HTTP 504): worker gen-0 still has running requests after 0.5 s");
    ah_stop();
}

Test(duetctl, admission_pause_resume_set, .timeout = 60)
{
    ah_start();
    cr_expect_eq(ctl(TOK "admission pause"), 0, "%s", OUT);
    expect_out("admission: PAUSED");
    cr_expect_eq(ctl(TOK "admission resume"), 0, "%s", OUT);
    expect_out("admission: accepting");
    cr_expect_eq(ctl(TOK "admission set --max-inflight 3 --max-queue=5"), 0, "%s", OUT);
    expect_out("in flight 0/3, queued 0/5");
    cr_expect_eq(ctl(TOK "admission set --max-queue 9"), 0, "%s", OUT);
    expect_out("in flight 0/3, queued 0/9");
    cr_expect_eq(ctl(TOK "admission set --max-inflight 2000000"), 3, "%s", OUT);
    expect_out("HTTP 400");
    expect_out("max_inflight");
    ah_stop();
}

Test(duetctl, connection_refused_and_not_http, .timeout = 60)
{
    /* A port with nothing listening: bind one, note it, close it. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    socklen_t al = sizeof(a);
    getsockname(fd, (struct sockaddr *)&a, &al);
    unsigned port = ntohs(a.sin_port);
    close(fd);
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "%s --admin http://127.0.0.1:%u --token x status 2>&1", DUETCTL,
             port);
    FILE *p = popen(cmd, "r");
    size_t n = fread(OUT, 1, sizeof(OUT) - 1, p);
    OUT[n] = '\0';
    cr_expect_eq(WEXITSTATUS(pclose(p)), 2, "%s", OUT);
    expect_out("cannot connect to http://127.0.0.1:");
    expect_out("Connection refused");

    /* A server that answers garbage and closes. */
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    a.sin_port = 0;
    cr_assert_eq(bind(ls, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(listen(ls, 4), 0);
    al = sizeof(a);
    getsockname(ls, (struct sockaddr *)&a, &al);
    snprintf(cmd, sizeof(cmd), "%s --admin http://127.0.0.1:%u --token x status 2>&1", DUETCTL,
             ntohs(a.sin_port));
    p = popen(cmd, "r");
    int c = accept(ls, NULL, NULL);
    cr_assert_geq(c, 0);
    char buf[4096];
    ssize_t r = recv(c, buf, sizeof(buf), 0);
    cr_expect_gt(r, 0);
    const char *junk = "SSH-2.0-OpenSSH\r\n";
    send(c, junk, strlen(junk), MSG_NOSIGNAL);
    close(c);
    n = fread(OUT, 1, sizeof(OUT) - 1, p);
    OUT[n] = '\0';
    cr_expect_eq(WEXITSTATUS(pclose(p)), 2, "%s", OUT);
    expect_out("not an HTTP/1.x response");

    /* A chunked answer is decoded. */
    snprintf(cmd, sizeof(cmd), "%s --admin http://127.0.0.1:%u --token x admission pause 2>&1",
             DUETCTL, ntohs(a.sin_port));
    p = popen(cmd, "r");
    c = accept(ls, NULL, NULL);
    cr_assert_geq(c, 0);
    r = recv(c, buf, sizeof(buf), 0);
    const char *chunked = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                          "d\r\n{\"paused\":tru\r\n"
                          "16\r\ne,\"max_inflight\":7,\"ma\r\n"
                          "d\r\nx_queue\":11}\n\r\n0\r\n\r\n";
    send(c, chunked, strlen(chunked), MSG_NOSIGNAL);
    close(c);
    n = fread(OUT, 1, sizeof(OUT) - 1, p);
    OUT[n] = '\0';
    cr_expect_eq(WEXITSTATUS(pclose(p)), 0, "%s", OUT);
    expect_out("admission: PAUSED, in flight 0/7, queued 0/11");
    close(ls);
}
