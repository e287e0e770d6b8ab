/*
 * duet-bench-xfer: bandwidth and latency of the UCX transfer runtime (transfer/xfer.h) between
 * two processes, over shared memory and over tcp, on loopback or across network namespaces.
 *
 * For each transport the benchmark forks a receiver process (a pipe pair stands in for the
 * router: it carries the receiver's Reservations, whose worker address the sender connects to;
 * the sender's own address reaches the receiver over UCX in the transfer's hello), then, as the
 * sender, moves MLA KV pages laid out like Kimi-Linear-48B's (7 MLA layers, 1152 bytes per token
 * per layer, 128-token pages: ~1 MiB per page, one put per page and layer):
 *
 *   bandwidth: transfers of 1, 4, 16, 64, 256 MiB, all layers ready at once; time from
 *              duet_xfer_send_start to the sender's DONE (every put flushed, XferDone sent);
 *              best of a few runs, and the ratio to a plain memcpy of the same source pages into
 *              a warm buffer measured in the same run;
 *   latency:   many back-to-back one-page transfers (a full 1 MiB page and a small 9 KiB page:
 *              16 tokens x 1 layer x 576 B), p50 / p99 of the same start-to-DONE time.
 *
 * The receiver's pool comes from duet_xfer_ctx_alloc (a UCX-allocated shared segment); --malloc
 * registers a malloc'ed buffer instead, to show what UCX 1.13 does with those over shm.
 * --transport cuda (builds with CUDA, a CUDA-built UCX: tools/build_ucx_cuda.sh) puts between
 * device pools (cudaMalloc, UCX_TLS=sm,self,cuda_copy,cuda_ipc); its reference is cudaMemcpy of
 * the same pieces device to device.
 *
 * Across network namespaces (--transport tcp only): --netns SENDER_NS,RECEIVER_NS puts each
 * process in a namespace made by `ip netns add` (setns after the fork, before UCX starts: its
 * sockets and threads are then that namespace's), --net-devices SENDER_DEV,RECEIVER_DEV gives
 * each its own UCX_NET_DEVICES (a veth, say), so that the KV crosses a real interface instead of
 * loopback; an empty half stays. Each side reads its device's byte counters before UCX starts
 * and after the last transfer and prints them beside the KV bytes the transfers put, which shows
 * the bytes really went over that device. Namespaces and devices are checked before anything
 * forks: a missing one, a device that is down or a setns refused (not root) is a clear error,
 * exit 2.
 *
 * Usage: duet-bench-xfer [--quick] [--malloc] [--transport shm|tcp|both|cuda]
 *        [--netns SENDER_NS,RECEIVER_NS] [--net-devices SENDER_DEV,RECEIVER_DEV].
 * UCX_NET_DEVICES defaults to lo.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/version.h"
#include "transfer/xfer.h"

#ifdef DUET_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define MIB (1024.0 * 1024.0)

typedef struct {
    uint32_t page_tokens, layers, token_bytes;
} lay_t;

static const lay_t LAY_BIG = {128, 7, 1152}; /* ~1 MiB pages (Kimi-Linear-48B MLA) */
static const lay_t LAY_SMALL = {16, 1, 576}; /* a 9 KiB page */
#define POOL_BYTES ((size_t)270 << 20)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static duet_xfer_layout_t layout_of(lay_t l)
{
    duet_xfer_layout_t x = {.page_tokens = l.page_tokens,
                            .n_mla_layers = l.layers,
                            .token_bytes = l.token_bytes,
                            .state_elem = 4};
    return x;
}

/* --- the router pipe ---------------------------------------------------------------------- */

static int write_all(int fd, const void *b, size_t n)
{
    const uint8_t *p = b;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int frame_write(int fd, const void *b, uint32_t n)
{
    uint8_t h[4] = {(uint8_t)(n >> 24), (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n};
    return write_all(fd, h, 4) == 0 && write_all(fd, b, n) == 0 ? 0 : -1;
}

/* Read exactly n bytes, progressing ctx while waiting (a tcp target must keep progressing). */
static int read_all(int fd, void *b, size_t n, duet_xfer_ctx_t *ctx)
{
    uint8_t *p = b;
    double end = now_s() + 60;
    while (n > 0) {
        if (ctx != NULL)
            duet_xfer_ctx_progress(ctx);
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int k = poll(&pfd, 1, ctx != NULL ? 0 : 1000);
        if (now_s() > end)
            return -1;
        if (k <= 0)
            continue;
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static uint8_t *frame_read(int fd, uint32_t *n_p, duet_xfer_ctx_t *ctx)
{
    uint8_t h[4];
    if (read_all(fd, h, 4, ctx) < 0)
        return NULL;
    uint32_t n = ((uint32_t)h[0] << 24) | ((uint32_t)h[1] << 16) | ((uint32_t)h[2] << 8) | h[3];
    uint8_t *b = malloc(n + 1);
    if (b == NULL || read_all(fd, b, n, ctx) < 0) {
        free(b);
        return NULL;
    }
    b[n] = 0;
    *n_p = n;
    return b;
}

/* --- where each side runs (--netns, --net-devices) ---------------------------------------- */

/* One side of the benchmark: 0 the sender (this process), 1 the forked receiver. */
typedef struct {
    const char *ns;  /* a name under /var/run/netns, or NULL: this process's namespace */
    int ns_fd;       /* open on it (-1 without one), entered after the fork */
    const char *dev; /* its UCX_NET_DEVICES (main fills a NULL from the environment or lo) */
} side_t;

static side_t g_side[2] = {{NULL, -1, NULL}, {NULL, -1, NULL}};
static const char *const SIDE_NAME[2] = {"sender", "receiver"};

/*
 * Split "A,B" (exactly one comma; either half may be empty) into out[0] / out[1], NULL for an
 * empty half. Each half must pass name_ok. v is modified in place (argv). Returns false on a
 * malformed value.
 */
static bool split_pair(char *v, bool (*name_ok)(const char *), const char *out[2])
{
    char *comma = strchr(v, ',');
    if (comma == NULL || strchr(comma + 1, ',') != NULL)
        return false;
    *comma = '\0';
    const char *half[2] = {v, comma + 1};
    for (int i = 0; i < 2; i++) {
        if (*half[i] != '\0' && !name_ok(half[i]))
            return false;
        out[i] = *half[i] != '\0' ? half[i] : NULL;
    }
    return true;
}

/* A name `ip netns add` accepts: a file name under /var/run/netns. */
static bool netns_name_ok(const char *s)
{
    return strlen(s) < 200 && strchr(s, '/') == NULL && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

/* A name the kernel accepts for a network device (IFNAMSIZ, no '/', no blank). */
static bool dev_name_ok(const char *s)
{
    if (strlen(s) >= IFNAMSIZ)
        return false;
    for (; *s != '\0'; s++)
        if (*s == '/' || *s == ':' || isspace((unsigned char)*s))
            return false;
    return true;
}

/* One counter of dev's under /sys/class/net/<dev>/statistics (side_enter mounted this side's). */
static bool dev_stat(const char *dev, const char *what, uint64_t *v)
{
    char path[128];
    snprintf(path, sizeof(path), "/sys/class/net/%s/statistics/%s", dev, what);
    FILE *f = fopen(path, "r");
    unsigned long long x = 0;
    const bool ok = f != NULL && fscanf(f, "%llu", &x) == 1;
    if (f != NULL)
        fclose(f);
    *v = x;
    return ok;
}

/* dev's received and sent byte counters; false when dev is not in this process's sysfs. */
static bool dev_bytes(const char *dev, uint64_t *rx, uint64_t *tx)
{
    return dev_stat(dev, "rx_bytes", rx) && dev_stat(dev, "tx_bytes", tx);
}

/* The network device this process's UCX will use, when UCX_NET_DEVICES names exactly one. */
static const char *ucx_dev(void)
{
    const char *d = getenv("UCX_NET_DEVICES");
    return d != NULL && dev_name_ok(d) ? d : NULL;
}

/*
 * In side i's process, before any UCX call: enter its network namespace, and set its
 * UCX_NET_DEVICES. Entering also takes a mount namespace of its own with a fresh /sys, as `ip
 * netns exec` does: UCX finds its tcp devices (and this file their counters) under
 * /sys/class/net, and a sysfs shows the network namespace of whoever mounted it, not of the
 * reader. side_check entered each namespace once already, so a failure here is unexpected; the
 * message names the side. Returns 0, or 2 (the exit status) after printing why.
 */
static int side_enter(int i)
{
    const side_t *sd = &g_side[i];
    if (sd->ns_fd >= 0) {
        const char *step = "setns";
        if (setns(sd->ns_fd, CLONE_NEWNET) != 0 ||
            (step = "unshare(CLONE_NEWNS)", unshare(CLONE_NEWNS) != 0) ||
            (step = "mount --make-rslave /",
             mount(NULL, "/", NULL, MS_SLAVE | MS_REC, NULL) != 0) ||
            (step = "umount /sys", umount2("/sys", MNT_DETACH) != 0 && errno != EINVAL) ||
            (step = "mount sysfs /sys", mount(sd->ns, "/sys", "sysfs", 0, NULL) != 0)) {
            fprintf(stderr, "duet-bench-xfer: %s: entering network namespace '%s': %s: %s\n",
                    SIDE_NAME[i], sd->ns, step, strerror(errno));
            return 2;
        }
    }
    setenv("UCX_NET_DEVICES", sd->dev, 1);
    return 0;
}

/*
 * Whether dev, in the calling process's network namespace, is one UCX's tcp can use: present,
 * up with a carrier, and with an IPv4 or a global IPv6 address (UCX 1.13 skips a device with
 * only the link-local one every veth gets). Prints why not. (Through ioctl and getifaddrs,
 * which follow the network namespace; sysfs would not, see side_enter.)
 */
static bool dev_check(int i, const char *dev)
{
    char where[300]; /* "network namespace 'x'" or "this process's network namespace" */
    if (g_side[i].ns != NULL)
        snprintf(where, sizeof(where), "network namespace '%s'", g_side[i].ns);
    else
        snprintf(where, sizeof(where), "this process's network namespace");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof(ifr));
    snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", dev);
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    int rc = s >= 0 ? ioctl(s, SIOCGIFFLAGS, &ifr) : -1;
    int err = errno;
    if (s >= 0)
        close(s);
    if (rc != 0) {
        fprintf(stderr,
                "duet-bench-xfer: %s: no network device '%s' in %s (%s; `ip%s%s "
                "link` lists them)\n",
                SIDE_NAME[i], dev, where, strerror(err), g_side[i].ns != NULL ? " -n " : "",
                g_side[i].ns != NULL ? g_side[i].ns : "");
        return false;
    }
    if (!(ifr.ifr_flags & IFF_UP) || !(ifr.ifr_flags & IFF_RUNNING)) {
        fprintf(stderr, "duet-bench-xfer: %s: network device '%s' in %s is %s\n", SIDE_NAME[i], dev,
                where, !(ifr.ifr_flags & IFF_UP) ? "down" : "without a carrier");
        return false;
    }
    struct ifaddrs *all;
    bool addr = false;
    if (getifaddrs(&all) == 0) {
        for (struct ifaddrs *a = all; a != NULL && !addr; a = a->ifa_next) {
            if (a->ifa_addr == NULL || strcmp(a->ifa_name, dev) != 0)
                continue;
            const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)a->ifa_addr;
            addr = a->ifa_addr->sa_family == AF_INET ||
                   (a->ifa_addr->sa_family == AF_INET6 && !IN6_IS_ADDR_LINKLOCAL(&v6->sin6_addr));
        }
        freeifaddrs(all);
    }
    if (!addr)
        fprintf(stderr,
                "duet-bench-xfer: %s: network device '%s' in %s has no IP "
                "address (UCX's tcp needs one; an IPv6 link-local one is not enough)\n",
                SIDE_NAME[i], dev, where);
    return addr;
}

/*
 * Before anything forks: open each side's namespace, enter it, check its device, come back. So a
 * missing namespace, a setns refused (not root) or a missing or down device is reported here,
 * plainly, instead of as a UCX connection that never comes. Returns 0, or 2 (the exit status)
 * after printing why. Leaves this process in the namespace it started in.
 */
static int side_check(void)
{
    int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    if (home < 0) {
        fprintf(stderr, "duet-bench-xfer: /proc/self/ns/net: %s\n", strerror(errno));
        return 2;
    }
    int rc = 0;
    for (int i = 0; i < 2 && rc == 0; i++) {
        side_t *sd = &g_side[i];
        if (sd->ns != NULL) {
            char path[256];
            snprintf(path, sizeof(path), "/var/run/netns/%s", sd->ns);
            sd->ns_fd = open(path, O_RDONLY | O_CLOEXEC);
            if (sd->ns_fd < 0) {
                fprintf(stderr,
                        "duet-bench-xfer: %s: no network namespace '%s' (%s: %s; `ip netns add %s` "
                        "makes one)\n",
                        SIDE_NAME[i], sd->ns, path, strerror(errno), sd->ns);
                rc = 2;
                break;
            }
            if (setns(sd->ns_fd, CLONE_NEWNET) != 0) {
                const bool perm = errno == EPERM;
                fprintf(stderr, "duet-bench-xfer: %s: setns into network namespace '%s': %s%s\n",
                        SIDE_NAME[i], sd->ns, strerror(errno),
                        perm ? " (entering a network namespace needs root: CAP_SYS_ADMIN)" : "");
                rc = 2;
                break;
            }
        }
        if (dev_name_ok(sd->dev) && !dev_check(i, sd->dev)) /* not a list from the environment */
            rc = 2;
        if (sd->ns != NULL && setns(home, CLONE_NEWNET) != 0) {
            fprintf(stderr, "duet-bench-xfer: back to the first network namespace: %s\n",
                    strerror(errno));
            rc = 2;
        }
    }
    close(home);
    return rc;
}

/* --- receiver process --------------------------------------------------------------------- */

static unsigned g_ended;
static void count_cb(const duet_xfer_outcome_t *o, void *user)
{
    if (o->kind != DUET_XFER_OUTCOME_DONE)
        fprintf(stderr, "bench: transfer aborted: %s: %s\n", duet_xfer_reason_str(o->reason),
                o->message);
    g_ended++;
}

static bool g_alloc = true; /* receiver pools from duet_xfer_ctx_alloc (--malloc: register) */
static bool g_device;       /* --transport cuda: both pools in device memory */

/* POOL_BYTES of device memory filled with `fill` (exits when this build or machine has none). */
static uint8_t *device_buffer(int fill)
{
#ifdef DUET_HAVE_CUDA
    void *p = NULL;
    if (cudaMalloc(&p, POOL_BYTES) != cudaSuccess ||
        cudaMemset(p, fill, POOL_BYTES) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
        fprintf(stderr, "bench: no CUDA device memory: %s\n",
                cudaGetErrorString(cudaGetLastError()));
        exit(2);
    }
    return p;
#else
    (void)fill;
    fprintf(stderr, "bench: --transport cuda needs a build with CUDA\n");
    exit(2);
#endif
}

/* A device pool, registered with ctx (exits when UCX cannot move device memory). */
static uint8_t *device_pool(duet_xfer_ctx_t *ctx, int fill)
{
    uint8_t *p = device_buffer(fill);
    if (duet_xfer_ctx_register(ctx, DUET_XFER_POOL_KV, p, POOL_BYTES, DUET_XFER_MEM_CUDA) < 0) {
        fprintf(stderr, "bench: %s\n", duet_error_last());
        exit(2);
    }
    return p;
}

static void pool_free(uint8_t *p)
{
#ifdef DUET_HAVE_CUDA
    if (g_device) {
        cudaFree(p);
        return;
    }
#endif
    free(p);
}

static duet_xfer_ctx_t *ctx_with_pool(uint8_t **pool_p, uint32_t max_x, bool receiver)
{
    duet_xfer_ctx_opts_t o;
    duet_xfer_ctx_opts_default(&o);
    o.max_transfers = max_x;
    o.max_pages = 4096;
    duet_xfer_ctx_t *ctx;
    if (duet_xfer_ctx_create(&o, &ctx) < 0) {
        fprintf(stderr, "bench: %s\n", duet_error_last());
        exit(2);
    }
    uint8_t *pool = NULL;
    duet_status_t st;
    if (g_device) {
        *pool_p = device_pool(ctx, 1);
        return ctx;
    }
    if (receiver && g_alloc) {
        void *base;
        st = duet_xfer_ctx_alloc(ctx, DUET_XFER_POOL_KV, POOL_BYTES, DUET_XFER_MEM_HOST, &base);
        *pool_p = NULL; /* owned by the context */
        memset(base, 1, POOL_BYTES);
    } else {
        pool = malloc(POOL_BYTES);
        memset(pool, 1, POOL_BYTES); /* fault every page in before timing */
        st = duet_xfer_ctx_register(ctx, DUET_XFER_POOL_KV, pool, POOL_BYTES, DUET_XFER_MEM_HOST);
        *pool_p = pool;
    }
    if (st < 0) {
        fprintf(stderr, "bench: %s\n", duet_error_last());
        exit(2);
    }
    return ctx;
}

/*
 * Commands: "B <tokens> <count> <big?>": reserve count transfers, send them, wait, reply "ok";
 * "Q": reply "<1|0> <rx> <tx>", the bytes its device received and sent since before UCX started
 * (1: counted; 0: UCX_NET_DEVICES names no single device here), and end.
 */
static int run_receiver(int in, int out)
{
    const char *dev = ucx_dev();
    uint64_t rx0 = 0, tx0 = 0, rx1 = 0, tx1 = 0;
    bool counted = dev != NULL && dev_bytes(dev, &rx0, &tx0);
    uint8_t *pool;
    duet_xfer_ctx_t *ctx = ctx_with_pool(&pool, 1100, true);
    static uint8_t buf[1 << 16];
    int32_t *pages = malloc(sizeof(int32_t) * 4096);
    for (;;) {
        uint32_t n;
        uint8_t *cmd = frame_read(in, &n, ctx);
        if (cmd == NULL)
            break;
        if (cmd[0] == 'Q') {
            free(cmd);
            counted = counted && dev_bytes(dev, &rx1, &tx1);
            char r[64];
            int k = snprintf(r, sizeof(r), "%d %llu %llu", counted, (unsigned long long)(rx1 - rx0),
                             (unsigned long long)(tx1 - tx0));
            frame_write(out, r, (uint32_t)k);
            break;
        }
        unsigned long long tokens;
        unsigned count, big;
        sscanf((char *)cmd + 2, "%llu %u %u", &tokens, &count, &big);
        free(cmd);
        lay_t l = big ? LAY_BIG : LAY_SMALL;
        uint64_t page_bytes = (uint64_t)l.page_tokens * l.layers * l.token_bytes;
        uint32_t per = (uint32_t)((tokens + l.page_tokens - 1) / l.page_tokens);
        g_ended = 0;
        for (unsigned k = 0; k < count; k++) {
            for (uint32_t i = 0; i < per; i++)
                pages[i] = (int32_t)((k * per + i) % (POOL_BYTES / page_bytes));
            duet_xfer_recv_args_t a = {.layout = layout_of(l),
                                       .pages = pages,
                                       .n_pages = per,
                                       .kda_slot = -1,
                                       .n_tokens = tokens,
                                       .group_size = 1,
                                       .deadline_unix_ms = duet_xfer_now_unix_ms() + 120000,
                                       .cb = count_cb};
            duet_xfer_reservation_t res;
            size_t len;
            if (duet_xfer_recv_reserve(ctx, &a, &res) < 0 ||
                duet_xfer_reservation_encode(&res, buf, sizeof(buf), &len) < 0) {
                fprintf(stderr, "bench: reserve: %s\n", duet_error_last());
                return 2;
            }
            frame_write(out, buf, (uint32_t)len);
        }
        double end = now_s() + 120;
        while (g_ended < count && now_s() < end)
            duet_xfer_ctx_progress(ctx);
        frame_write(out, "ok", 2);
    }
    duet_xfer_ctx_destroy(ctx);
    pool_free(pool);
    free(pages);
    return 0;
}

/* --- sender (this process) ---------------------------------------------------------------- */

typedef struct {
    duet_xfer_ctx_t *ctx;
    uint8_t *pool, *scratch;
    int to, from;
    int32_t *pages;
} sender_t;

static unsigned g_sent;
static bool g_ok;
static uint64_t g_kv_bytes; /* KV bytes the finished transfers put (a lower bound of the wire's) */
static void send_cb(const duet_xfer_outcome_t *o, void *user)
{
    g_sent++;
    g_ok = o->kind == DUET_XFER_OUTCOME_DONE;
    if (!g_ok)
        fprintf(stderr, "bench: send aborted: %s: %s\n", duet_xfer_reason_str(o->reason),
                o->message);
}

/* Ask for `count` reservations of `tokens`; then time each transfer alone. times[] gets s. */
static int run_batch(sender_t *S, lay_t l, uint64_t tokens, unsigned count, double *times)
{
    char cmd[64];
    int n = snprintf(cmd, sizeof(cmd), "B %llu %u %u", (unsigned long long)tokens, count,
                     l.layers == LAY_BIG.layers);
    frame_write(S->to, cmd, (uint32_t)n);
    duet_xfer_reservation_t *res = calloc(count, sizeof(*res));
    for (unsigned k = 0; k < count; k++) {
        uint32_t len;
        uint8_t *b = frame_read(S->from, &len, S->ctx);
        if (b == NULL || duet_xfer_reservation_decode(b, len, 0, &res[k]) < 0) {
            fprintf(stderr, "bench: reservation: %s\n", duet_error_last());
            return -1;
        }
        free(b);
    }
    uint32_t per = (uint32_t)((tokens + l.page_tokens - 1) / l.page_tokens);
    for (uint32_t i = 0; i < per; i++)
        S->pages[i] = (int32_t)i;
    for (unsigned k = 0; k < count; k++) {
        duet_xfer_send_args_t a = {
            .reservations = &res[k],
            .n_ranks = 1,
            .layout = layout_of(l),
            .src = {.pages = S->pages, .n_pages = per, .kda_slot = -1, .n_tokens = tokens},
            .cb = send_cb};
        duet_xfer_id_t id;
        g_sent = 0;
        double t0 = now_s();
        if (duet_xfer_send_start(S->ctx, &a, &id) < 0) {
            fprintf(stderr, "bench: start: %s\n", duet_error_last());
            return -1;
        }
        for (uint32_t layer = 0; layer < l.layers; layer++)
            duet_xfer_send_layer_ready(S->ctx, id, layer);
        while (g_sent == 0)
            duet_xfer_ctx_progress(S->ctx);
        times[k] = now_s() - t0;
        if (!g_ok)
            return -1;
        g_kv_bytes += tokens * l.layers * l.token_bytes;
        duet_xfer_reservation_free(&res[k]);
    }
    free(res);
    uint32_t len;
    uint8_t *ok = frame_read(S->from, &len, S->ctx);
    if (ok == NULL)
        return -1;
    free(ok);
    return 0;
}

/* One piece of the reference copy: memcpy, or cudaMemcpyAsync device to device. */
static void copy_piece(void *dst, const void *src, size_t n)
{
#ifdef DUET_HAVE_CUDA
    if (g_device) {
        cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, 0);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* memcpy of the same source bytes (page by page, layer by layer) into a warm buffer. */
static double time_memcpy(sender_t *S, lay_t l, uint64_t tokens, int reps)
{
    uint64_t page_bytes = (uint64_t)l.page_tokens * l.layers * l.token_bytes;
    uint64_t full = tokens / l.page_tokens, rest = tokens % l.page_tokens;
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        uint8_t *dst = S->scratch;
        for (uint64_t p = 0; p <= full; p++) {
            uint64_t t = p < full ? l.page_tokens : rest;
            if (t == 0)
                break;
            for (uint32_t layer = 0; layer < l.layers; layer++) {
                uint64_t n = t * l.token_bytes;
                copy_piece(
                    dst, S->pool + p * page_bytes + (uint64_t)layer * l.page_tokens * l.token_bytes,
                    n);
                dst += n;
            }
        }
#ifdef DUET_HAVE_CUDA
        if (g_device)
            cudaDeviceSynchronize();
#endif
        double dt = now_s() - t0;
        if (dt < best)
            best = dt;
    }
    return best;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/*
 * After the last transfer: end the receiver ("Q"), collect its device counters, print both
 * sides' (net) beside the KV bytes put, and reap it. dev / counted / rx0 / tx0: the sender's
 * device and its counters before UCX started. Returns 0, or -1 (printed why).
 */
static int finish(sender_t *S, pid_t pid, bool net, const char *dev, bool counted, uint64_t rx0,
                  uint64_t tx0)
{
    int rc = 0;
    frame_write(S->to, "Q", 1);
    uint32_t len;
    uint8_t *reply = frame_read(S->from, &len, S->ctx);
    int r_counted = 0;
    unsigned long long r_rx = 0, r_tx = 0;
    if (reply == NULL || sscanf((char *)reply, "%d %llu %llu", &r_counted, &r_rx, &r_tx) != 3) {
        fprintf(stderr, "bench: no counters from the receiver\n");
        rc = -1;
    }
    free(reply);
    uint64_t rx1 = 0, tx1 = 0;
    counted = counted && dev_bytes(dev, &rx1, &tx1);
    if (net && rc == 0) {
        printf("kv bytes put: %llu\n", (unsigned long long)g_kv_bytes);
        if (counted)
            printf("sender dev %s: tx_bytes +%llu rx_bytes +%llu\n", dev,
                   (unsigned long long)(tx1 - tx0), (unsigned long long)(rx1 - rx0));
        else
            printf("sender dev: not counted (UCX_NET_DEVICES names no single device)\n");
        if (r_counted)
            printf("receiver dev %s: rx_bytes +%llu tx_bytes +%llu\n", g_side[1].dev, r_rx, r_tx);
        else
            printf("receiver dev: not counted (UCX_NET_DEVICES names no single device)\n");
    }
    int st = 0;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "bench: the receiver failed (wait status %d)\n", st);
        rc = -1;
    }
    return rc;
}

/* "lo" or "dev in netns NAME", for side i's heading. */
static const char *side_str(int i, char *buf, size_t cap)
{
    if (g_side[i].ns != NULL)
        snprintf(buf, cap, "%s in netns %s", g_side[i].dev, g_side[i].ns);
    else
        snprintf(buf, cap, "%s", g_side[i].dev);
    return buf;
}

/*
 * One transport's tables. net (tcp): each side runs where g_side says and its device's byte
 * counters are printed beside the KV bytes put, e.g.
 *   kv bytes put: 1234
 *   sender dev veth0: tx_bytes +1300 rx_bytes +20
 * (a side whose UCX_NET_DEVICES names no single device prints "not counted").
 */
static int bench_transport(const char *name, const char *tls, bool quick, bool net)
{
    setenv("UCX_TLS", tls, !g_device); /* device pools: an operator's UCX_TLS is kept */
    int p2c[2], c2p[2];
    if (pipe(p2c) != 0 || pipe(c2p) != 0)
        return -1;
    fflush(stdout); /* the child must not print the parent's buffered lines again */
    pid_t pid = fork();
    if (pid == 0) {
        close(p2c[1]);
        close(c2p[0]);
        int erc = net ? side_enter(1) : 0;
        _exit(erc != 0 ? erc : run_receiver(p2c[0], c2p[1]));
    }
    close(p2c[0]);
    close(c2p[1]);
    if (net && side_enter(0) != 0) {
        kill(pid, SIGTERM);
        waitpid(pid, NULL, 0);
        return -1;
    }
    const char *dev = ucx_dev();
    uint64_t rx0 = 0, tx0 = 0;
    bool counted = net && dev != NULL && dev_bytes(dev, &rx0, &tx0);
    g_kv_bytes = 0;
    sender_t S = {.to = p2c[1], .from = c2p[0]};
    S.ctx = ctx_with_pool(&S.pool, 1100, false);
    if (g_device) {
        S.scratch = device_buffer(2); /* the reference copy's destination */
    } else {
        S.scratch = malloc(POOL_BYTES);
        memset(S.scratch, 2, POOL_BYTES);
    }
    S.pages = malloc(sizeof(int32_t) * 4096);
    uint64_t token_bytes = (uint64_t)LAY_BIG.layers * LAY_BIG.token_bytes;

    char hs[2][300];
    if (net)
        printf("\n%s (UCX_TLS=%s; sender: %s, receiver: %s)\n", name, tls,
               side_str(0, hs[0], sizeof(hs[0])), side_str(1, hs[1], sizeof(hs[1])));
    else
        printf("\n%s (UCX_TLS=%s)\n", name, tls);
    printf("%10s %10s %12s %12s %12s %8s\n", "size", "puts", "xfer ms", "xfer GB/s", "memcpy GB/s",
           "ratio");
    const unsigned sizes_mib[] = {1, 4, 16, 64, 256};
    int rc = 0;
    for (size_t i = 0; i < sizeof(sizes_mib) / sizeof(sizes_mib[0]) && rc == 0; i++) {
        uint64_t tokens = ((uint64_t)sizes_mib[i] << 20) / token_bytes;
        uint64_t bytes = tokens * token_bytes;
        int reps = quick ? 2 : (sizes_mib[i] >= 64 ? 3 : 5);
        double t[8], best = 1e9;
        for (int r = 0; r < reps && rc == 0; r++) {
            rc = run_batch(&S, LAY_BIG, tokens, 1, t);
            if (t[0] < best)
                best = t[0];
        }
        if (rc != 0)
            break;
        double mc = time_memcpy(&S, LAY_BIG, tokens, reps);
        uint64_t puts = ((tokens + LAY_BIG.page_tokens - 1) / LAY_BIG.page_tokens) * LAY_BIG.layers;
        printf("%7u MiB %10llu %12.3f %12.2f %12.2f %8.3f\n", sizes_mib[i],
               (unsigned long long)puts, best * 1e3, bytes / best / 1e9, bytes / mc / 1e9,
               mc / best);
    }
    const struct {
        const char *what;
        lay_t l;
        unsigned n;
    } lat[] = {{"1 page, 7 layers x 128 tok x 1152 B (1008 KiB)", LAY_BIG, quick ? 100 : 400},
               {"1 page, 1 layer x 16 tok x 576 B (9 KiB)", LAY_SMALL, quick ? 200 : 1000}};
    printf("%-50s %8s %10s %10s\n", "latency (start -> DONE)", "n", "p50 us", "p99 us");
    for (size_t i = 0; i < 2 && rc == 0; i++) {
        unsigned n = lat[i].n;
        double *t = malloc(sizeof(double) * n);
        for (unsigned done = 0; done < n && rc == 0; done += 100)
            rc = run_batch(&S, lat[i].l, lat[i].l.page_tokens, 100, t + done);
        qsort(t, n, sizeof(double), cmp_double);
        if (rc == 0)
            printf("%-50s %8u %10.1f %10.1f\n", lat[i].what, n, t[n / 2] * 1e6,
                   t[(size_t)(n * 0.99)] * 1e6);
        free(t);
    }
    if (rc == 0)
        rc = finish(&S, pid, net, dev, counted, rx0, tx0);
    else { /* the receiver may wait for transfers that will never come */
        kill(pid, SIGTERM);
        waitpid(pid, NULL, 0);
    }
    duet_xfer_ctx_destroy(S.ctx);
    close(S.to);
    close(S.from);
    pool_free(S.pool);
    pool_free(S.scratch);
    free(S.pages);
    return rc;
}

int main(int argc, char **argv)
{
    bool quick = false, placed = false; /* placed: --netns or --net-devices given */
    const char *which = "both";
    for (int i = 1; i < argc; i++) {
        if (duet_version_flag(argv[i])) {
            duet_version_print("duet-bench-xfer");
            return 0;
        }
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: duet-bench-xfer [--quick] [--malloc] [--transport shm|tcp|both|cuda]\n"
                   "                       [--netns SENDER_NS,RECEIVER_NS]\n"
                   "                       [--net-devices SENDER_DEV,RECEIVER_DEV]\n"
                   "Bandwidth (1 .. 256 MiB transfers) and latency (one-page transfers, p50 /\n"
                   "p99) of the UCX transfer runtime between this process and a forked receiver,\n"
                   "moving MLA KV pages laid out like Kimi-Linear-48B's, against memcpy of the\n"
                   "same pages. --transport: shared memory, tcp, both (default), or device pools\n"
                   "through a CUDA-built UCX; --malloc: a malloc'ed receive pool instead of a\n"
                   "UCX-allocated one; --quick: fewer runs and latency samples.\n"
                   "tcp runs on loopback (UCX_NET_DEVICES, default lo) unless placed (--transport\n"
                   "tcp only): --netns puts the sender and the receiver each in a network\n"
                   "namespace made by `ip netns add` (needs root), --net-devices gives each its\n"
                   "own UCX_NET_DEVICES (one device, e.g. a veth); an empty half stays where it\n"
                   "is. Each side's device byte counters are printed beside the KV bytes put.\n"
                   "Bad options, a missing namespace or device, a device that is down, or setns\n"
                   "refused (not root): a message and exit 2.\n");
            return 0;
        }
        if (strcmp(argv[i], "--quick") == 0)
            quick = true;
        else if (strcmp(argv[i], "--malloc") == 0)
            g_alloc = false;
        else if (strcmp(argv[i], "--transport") == 0 && i + 1 < argc) {
            which = argv[++i];
            if (strcmp(which, "shm") != 0 && strcmp(which, "tcp") != 0 &&
                strcmp(which, "both") != 0 && strcmp(which, "cuda") != 0) {
                fprintf(stderr,
                        "duet-bench-xfer: bad value '%s' for --transport "
                        "(shm, tcp, both or cuda)\n",
                        which);
                return 2;
            }
        } else if (strcmp(argv[i], "--netns") == 0 || strcmp(argv[i], "--net-devices") == 0) {
            const bool ns = strcmp(argv[i], "--netns") == 0;
            if (i + 1 >= argc) {
                fprintf(stderr, "duet-bench-xfer: %s needs a value\n", argv[i]);
                return 2;
            }
            const char *opt = argv[i], *got[2];
            char *v = argv[++i], shown[300];
            snprintf(shown, sizeof(shown), "%s", v); /* split_pair cuts v */
            if (!split_pair(v, ns ? netns_name_ok : dev_name_ok, got)) {
                fprintf(stderr,
                        "duet-bench-xfer: bad value '%s' for %s (%s: two names split by one "
                        "comma, either may be empty%s)\n",
                        shown, opt, ns ? "SENDER_NS,RECEIVER_NS" : "SENDER_DEV,RECEIVER_DEV",
                        ns ? "; no '/'" : "; one device each, under 16 characters");
                return 2;
            }
            for (int k = 0; k < 2; k++) {
                if (ns)
                    g_side[k].ns = got[k];
                else
                    g_side[k].dev = got[k];
            }
            placed = true;
        } else {
            fprintf(stderr, "duet-bench-xfer: unknown option %s (see --help)\n", argv[i]);
            return 2;
        }
    }
    if (placed && strcmp(which, "tcp") != 0) {
        fprintf(stderr, "duet-bench-xfer: --netns and --net-devices need --transport tcp (the "
                        "other transports do not use the network)\n");
        return 2;
    }
    if (strcmp(which, "cuda") == 0) {
        g_device = true;
        return bench_transport("device pools (CUDA-built UCX)", "sm,self,cuda_copy,cuda_ipc", quick,
                               false) != 0;
    }
    setenv("UCX_NET_DEVICES", "lo", 0);
    for (int k = 0; k < 2; k++)
        if (g_side[k].dev == NULL)
            g_side[k].dev = strdup(getenv("UCX_NET_DEVICES")); /* side_enter's setenv replaces it */
    const bool apart = (g_side[0].ns == NULL) != (g_side[1].ns == NULL) ||
                       (g_side[0].ns != NULL && strcmp(g_side[0].ns, g_side[1].ns) != 0);
    if (apart && (strcmp(g_side[0].dev, "lo") == 0 || strcmp(g_side[1].dev, "lo") == 0)) {
        fprintf(stderr, "duet-bench-xfer: the sender and the receiver are in different network "
                        "namespaces, where one's lo cannot reach the other: --net-devices must "
                        "name a device that does (a veth) for each\n");
        return 2;
    }
    if (placed && side_check() != 0)
        return 2;
    signal(SIGPIPE, SIG_IGN);
    printf("duet-bench-xfer: sender and receiver processes, MLA KV pages of 7 layers x 128 "
           "tokens x 1152 B; bandwidth = best of runs, start -> sender DONE (puts flushed, "
           "XferDone sent)\n");
    int rc = 0;
    if (strcmp(which, "tcp") != 0)
        rc |= bench_transport("shared memory", "posix,sysv,cma,self", quick, false);
    if (strcmp(which, "shm") != 0)
        rc |= bench_transport("tcp", "tcp,self", quick, true);
    return rc != 0;
}
