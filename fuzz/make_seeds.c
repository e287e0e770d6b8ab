/*
 * fuzz_make_seeds: writes the binary seeds of fuzz/corpus/ (fuzz/corpus/README.md lists every
 * seed and its source). They are made with duet's own encoders rather than typed by hand, so a
 * seed is exactly what a duet process sends: reservations (transfer/reservation.c), Envelopes and
 * frames (proto/frame.c, proto/envelope.h) and safetensors files (tests/unit/st_writer.c, the
 * tests' writer, for fuzz/tiny_config.h). Every value is fixed: running it again rewrites the
 * same bytes.
 *
 * Usage: fuzz_make_seeds CORPUS_DIR   (writes CORPUS_DIR/<target>/<seed>; the folders must exist)
 * Built on demand only: cmake --build build --target fuzz_make_seeds.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/strbuf.h"
#include "engine/model_config.h"
#include "fuzz/tiny_config.h"
#include "proto/envelope.h"
#include "proto/frame.h"
#include "tests/unit/st_writer.h"
#include "transfer/reservation.h"

#define DEADLINE_MS 4000000000000ull /* far past the fuzz targets' fixed clock */

static const char *g_dir;

static void die(const char *what)
{
    fprintf(stderr, "fuzz_make_seeds: %s\n", what);
    exit(1);
}

static void write_seed(const char *target, const char *name, const duet_strbuf_t *sb)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s/%s", g_dir, target, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL || (sb->len > 0 && fwrite(sb->data, 1, sb->len, f) != sb->len) || fclose(f) != 0)
        die(path);
    printf("%s (%zu bytes)\n", path, sb->len);
}

static void put_byte(duet_strbuf_t *sb, uint8_t b)
{
    duet_strbuf_append(sb, (const char *)&b, 1);
}

/* ---- reservations */

static const int32_t pages_a[] = {3, 7, 4}, pages_b[] = {1, 0, 2};
static const uint8_t worker_addr[] = "ucx-worker-address-bytes", rkey[] = "rkey";

static duet_xfer_reservation_t reservation(uint32_t rank, uint32_t group, uint32_t kv_ranks,
                                           uint32_t n_replay)
{
    duet_xfer_reservation_t r;
    memset(&r, 0, sizeof(r));
    r.version = DUET_XFER_RESERVATION_VERSION;
    r.transfer_id = 0x1000 + rank;
    r.request_id = 42;
    r.rank = rank;
    r.group_size = group;
    r.kv_ranks = kv_ranks;
    r.worker_address = (duet_xfer_bytes_t){worker_addr, sizeof(worker_addr) - 1};
    r.layout = (duet_xfer_layout_t){.page_tokens = 16,
                                    .n_mla_layers = 2,
                                    .token_bytes = 320,
                                    .n_kda_layers = 6,
                                    .kda_heads = 4 / group,
                                    .kda_head_dim = 8,
                                    .conv_kernel = 4,
                                    .state_elem = 4,
                                    .replay_rows = n_replay > 0 ? 8 : 0};
    r.kv_rkey = (duet_xfer_bytes_t){rkey, sizeof(rkey) - 1};
    r.kv_base = 0x7f0000000000ull;
    r.kv_bytes = 8 * duet_xfer_layout_kv_page_bytes(&r.layout);
    r.kda_rkey = r.kv_rkey;
    r.kda_base = 0x7f1000000000ull;
    r.kda_bytes = 2 * duet_xfer_layout_kda_slot_bytes(&r.layout);
    r.pages = rank == 0 ? pages_a : pages_b;
    r.n_pages = 3;
    r.kda_slot = 1;
    r.n_tokens = group == 1 ? 40 : 36;
    r.deadline_unix_ms = DEADLINE_MS;
    if (n_replay > 0) {
        r.replay_rkey = r.kv_rkey;
        r.replay_base = 0x7f2000000000ull;
        r.replay_bytes = 2 * duet_xfer_layout_replay_slot_bytes(&r.layout);
        r.n_replay = n_replay;
    }
    return r;
}

static void append_reservation(duet_strbuf_t *sb, const duet_xfer_reservation_t *r)
{
    uint8_t buf[4096];
    size_t len = 0;
    if (duet_xfer_reservation_encode(r, buf, sizeof(buf), &len) != DUET_OK)
        die(duet_error_last());
    duet_strbuf_append(sb, (const char *)buf, len);
}

static void reservation_seeds(void)
{
    duet_strbuf_t sb = {0};
    duet_xfer_reservation_t r = reservation(0, 1, 1, 0);
    put_byte(&sb, 0); /* one reservation */
    append_reservation(&sb, &r);
    write_seed("reservation", "single", &sb);
    duet_strbuf_free(&sb);

    r = reservation(0, 1, 1, 3);
    put_byte(&sb, 0);
    append_reservation(&sb, &r);
    write_seed("reservation", "replay_rows", &sb);
    duet_strbuf_free(&sb);

    /* A Helix group of two: cp 2 (kv_ranks 2), then tp 2 (kv_ranks 1); ranks in reverse order. */
    for (uint32_t kv = 2; kv >= 1; kv--) {
        duet_xfer_reservation_t r1 = reservation(1, 2, kv, 0), r0 = reservation(0, 2, kv, 0);
        put_byte(&sb, 1); /* two reservations */
        append_reservation(&sb, &r1);
        duet_strbuf_puts(&sb, "\n--rank--\n");
        append_reservation(&sb, &r0);
        write_seed("reservation", kv == 2 ? "group_cp2" : "group_tp2", &sb);
        duet_strbuf_free(&sb);
    }
}

/* ---- Envelopes */

static void append_frame(duet_strbuf_t *sb, Duet__Envelope env)
{
    if (duet_frame_append(&env, sb) != DUET_OK)
        die(duet_error_last());
}

/* The packed Envelope without its frame header. */
static void append_body(duet_strbuf_t *sb, Duet__Envelope env)
{
    duet_strbuf_t f = {0};
    append_frame(&f, env);
    duet_strbuf_append(sb, f.data + DUET_FRAME_HEADER_BYTES, f.len - DUET_FRAME_HEADER_BYTES);
    duet_strbuf_free(&f);
}

static uint8_t res_buf[2][4096];
static ProtobufCBinaryData res_bytes(int which, uint32_t rank, uint32_t group)
{
    duet_xfer_reservation_t r = reservation(rank, group, group, 0);
    size_t len = 0;
    if (duet_xfer_reservation_encode(&r, res_buf[which], sizeof(res_buf[which]), &len) != DUET_OK)
        die(duet_error_last());
    return (ProtobufCBinaryData){.len = len, .data = res_buf[which]};
}

static Duet__Capacity capacity = DUET__CAPACITY__INIT;

static void frame_stream(duet_strbuf_t *sb, Duet__WorkerRole role, const char *name)
{
    capacity.kv_pages = 512;
    capacity.page_tokens = 16;
    capacity.max_seqs = 8;
    capacity.max_batch_tokens = 2048;
    Duet__Register reg = DUET__REGISTER__INIT;
    reg.role = role;
    reg.worker_name = (char *)name;
    reg.version = DUET_PROTO_VERSION;
    reg.model_fingerprint = "fp-fuzz";
    reg.capacity = &capacity;
    append_frame(sb, duet_envelope_register_(&reg));

    static uint64_t spec[3] = {5, 2, 1};
    Duet__Heartbeat hb = DUET__HEARTBEAT__INIT;
    hb.free_pages = 500;
    hb.running = 2;
    hb.queued = 1;
    hb.queued_tokens = 300;
    hb.decode_steps = 10;
    hb.decode_seq_steps = 18;
    hb.decoded_tokens = 25;
    hb.step_seconds = 0.25;
    hb.prefill_tokens = 900;
    hb.n_spec_step_tokens = 3;
    hb.spec_step_tokens = spec;
    hb.n_spec_drafted = 2;
    hb.spec_drafted = spec;
    hb.n_spec_accepted = 1;
    hb.spec_accepted = spec;
    append_frame(sb, duet_envelope_heartbeat(&hb));

    static uint32_t ids[] = {72, 101, 108, 108, 111};
    Duet__Tokens tok = DUET__TOKENS__INIT;
    tok.request_id = 42;
    tok.n_ids = 5;
    tok.ids = ids;
    tok.error = "";
    append_frame(sb, duet_envelope_tokens(&tok));

    if (role == DUET__WORKER_ROLE__WORKER_ROLE_GEN) {
        static ProtobufCBinaryData more[1];
        Duet__Reserved rs = DUET__RESERVED__INIT;
        rs.request_id = 42;
        rs.reservation = res_bytes(0, 0, 2);
        more[0] = res_bytes(1, 1, 2);
        rs.n_more_reservations = 1;
        rs.more_reservations = more;
        append_frame(sb, duet_envelope_reserved(&rs));

        static uint64_t rng[DUET_PROTO_RNG_WORDS] = {1, 2, 3, 4};
        static uint32_t gen[] = {9, 8};
        Duet__MoveState ms = DUET__MOVE_STATE__INIT;
        ms.kv_tokens = 41;
        ms.replay_rows = 1;
        ms.produced = 2;
        ms.next_token = 8;
        ms.n_rng = DUET_PROTO_RNG_WORDS;
        ms.rng = rng;
        ms.n_generated = 2;
        ms.generated = gen;
        Duet__MovePaused mp = DUET__MOVE_PAUSED__INIT;
        mp.request_id = 42;
        mp.ok = true;
        mp.reason = "";
        mp.state = &ms;
        append_frame(sb, duet_envelope_move_paused(&mp));
        Duet__Moved mv = DUET__MOVED__INIT;
        mv.request_id = 42;
        mv.ok = true;
        mv.reason = "";
        append_frame(sb, duet_envelope_moved(&mv));
    }
    Duet__Refused rf = DUET__REFUSED__INIT;
    rf.request_id = 43;
    rf.reason = "out of pages";
    rf.retry_after_ms = 100;
    append_frame(sb, duet_envelope_refused(&rf));
    Duet__Deregister dr = DUET__DEREGISTER__INIT;
    dr.reason = "drained";
    append_frame(sb, duet_envelope_deregister(&dr));
}

static void proto_seeds(void)
{
    duet_strbuf_t sb = {0};
    /* frame: control byte (max_frame: default), chunk seed, stream */
    put_byte(&sb, 0);
    put_byte(&sb, 7);
    frame_stream(&sb, DUET__WORKER_ROLE__WORKER_ROLE_GEN, "gen-0");
    write_seed("frame", "gen_stream", &sb);
    duet_strbuf_free(&sb);
    put_byte(&sb, 0x90); /* max_frame 513 */
    put_byte(&sb, 1);
    frame_stream(&sb, DUET__WORKER_ROLE__WORKER_ROLE_CTX, "ctx-0");
    write_seed("frame", "ctx_stream_small_max", &sb);
    duet_strbuf_free(&sb);

    /* registry: control byte (bit 0 adopt), connections */
    put_byte(&sb, 0x0a);
    frame_stream(&sb, DUET__WORKER_ROLE__WORKER_ROLE_CTX, "ctx-0");
    write_seed("registry", "ctx_worker", &sb);
    duet_strbuf_free(&sb);
    put_byte(&sb, 0x11);
    frame_stream(&sb, DUET__WORKER_ROLE__WORKER_ROLE_GEN, "gen-0");
    duet_strbuf_puts(&sb, "\n--conn--\n");
    frame_stream(&sb, DUET__WORKER_ROLE__WORKER_ROLE_CTX, "ctx-0");
    write_seed("registry", "gen_then_ctx_adopting", &sb);
    duet_strbuf_free(&sb);

    /* envelope: 16-byte active-message header ("DXF1", kind, id), then the body */
    static const uint8_t hdr_env[16] = {'D', 'X', 'F', '1', 2, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0};
    static const uint8_t hdr_hello[16] = {'D', 'X', 'F', '1', 1, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0};
    Duet__XferDone done = DUET__XFER_DONE__INIT;
    done.transfer_id = 7;
    done.bytes = 123456;
    done.has_checksum = true;
    done.checksum = 0x0123456789abcdefull;
    duet_strbuf_append(&sb, (const char *)hdr_env, 16);
    append_body(&sb, duet_envelope_xfer_done(&done));
    write_seed("envelope", "xfer_done", &sb);
    duet_strbuf_free(&sb);
    Duet__XferAbort ab = DUET__XFER_ABORT__INIT;
    ab.transfer_id = 7;
    ab.reason = DUET__XFER_ABORT__REASON__DEADLINE;
    ab.message = "deadline passed";
    duet_strbuf_append(&sb, (const char *)hdr_env, 16);
    append_body(&sb, duet_envelope_xfer_abort(&ab));
    write_seed("envelope", "xfer_abort", &sb);
    duet_strbuf_free(&sb);
    duet_strbuf_append(&sb, (const char *)hdr_hello, 16);
    duet_strbuf_append(&sb, (const char *)worker_addr, sizeof(worker_addr) - 1);
    write_seed("envelope", "hello", &sb);
    duet_strbuf_free(&sb);

    static uint32_t prompt[] = {256, 72, 105};
    static ProtobufCBinaryData more[1];
    Duet__Sampling smp = DUET__SAMPLING__INIT;
    smp.temperature = 0.7f;
    smp.top_p = 0.9f;
    smp.has_seed = true;
    smp.seed = 5;
    Duet__Prefill pf = DUET__PREFILL__INIT;
    pf.request_id = 42;
    pf.n_tokens = 3;
    pf.tokens = prompt;
    pf.sampling = &smp;
    pf.max_tokens = 16;
    pf.reservation = res_bytes(0, 0, 2);
    more[0] = res_bytes(1, 1, 2);
    pf.n_more_reservations = 1;
    pf.more_reservations = more;
    pf.deadline_unix_ms = DEADLINE_MS;
    duet_strbuf_append(&sb, (const char *)hdr_env, 16);
    append_body(&sb, duet_envelope_prefill(&pf));
    write_seed("envelope", "prefill_group", &sb);
    duet_strbuf_free(&sb);
    Duet__MoveOut mo = DUET__MOVE_OUT__INIT;
    mo.request_id = 42;
    duet_xfer_reservation_t r = reservation(0, 1, 1, 3);
    duet_strbuf_t rb = {0};
    append_reservation(&rb, &r);
    mo.reservation = (ProtobufCBinaryData){.len = rb.len, .data = (uint8_t *)rb.data};
    duet_strbuf_append(&sb, (const char *)hdr_env, 16);
    append_body(&sb, duet_envelope_move_out(&mo));
    write_seed("envelope", "move_out", &sb);
    duet_strbuf_free(&sb);
    duet_strbuf_free(&rb);
}

/* ---- safetensors */

static void file_into(duet_strbuf_t *sb, const char *path)
{
    if (duet_strbuf_read_file(sb, path, 1u << 20) != DUET_OK)
        die(duet_error_last());
}

static void safetensors_seeds(void)
{
    duet_model_config_t cfg;
    if (duet_model_config_parse(FUZZ_TINY_CONFIG, strlen(FUZZ_TINY_CONFIG), "tiny", &cfg) != 0)
        die(duet_error_last());
    static const char *const dtypes[] = {"F32", "BF16"};
    for (int i = 0; i < 2; i++) {
        st_writer_t *w = st_writer_new();
        if (w == NULL || st_writer_add_model(w, &cfg, dtypes[i], 7) != 0)
            die("st_writer");
        uint8_t *buf = NULL;
        size_t len = 0;
        if (st_writer_serialize(w, &buf, &len) != 0)
            die("serialize");
        duet_strbuf_t sb = {0};
        put_byte(&sb, 0); /* mode 0: one model.safetensors */
        duet_strbuf_append(&sb, (const char *)buf, len);
        write_seed("safetensors", i == 0 ? "tiny_f32" : "tiny_bf16", &sb);
        duet_strbuf_free(&sb);
        free(buf);
        if (i == 1) { /* mode 1: the same model in two shards and its index */
            char dir[] = "/tmp/duet-seeds-XXXXXX", path[128];
            if (mkdtemp(dir) == NULL || st_writer_write_sharded(w, dir, 2) != 0)
                die("sharded");
            put_byte(&sb, 1);
            snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
            file_into(&sb, path);
            remove(path);
            for (int k = 1; k <= 2; k++) {
                duet_strbuf_puts(&sb, "\n--file--\n");
                snprintf(path, sizeof(path), "%s/model-%05d-of-00002.safetensors", dir, k);
                file_into(&sb, path);
                remove(path);
            }
            remove(dir);
            write_seed("safetensors", "tiny_bf16_sharded", &sb);
            duet_strbuf_free(&sb);
        }
        st_writer_free(w);
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
        return 2;
    }
    g_dir = argv[1];
    reservation_seeds();
    proto_seeds();
    safetensors_seeds();
    return 0;
}
