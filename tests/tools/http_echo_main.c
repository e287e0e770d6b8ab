/*
 * duet-http-echo: the HTTP server with the echo application (http_echo.h), for tests and wrk
 * benchmarks. Prints "port <n>" on stdout once listening; SIGINT/SIGTERM shut it down gracefully.
 *
 *   duet-http-echo [--host 127.0.0.1] [--port 0] [--max-connections N] [--idle-ms N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/log.h"
#include "common/version.h"
#include "router/http/http.h"
#include "tests/tools/http_echo.h"

static uv_signal_t sig_int, sig_term;
static duet_http_server_t *server;

static void on_server_closed(void *user)
{
    uv_close((uv_handle_t *)&sig_int, NULL);
    uv_close((uv_handle_t *)&sig_term, NULL);
}

static void on_signal(uv_signal_t *s, int signum)
{
    if (server == NULL)
        return;
    duet_http_server_t *srv = server;
    server = NULL;
    duet_http_server_close(srv, on_server_closed, NULL);
}

int main(int argc, char **argv)
{
    duet_http_options_t opts;
    duet_http_options_default(&opts);
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf("usage: duet-http-echo [--host H] [--port P] [--max-connections N] "
                   "[--idle-ms N] [--version]\n"
                   "The router's HTTP server with an echo application, for tests and load\n"
                   "generators: answers every request with its method, target, headers and body.\n"
                   "Prints \"port <n>\" once listening (--port 0, the default, picks a free one);\n"
                   "SIGINT or SIGTERM shuts it down gracefully. Defaults: host 127.0.0.1, the\n"
                   "server's connection limit and idle timeout.\n");
            return 0;
        }
        if (duet_version_flag(a)) {
            duet_version_print("duet-http-echo");
            return 0;
        }
        if (v == NULL) {
            fprintf(stderr, "duet-http-echo: %s needs a value (see --help)\n", a);
            return 2;
        }
        int64_t n = 0;
        if (strcmp(a, "--host") == 0)
            opts.host = v;
        else if (strcmp(a, "--port") == 0 && duet_config_parse_int(v, 0, 65535, &n) == DUET_OK)
            opts.port = (uint16_t)n;
        else if (strcmp(a, "--max-connections") == 0 &&
                 duet_config_parse_int(v, 1, 1000000, &n) == DUET_OK)
            opts.max_connections = (size_t)n;
        else if (strcmp(a, "--idle-ms") == 0 &&
                 duet_config_parse_int(v, 1, 86400000, &n) == DUET_OK)
            opts.idle_timeout_ms = (uint32_t)n;
        else if (strcmp(a, "--port") == 0 || strcmp(a, "--max-connections") == 0 ||
                 strcmp(a, "--idle-ms") == 0) {
            fprintf(stderr, "duet-http-echo: bad value '%s' for %s\n", v, a);
            return 2;
        } else {
            fprintf(stderr, "duet-http-echo: unknown option %s (see --help)\n", a);
            return 2;
        }
    }
    uv_loop_t *loop = uv_default_loop();
    duet_http_echo_t app;
    duet_http_echo_init(&app, loop);
    opts.on_request = duet_http_echo_on_request;
    opts.on_abort = duet_http_echo_on_abort;
    opts.user = &app;
    opts.shutdown_grace_ms = 2000;
    if (duet_http_server_start(loop, &opts, &server) != DUET_OK) {
        uv_run(loop, UV_RUN_DEFAULT);
        uv_loop_close(loop);
        return 1;
    }
    uv_signal_init(loop, &sig_int);
    uv_signal_init(loop, &sig_term);
    uv_signal_start(&sig_int, on_signal, SIGINT);
    uv_signal_start(&sig_term, on_signal, SIGTERM);
    printf("port %u\n", duet_http_server_port(server));
    fflush(stdout);
    uv_run(loop, UV_RUN_DEFAULT);
    int rc = uv_loop_close(loop) == 0 ? 0 : 1;
    return rc;
}
