/*
 * checkpoint.c: safetensors folders, mmapped read-only and validated before any byte is used.
 *
 * A safetensors file is: 8-byte little-endian header length N, N bytes of JSON
 *   {"name": {"dtype": "BF16", "shape": [a, b], "data_offsets": [begin, end]}, ...,
 *    "__metadata__": {...}}
 * then the data area; offsets are relative to the data area. Everything in a header comes from
 * outside, so each field is checked (types, ranges, products without overflow, offsets inside
 * the data area, no two tensors sharing bytes, element alignment) and each error names the file
 * and the tensor. A folder holds either model.safetensors or model.safetensors.index.json whose
 * `weight_map` (tensor → shard file) names the shards; shard names may not leave the folder and
 * every tensor the index names must be in the shard the index says. A single model.safetensors
 * wins over an index, as in transformers.
 *
 * Whole files are mapped (MAP_PRIVATE, PROT_READ); tensors are views into the mapping, so
 * duet_tensor_t.data must never be written. Large shards get MADV_WILLNEED so the kernel reads
 * them ahead while the next shard's header is validated and the weights are bound.
 *
 * Tensors are kept sorted by name: that is the iteration order and the lookup is a binary search.
 */
#include "engine/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"

#define CK_MAX_DIMS     8
#define CK_MAX_HEADER   ((uint64_t)100 << 20)
#define CK_MAX_INDEX    ((size_t)64 << 20)
#define CK_PREFETCH_MIN ((uint64_t)1 << 30)
#define CK_SINGLE_NAME  "model.safetensors"
#define CK_INDEX_NAME   "model.safetensors.index.json"

typedef struct {
    char *name; /* owned */
    duet_dtype_t dtype;
    int ndim;
    int64_t shape[CK_MAX_DIMS];
    uint64_t begin; /* relative to the data area */
    uint64_t end;
    const uint8_t *data; /* inside the shard's mapping, not owned */
    int shard;
    int used; /* fetched with duet_checkpoint_get_shaped */
} ck_entry_t;

typedef struct {
    char *path; /* owned: dir/file */
    void *map;  /* whole file, PROT_READ; NULL for an empty mapping */
    size_t map_len;
} ck_shard_t;

struct duet_checkpoint {
    char *dir;          /* owned */
    char *where;        /* owned: dir/model.safetensors or dir/model.safetensors.index.json */
    ck_shard_t *shards; /* [n_shards], owned */
    int n_shards;
    ck_entry_t *entries; /* [n_entries], owned, sorted by name */
    int64_t n_entries;
    int64_t cap_entries;
    int64_t n_used;
};

/* ---- helpers -------------------------------------------------------------------------------- */

static void human_size(uint64_t bytes, char *buf, size_t cap)
{
    if (bytes >= ((uint64_t)1 << 30))
        snprintf(buf, cap, "%.1f GiB", (double)bytes / (double)((uint64_t)1 << 30));
    else if (bytes >= ((uint64_t)1 << 20))
        snprintf(buf, cap, "%.1f MiB", (double)bytes / (double)((uint64_t)1 << 20));
    else
        snprintf(buf, cap, "%.1f KiB", (double)bytes / 1024.0);
}

static char *path_join(const char *dir, const char *file)
{
    size_t n = strlen(dir) + 1 + strlen(file) + 1;
    char *p = malloc(n);
    if (p != NULL)
        snprintf(p, n, "%s/%s", dir, file);
    return p;
}

static void format_shape(const int64_t *dims, int ndim, char *buf, size_t cap)
{
    size_t off = 0;
    off += (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && off < cap; i++)
        off += (size_t)snprintf(buf + off, cap - off, "%s%" PRId64, i ? ", " : "", dims[i]);
    if (off < cap)
        snprintf(buf + off, cap - off, "]");
}

static int entry_cmp_name(const void *a, const void *b)
{
    return strcmp(((const ck_entry_t *)a)->name, ((const ck_entry_t *)b)->name);
}

static const ck_entry_t *find_entry(const duet_checkpoint_t *ck, const char *name)
{
    ck_entry_t key;
    key.name = (char *)name;
    if (ck->n_entries == 0)
        return NULL; /* entries may be NULL, and bsearch's base is nonnull */
    return bsearch(&key, ck->entries, (size_t)ck->n_entries, sizeof(*ck->entries), entry_cmp_name);
}

static duet_status_t push_entry(duet_checkpoint_t *ck, ck_entry_t **e_p)
{
    if (ck->n_entries == ck->cap_entries) {
        int64_t cap = ck->cap_entries ? ck->cap_entries * 2 : 256;
        ck_entry_t *ne = realloc(ck->entries, (size_t)cap * sizeof(*ne));
        if (ne == NULL)
            return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", ck->dir);
        ck->entries = ne;
        ck->cap_entries = cap;
    }
    *e_p = &ck->entries[ck->n_entries];
    memset(*e_p, 0, sizeof(**e_p));
    return DUET_OK;
}

/* Map a safetensors dtype string; DUET_ERR_UNSUPPORTED for anything but F32/BF16/F16. */
static duet_status_t parse_dtype(const char *path, const char *tensor, const char *s,
                                 duet_dtype_t *dt_p)
{
    if (strcmp(s, "F32") == 0)
        *dt_p = DUET_DTYPE_F32;
    else if (strcmp(s, "BF16") == 0)
        *dt_p = DUET_DTYPE_BF16;
    else if (strcmp(s, "F16") == 0)
        *dt_p = DUET_DTYPE_F16;
    else
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "%s: tensor %s: dtype \"%.32s\" is not supported (F32, BF16, F16)",
                              path, tensor, s);
    return DUET_OK;
}

/* ---- one shard ------------------------------------------------------------------------------ */

/* Validate one header entry and fill *e (name not set). */
static duet_status_t parse_entry(const char *path, const char *name, const json_t *v,
                                 uint64_t data_len, uint64_t data_start, ck_entry_t *e)
{
    if (!json_is_object(v))
        return duet_error_set(DUET_ERR_FORMAT, "%s: tensor %s: header entry is not an object", path,
                              name);
    const json_t *jd = json_object_get(v, "dtype");
    const json_t *js = json_object_get(v, "shape");
    const json_t *jo = json_object_get(v, "data_offsets");
    if (!json_is_string(jd))
        return duet_error_set(DUET_ERR_FORMAT, "%s: tensor %s: \"dtype\" missing or not a string",
                              path, name);
    if (!json_is_array(js))
        return duet_error_set(DUET_ERR_FORMAT, "%s: tensor %s: \"shape\" missing or not an array",
                              path, name);
    if (!json_is_array(jo) || json_array_size(jo) != 2)
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: tensor %s: \"data_offsets\" must be an array [begin, end]", path,
                              name);
    duet_status_t st = parse_dtype(path, name, json_string_value(jd), &e->dtype);
    if (st != DUET_OK)
        return st;

    size_t nd = json_array_size(js);
    if (nd > CK_MAX_DIMS)
        return duet_error_set(DUET_ERR_UNSUPPORTED, "%s: tensor %s: %zu dimensions (at most %d)",
                              path, name, nd, CK_MAX_DIMS);
    e->ndim = (int)nd;
    uint64_t numel = 1;
    for (size_t i = 0; i < nd; i++) {
        const json_t *d = json_array_get(js, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s: tensor %s: shape[%zu] is not a non-negative integer", path,
                                  name, i);
        e->shape[i] = (int64_t)json_integer_value(d);
        if (__builtin_mul_overflow(numel, (uint64_t)e->shape[i], &numel))
            return duet_error_set(DUET_ERR_FORMAT, "%s: tensor %s: shape overflows", path, name);
    }
    uint64_t off[2];
    for (int i = 0; i < 2; i++) {
        const json_t *o = json_array_get(jo, (size_t)i);
        if (!json_is_integer(o) || json_integer_value(o) < 0)
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s: tensor %s: data_offsets[%d] is not a non-negative integer",
                                  path, name, i);
        off[i] = (uint64_t)json_integer_value(o);
    }
    if (off[0] > off[1] || off[1] > data_len)
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: tensor %s: data_offsets [%" PRIu64 ", %" PRIu64
                              "] outside the data area of %" PRIu64 " bytes",
                              path, name, off[0], off[1], data_len);
    uint64_t bytes;
    if (__builtin_mul_overflow(numel, (uint64_t)duet_dtype_size(e->dtype), &bytes) ||
        bytes != off[1] - off[0]) {
        char sh[160];
        format_shape(e->shape, e->ndim, sh, sizeof(sh));
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: tensor %s: shape %s of %s needs %" PRIu64
                              " bytes but data_offsets span %" PRIu64,
                              path, name, sh, json_string_value(jd), bytes, off[1] - off[0]);
    }
    if ((data_start + off[0]) % duet_dtype_size(e->dtype) != 0)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "%s: tensor %s: data at file offset %" PRIu64
                              " is not aligned to its %zu-byte elements",
                              path, name, data_start + off[0], duet_dtype_size(e->dtype));
    e->begin = off[0];
    e->end = off[1];
    return DUET_OK;
}

static int cmp_begin(const void *a, const void *b)
{
    const ck_entry_t *x = *(const ck_entry_t *const *)a, *y = *(const ck_entry_t *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Entries [first, ck->n_entries) came from one shard: no two may share a byte. */
static duet_status_t check_overlaps(duet_checkpoint_t *ck, int64_t first, const char *path)
{
    int64_t n = ck->n_entries - first;
    if (n < 2)
        return DUET_OK;
    ck_entry_t **order = malloc((size_t)n * sizeof(*order));
    if (order == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", path);
    for (int64_t i = 0; i < n; i++)
        order[i] = &ck->entries[first + i];
    qsort(order, (size_t)n, sizeof(*order), cmp_begin);
    duet_status_t st = DUET_OK;
    const ck_entry_t *prev = NULL;
    for (int64_t i = 0; i < n; i++) {
        const ck_entry_t *e = order[i];
        if (e->begin == e->end)
            continue; /* empty tensors own no bytes */
        if (prev != NULL && e->begin < prev->end) {
            st =
                duet_error_set(DUET_ERR_FORMAT,
                               "%s: tensor %s: data_offsets [%" PRIu64 ", %" PRIu64
                               "] overlap tensor %s [%" PRIu64 ", %" PRIu64 "]",
                               path, e->name, e->begin, e->end, prev->name, prev->begin, prev->end);
            break;
        }
        prev = e;
    }
    free(order);
    return st;
}

/* Map and validate shard `idx` (ck->shards[idx].path set), appending its tensors. */
static duet_status_t open_shard(duet_checkpoint_t *ck, int idx)
{
    ck_shard_t *sh = &ck->shards[idx];
    const char *path = sh->path;

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return duet_error_set(errno == ENOENT ? DUET_ERR_NOT_FOUND : DUET_ERR_IO, "%s: %s", path,
                              strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return duet_error_set(DUET_ERR_IO, "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return duet_error_set(DUET_ERR_FORMAT, "%s: not a regular file", path);
    }
    uint64_t size = (uint64_t)sb.st_size;
    if (size < 8) {
        close(fd);
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: %" PRIu64 " bytes, too short for a safetensors header", path,
                              size);
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int merr = errno;
    close(fd);
    if (map == MAP_FAILED)
        return duet_error_set(DUET_ERR_IO, "%s: mmap: %s", path, strerror(merr));
    sh->map = map;
    sh->map_len = (size_t)size;

    char hs[32];
    human_size(size, hs, sizeof(hs));
    const char *base = strrchr(path, '/');
    DUET_LOG_INFO("loading shard %d/%d %s (%s)", idx + 1, ck->n_shards,
                  base != NULL ? base + 1 : path, hs);
    if (size >= CK_PREFETCH_MIN) {
        /* Start reading ahead now; the first matmul would otherwise fault page by page. */
        if (madvise(map, (size_t)size, MADV_WILLNEED) == 0)
            DUET_LOG_INFO("prefetching %s of %s in the background", hs,
                          base != NULL ? base + 1 : path);
        else
            DUET_LOG_WARN("%s: madvise(MADV_WILLNEED): %s", path, strerror(errno));
    }

    const uint8_t *p = map;
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++)
        hl |= (uint64_t)p[i] << (8 * i);
    if (hl < 2 || hl > CK_MAX_HEADER || hl > size - 8)
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: header length %" PRIu64 " is invalid (file is %" PRIu64
                              " bytes, cap %" PRIu64 ")",
                              path, hl, size, CK_MAX_HEADER);

    json_error_t jerr;
    json_t *root = json_loadb((const char *)p + 8, (size_t)hl, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL)
        return duet_error_set(DUET_ERR_FORMAT, "%s: header is not valid JSON (%d:%d: %s)", path,
                              jerr.line, jerr.column, jerr.text);
    duet_status_t st = DUET_OK;
    if (!json_is_object(root)) {
        st = duet_error_set(DUET_ERR_FORMAT, "%s: header is not a JSON object", path);
        goto out_json;
    }

    const uint64_t data_start = 8 + hl;
    const uint64_t data_len = size - data_start;
    const int64_t first = ck->n_entries;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(v)) {
                st = duet_error_set(DUET_ERR_FORMAT, "%s: \"__metadata__\" is not an object", path);
                goto out_json;
            }
            continue;
        }
        ck_entry_t *e = NULL;
        st = push_entry(ck, &e);
        if (st != DUET_OK)
            goto out_json;
        st = parse_entry(path, key, v, data_len, data_start, e);
        if (st != DUET_OK)
            goto out_json;
        e->name = strdup(key);
        if (e->name == NULL) {
            st = duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", path);
            goto out_json;
        }
        e->data = p + data_start + e->begin;
        e->shard = idx;
        ck->n_entries++;
    }
    st = check_overlaps(ck, first, path);

out_json:
    json_decref(root);
    return st;
}

/* ---- the index ------------------------------------------------------------------------------ */

static int shard_name_ok(const char *s)
{
    return s[0] != '\0' && strchr(s, '/') == NULL && strchr(s, '\\') == NULL &&
           strstr(s, "..") == NULL;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Load the index: the weight map (kept for the final cross-check) and the sorted shard names. */
static duet_status_t load_index(const char *path, json_t **root_p, const json_t **map_p,
                                const char ***names_p, int *n_p)
{
    json_error_t jerr;
    struct stat sb;
    if (stat(path, &sb) != 0)
        return duet_error_set(DUET_ERR_IO, "%s: %s", path, strerror(errno));
    if ((uint64_t)sb.st_size > CK_MAX_INDEX)
        return duet_error_set(DUET_ERR_RANGE, "%s: %lld bytes, over the 64 MiB cap", path,
                              (long long)sb.st_size);
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL)
        return duet_error_set(DUET_ERR_FORMAT, "%s:%d:%d: invalid JSON: %s", path, jerr.line,
                              jerr.column, jerr.text);
    const json_t *map = json_is_object(root) ? json_object_get(root, "weight_map") : NULL;
    if (!json_is_object(map) || json_object_size(map) == 0) {
        json_decref(root);
        return duet_error_set(DUET_ERR_FORMAT, "%s: \"weight_map\" missing, empty or not an object",
                              path);
    }
    size_t n = json_object_size(map), k = 0;
    const char **names = malloc(n * sizeof(*names));
    if (names == NULL) {
        json_decref(root);
        return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", path);
    }
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)map, key, v)
    {
        if (!json_is_string(v) || !shard_name_ok(json_string_value(v))) {
            duet_error_set(DUET_ERR_FORMAT,
                           "%s: tensor %s: shard file name must be a plain file name in the "
                           "checkpoint folder (got %s%.200s%s)",
                           path, key, json_is_string(v) ? "\"" : "",
                           json_is_string(v) ? json_string_value(v) : "a non-string",
                           json_is_string(v) ? "\"" : "");
            free(names);
            json_decref(root);
            return DUET_ERR_FORMAT;
        }
        names[k++] = json_string_value(v);
    }
    qsort(names, k, sizeof(*names), cmp_str);
    size_t u = 0;
    for (size_t i = 0; i < k; i++)
        if (u == 0 || strcmp(names[u - 1], names[i]) != 0)
            names[u++] = names[i];
    *root_p = root;
    *map_p = map;
    *names_p = names;
    *n_p = (int)u;
    return DUET_OK;
}

/* ---- public --------------------------------------------------------------------------------- */

static duet_status_t open_all(duet_checkpoint_t *ck)
{
    duet_status_t st;
    struct stat sb;
    char *single = path_join(ck->dir, CK_SINGLE_NAME);
    char *index = path_join(ck->dir, CK_INDEX_NAME);
    json_t *iroot = NULL;
    const json_t *wmap = NULL;
    const char **names = NULL;
    int n = 0;
    if (single == NULL || index == NULL) {
        st = duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", ck->dir);
        goto out;
    }

    if (stat(single, &sb) == 0) {
        static const char *one[1] = {CK_SINGLE_NAME};
        names = malloc(sizeof(*names));
        if (names == NULL) {
            st = duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", ck->dir);
            goto out;
        }
        names[0] = one[0];
        n = 1;
        ck->where = single;
        single = NULL;
    } else if (stat(index, &sb) == 0) {
        st = load_index(index, &iroot, &wmap, &names, &n);
        if (st != DUET_OK)
            goto out;
        ck->where = strdup(index);
        if (ck->where == NULL) {
            st = duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", ck->dir);
            goto out;
        }
    } else {
        st = duet_error_set(DUET_ERR_NOT_FOUND, "%s: neither %s nor %s found", ck->dir,
                            CK_SINGLE_NAME, CK_INDEX_NAME);
        goto out;
    }

    ck->shards = calloc((size_t)n, sizeof(*ck->shards));
    if (ck->shards == NULL) {
        st = duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", ck->dir);
        goto out;
    }
    ck->n_shards = n;
    for (int i = 0; i < n; i++) {
        ck->shards[i].path = path_join(ck->dir, names[i]);
        if (ck->shards[i].path == NULL) {
            st = duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", ck->dir);
            goto out;
        }
    }
    for (int i = 0; i < n; i++) {
        st = open_shard(ck, i);
        if (st != DUET_OK)
            goto out;
    }

    if (ck->n_entries > 1) /* shards of no tensors leave entries NULL: qsort's is nonnull */
        qsort(ck->entries, (size_t)ck->n_entries, sizeof(*ck->entries), entry_cmp_name);
    for (int64_t i = 1; i < ck->n_entries; i++) {
        const ck_entry_t *a = &ck->entries[i - 1], *b = &ck->entries[i];
        if (strcmp(a->name, b->name) == 0) {
            st = duet_error_set(DUET_ERR_FORMAT, "%s: tensor %s appears in both %s and %s", ck->dir,
                                a->name, ck->shards[a->shard].path, ck->shards[b->shard].path);
            goto out;
        }
    }

    if (wmap != NULL) {
        const char *key;
        json_t *v;
        json_object_foreach((json_t *)wmap, key, v)
        {
            const ck_entry_t *e = find_entry(ck, key);
            const char *want = json_string_value(v);
            const char *have = e != NULL ? strrchr(ck->shards[e->shard].path, '/') + 1 : "";
            if (e == NULL || strcmp(have, want) != 0) {
                st = duet_error_set(DUET_ERR_FORMAT,
                                    "%s: tensor %s: the index places it in %s/%s, which does not "
                                    "contain it",
                                    index, key, ck->dir, want);
                goto out;
            }
        }
    }
    st = DUET_OK;

out:
    free(names);
    json_decref(iroot);
    free(single);
    free(index);
    return st;
}

duet_status_t duet_checkpoint_open(const char *dir, duet_checkpoint_t **ck_p)
{
    if (dir == NULL || ck_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "duet_checkpoint_open: NULL argument");
    duet_checkpoint_t *ck = calloc(1, sizeof(*ck));
    if (ck == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "%s: out of memory", dir);
    size_t dl = strlen(dir);
    while (dl > 1 && dir[dl - 1] == '/')
        dl--; /* "ckpt/" and "ckpt" name files the same way in messages */
    ck->dir = strndup(dir, dl);
    if (ck->dir == NULL) {
        free(ck);
        return DUET_FAIL(DUET_ERR_NOMEM, "%s: out of memory", dir);
    }
    duet_status_t st = open_all(ck);
    if (st != DUET_OK) {
        DUET_LOG_ERROR("%s", duet_error_last());
        duet_checkpoint_close(ck);
        return st;
    }
    uint64_t total = 0;
    for (int i = 0; i < ck->n_shards; i++)
        total += ck->shards[i].map_len;
    char hs[32];
    human_size(total, hs, sizeof(hs));
    DUET_LOG_INFO("checkpoint %s: %" PRId64 " tensors in %d file(s), %s", ck->dir, ck->n_entries,
                  ck->n_shards, hs);
    *ck_p = ck;
    return DUET_OK;
}

void duet_checkpoint_close(duet_checkpoint_t *ck)
{
    if (ck == NULL)
        return;
    for (int64_t i = 0; i < ck->n_entries; i++)
        free(ck->entries[i].name);
    free(ck->entries);
    for (int i = 0; i < ck->n_shards; i++) {
        if (ck->shards[i].map != NULL)
            munmap(ck->shards[i].map, ck->shards[i].map_len);
        free(ck->shards[i].path);
    }
    free(ck->shards);
    free(ck->where);
    free(ck->dir);
    free(ck);
}

int64_t duet_checkpoint_n_tensors(const duet_checkpoint_t *ck)
{
    return ck->n_entries;
}

const char *duet_checkpoint_tensor_name(const duet_checkpoint_t *ck, int64_t i)
{
    if (i < 0 || i >= ck->n_entries)
        return NULL;
    return ck->entries[i].name;
}

static duet_status_t entry_view(const duet_checkpoint_t *ck, const ck_entry_t *e,
                                duet_tensor_t *t_p)
{
    if (e->ndim > DUET_TENSOR_MAX_DIMS)
        return duet_error_set(DUET_ERR_UNSUPPORTED, "%s: tensor %s: %d dimensions (at most %d)",
                              ck->shards[e->shard].path, e->name, e->ndim, DUET_TENSOR_MAX_DIMS);
    duet_tensor_t t;
    memset(&t, 0, sizeof(t));
    t.data = (void *)e->data; /* read-only mapping: views must not be written */
    t.dtype = e->dtype;
    t.device = DUET_DEVICE_CPU;
    t.ndim = e->ndim;
    for (int i = 0; i < e->ndim; i++)
        t.shape[i] = e->shape[i];
    *t_p = t;
    return DUET_OK;
}

duet_status_t duet_checkpoint_get(const duet_checkpoint_t *ck, const char *name, duet_tensor_t *t_p)
{
    const ck_entry_t *e = find_entry(ck, name);
    if (e == NULL)
        return duet_error_set(DUET_ERR_NOT_FOUND, "%s: tensor %s not found in the checkpoint",
                              ck->where, name);
    return entry_view(ck, e, t_p);
}

duet_status_t duet_checkpoint_get_shaped(duet_checkpoint_t *ck, const char *name, int ndim,
                                         const int64_t *dims, duet_tensor_t *t_p)
{
    ck_entry_t *e = (ck_entry_t *)find_entry(ck, name);
    if (e == NULL)
        return duet_error_set(DUET_ERR_NOT_FOUND, "%s: tensor %s not found in the checkpoint",
                              ck->where, name);
    int same = e->ndim == ndim;
    for (int i = 0; same && i < ndim; i++)
        same = e->shape[i] == dims[i];
    if (!same) {
        char have[200], want[200];
        format_shape(e->shape, e->ndim, have, sizeof(have));
        format_shape(dims, ndim, want, sizeof(want));
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: tensor %s: shape %s does not match the config's %s",
                              ck->shards[e->shard].path, name, have, want);
    }
    duet_status_t st = entry_view(ck, e, t_p);
    if (st != DUET_OK)
        return st;
    if (!e->used) {
        e->used = 1;
        ck->n_used++;
    }
    return DUET_OK;
}

int64_t duet_checkpoint_n_unused(const duet_checkpoint_t *ck)
{
    return ck->n_entries - ck->n_used;
}

/* Linear scan: meant for logging the first few names, not for iterating thousands. */
const char *duet_checkpoint_unused_name(const duet_checkpoint_t *ck, int64_t i)
{
    if (i < 0)
        return NULL;
    for (int64_t j = 0; j < ck->n_entries; j++)
        if (!ck->entries[j].used && i-- == 0)
            return ck->entries[j].name;
    return NULL;
}

const char *duet_checkpoint_tensor_file(const duet_checkpoint_t *ck, const char *name)
{
    const ck_entry_t *e = find_entry(ck, name);
    return e != NULL ? ck->shards[e->shard].path : NULL;
}

const char *duet_checkpoint_where(const duet_checkpoint_t *ck)
{
    return ck->where;
}

duet_dtype_t duet_checkpoint_dtype(const duet_checkpoint_t *ck)
{
    /* indexed by duet_dtype_t; the order below breaks ties toward the wider type */
    uint64_t bytes[3] = {0, 0, 0};
    for (int64_t i = 0; i < ck->n_entries; i++)
        bytes[ck->entries[i].dtype] += ck->entries[i].end - ck->entries[i].begin;
    static const duet_dtype_t order[3] = {DUET_DTYPE_F32, DUET_DTYPE_BF16, DUET_DTYPE_F16};
    duet_dtype_t best = DUET_DTYPE_F32;
    for (int i = 0; i < 3; i++)
        if (bytes[order[i]] > bytes[best])
            best = order[i];
    return best;
}
