/*
 * test_ports.h: loopback ports for the integration tests' processes (router HTTP, workers,
 * admin, metrics), one home for the rule below.
 */
#ifndef DUET_TESTS_TEST_PORTS_H
#define DUET_TESTS_TEST_PORTS_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/socket.h>
#include <unistd.h>

#include <criterion/criterion.h>

/* A port free now on 127.0.0.1, never one this process was given before: the kernel may hand a
 * closed socket's ephemeral port out again (a cluster once got its HTTP and admin ports equal,
 * and its router could not start). */
static inline int free_port(void)
{
    static int given[64];
    static size_t n_given;
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        cr_assert_geq(fd, 0);
        struct sockaddr_in a = {.sin_family = AF_INET};
        inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
        cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
        socklen_t l = sizeof(a);
        getsockname(fd, (struct sockaddr *)&a, &l);
        close(fd);
        const int port = ntohs(a.sin_port);
        bool seen = false;
        for (size_t i = 0; i < n_given && i < 64; i++)
            seen = seen || given[i] == port;
        if (!seen) {
            given[n_given++ % 64] = port;
            return port;
        }
    }
}

#endif
