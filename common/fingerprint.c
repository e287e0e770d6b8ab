/*
 * Model fingerprints (common/fingerprint.h): the router and every worker compute one from their
 * model folder, and the router refuses a worker whose fingerprint differs.
 */
#include "common/fingerprint.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/strbuf.h"

/* SHA-256 (FIPS 180-4), small and self-contained: no crypto library is pulled in
   for one start-up hash. */
typedef struct {
    uint32_t h[8];
    uint64_t len;
    uint8_t buf[64];
    size_t n;
} fp_sha256_t;

static const uint32_t fp_sha_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

#define REG_ROR(x, r) (((x) >> (r)) | ((x) << (32 - (r))))

static void fp_sha256_block(fp_sha256_t *s, const uint8_t *p)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = REG_ROR(w[i - 15], 7) ^ REG_ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = REG_ROR(w[i - 2], 17) ^ REG_ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3];
    uint32_t e = s->h[4], f = s->h[5], g = s->h[6], h = s->h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (REG_ROR(e, 6) ^ REG_ROR(e, 11) ^ REG_ROR(e, 25)) + ((e & f) ^ (~e & g)) +
                      fp_sha_k[i] + w[i];
        uint32_t t2 =
            (REG_ROR(a, 2) ^ REG_ROR(a, 13) ^ REG_ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    s->h[0] += a;
    s->h[1] += b;
    s->h[2] += c;
    s->h[3] += d;
    s->h[4] += e;
    s->h[5] += f;
    s->h[6] += g;
    s->h[7] += h;
}

static void fp_sha256_init(fp_sha256_t *s)
{
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, h0, sizeof(h0));
    s->len = 0;
    s->n = 0;
}

static void fp_sha256_update(fp_sha256_t *s, const void *data, size_t len)
{
    const uint8_t *p = data;
    s->len += len;
    while (len > 0) {
        size_t take = 64 - s->n < len ? 64 - s->n : len;
        memcpy(s->buf + s->n, p, take);
        s->n += take;
        p += take;
        len -= take;
        if (s->n == 64) {
            fp_sha256_block(s, s->buf);
            s->n = 0;
        }
    }
}

static void fp_sha256_final(fp_sha256_t *s, uint8_t out[32])
{
    uint64_t bits = s->len * 8;
    uint8_t pad = 0x80;
    fp_sha256_update(s, &pad, 1);
    pad = 0;
    while (s->n != 56)
        fp_sha256_update(s, &pad, 1);
    uint8_t lenb[8];
    for (int i = 0; i < 8; i++)
        lenb[i] = (uint8_t)(bits >> (56 - 8 * i));
    fp_sha256_update(s, lenb, 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)s->h[i];
    }
}

void duet__sha256(const void *data, size_t len, uint8_t out[32])
{
    fp_sha256_t s;
    fp_sha256_init(&s);
    fp_sha256_update(&s, data, len);
    fp_sha256_final(&s, out);
}

static duet_status_t fp_hash_file(fp_sha256_t *s, const char *path, size_t max)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_status_t st = duet_strbuf_read_file(&sb, path, max);
    if (st == DUET_OK)
        fp_sha256_update(s, sb.data != NULL ? sb.data : "", sb.len);
    duet_strbuf_free(&sb);
    return st;
}

duet_status_t duet_model_fingerprint(const char *dir, char *out, size_t cap)
{
    if (cap < 72)
        return duet_error_set(DUET_ERR_NO_SPACE, "fingerprint buffer too small");
    char path[4096];
    fp_sha256_t s;
    fp_sha256_init(&s);
    snprintf(path, sizeof(path), "%s/config.json", dir);
    duet_status_t st = fp_hash_file(&s, path, (size_t)16 << 20);
    if (st < 0)
        return st;
    fp_sha256_update(&s, "\n--\n", 4);
    struct stat sb;
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    if (stat(path, &sb) == 0) {
        st = fp_hash_file(&s, path, (size_t)64 << 20);
        if (st < 0)
            return st;
    } else {
        /* a single-file checkpoint: its header (8-byte LE length + JSON) names every tensor */
        snprintf(path, sizeof(path), "%s/model.safetensors", dir);
        FILE *f = fopen(path, "rb");
        if (f == NULL)
            return duet_error_set(DUET_ERR_NOT_FOUND,
                                  "%s: neither model.safetensors.index.json nor model.safetensors",
                                  dir);
        uint8_t lb[8];
        uint64_t hl = 0;
        if (fread(lb, 1, 8, f) != 8) {
            fclose(f);
            return duet_error_set(DUET_ERR_FORMAT, "%s: shorter than 8 bytes", path);
        }
        for (int i = 7; i >= 0; i--)
            hl = hl << 8 | lb[i];
        if (hl > ((uint64_t)100 << 20)) {
            fclose(f);
            return duet_error_set(DUET_ERR_FORMAT, "%s: header length %llu is too large", path,
                                  (unsigned long long)hl);
        }
        fp_sha256_update(&s, lb, 8);
        uint8_t chunk[8192];
        while (hl > 0) {
            size_t want = hl < sizeof(chunk) ? (size_t)hl : sizeof(chunk);
            size_t got = fread(chunk, 1, want, f);
            if (got != want) {
                fclose(f);
                return duet_error_set(DUET_ERR_FORMAT, "%s: truncated header", path);
            }
            fp_sha256_update(&s, chunk, got);
            hl -= got;
        }
        fclose(f);
    }
    uint8_t d[32];
    fp_sha256_final(&s, d);
    int at = snprintf(out, cap, "sha256:");
    for (int i = 0; i < 32; i++)
        at += snprintf(out + at, cap - (size_t)at, "%02x", d[i]);
    return DUET_OK;
}
