/*
 * Walking one libyaml document, strictly and within bounds: the helpers both YAML readers use,
 * the binaries' --config (common/config.c) and `duet up`'s cluster file
 * (deploy/launcher/cluster.c), so that both refuse the same bad input the same way and word it
 * alike ("<file>:<line>: <what>: ...").
 *
 * libyaml's document loader resolves anchors and aliases into a shared node graph: an alias may
 * point at the mapping that holds it (a cycle) or fan out exponentially. So a walk counts the
 * pairs it visits (DUET_YAML_MAX_NODES) and the depth it nests (DUET_YAML_MAX_DEPTH).
 */
#ifndef DUET_COMMON_YAML_H
#define DUET_COMMON_YAML_H

#include <stdbool.h>
#include <stddef.h>

#include <yaml.h>

#include "common/status.h"

#define DUET_YAML_MAX_DEPTH 16     /* mappings nested in mappings */
#define DUET_YAML_MAX_NODES 100000 /* pairs one walk visits */

/* How messages name a node's kind. */
typedef enum {
    DUET_YAML_WORDS_YAML,  /* "a scalar", "a sequence", "a mapping" (config.c) */
    DUET_YAML_WORDS_PLAIN, /* "a single value", "a list", "a mapping" (the launcher) */
} duet_yaml_words_t;

/* One walk over a loaded document; set name and words, duet_yaml_load sets the rest. */
typedef struct {
    yaml_document_t *doc;
    const char *name;        /* file name for messages */
    duet_yaml_words_t words; /* how kinds are named */
    size_t nodes;            /* pairs visited, against DUET_YAML_MAX_NODES */
} duet_yaml_walk_t;

/* Walks the root: NULL for an empty file or a null document, else a mapping. */
typedef duet_status_t (*duet_yaml_root_fn)(duet_yaml_walk_t *w, yaml_node_t *root, void *user);

/*
 * Parse text[0..len) (at most max_bytes) as exactly one YAML document and call fn on its root.
 * Refused with a message naming w->name: too long (DUET_ERR_RANGE), a syntax error (line and
 * column), a top level other than a mapping or null, a second document (DUET_ERR_FORMAT); fn's
 * own error is returned as it is. Nothing stays allocated.
 */
duet_status_t duet_yaml_load(duet_yaml_walk_t *w, const char *text, size_t len, size_t max_bytes,
                             duet_yaml_root_fn fn, void *user);

/* The node's 1-based line. */
size_t duet_yaml_line(const yaml_node_t *n);

/* "a scalar" / "a single value", ... in the walk's words. */
const char *duet_yaml_kind(const duet_yaml_walk_t *w, const yaml_node_t *n);

/* Whether n is a plain (unquoted) scalar spelled as one of `words` (NULL-terminated). */
bool duet_yaml_plain_in(const yaml_node_t *n, const char *const *words);

/* Whether n is YAML's null: a plain empty, ~, null, Null or NULL. */
bool duet_yaml_is_null(const yaml_node_t *n);

/* Whether a scalar's text holds no NUL byte (libyaml keeps them; C strings would stop there). */
bool duet_yaml_nul_free(const yaml_node_t *n);

/* Whether n is a mapping without pairs. */
bool duet_yaml_mapping_empty(const yaml_node_t *n);

/*
 * The key and value nodes of one mapping pair, counted against the walk's bound. The key must
 * be a scalar: "<name>:<line>: <section>: a key must be a plain name, not <kind>" (no section
 * part when section is ""). What the key's text must look like is the caller's to check.
 */
duet_status_t duet_yaml_pair(duet_yaml_walk_t *w, const yaml_node_pair_t *pair, const char *section,
                             yaml_node_t **key_p, yaml_node_t **val_p);

/* DUET_ERR_FORMAT naming n's line when depth (the caller's count of nesting) exceeds the bound. */
duet_status_t duet_yaml_depth(const duet_yaml_walk_t *w, const yaml_node_t *n, const char *section,
                              int depth);

/*
 * The text of a single value: a scalar ("<what>: expected <expected>, got <kind>"), not null
 * ("no value given", DUET_ERR_INVALID), without a NUL byte. Messages name w->name:line.
 */
duet_status_t duet_yaml_scalar(const duet_yaml_walk_t *w, const yaml_node_t *n, size_t line,
                               const char *what, const char *expected, const char **text_p);

#endif
