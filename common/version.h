/*
 * What a binary was built from, for `--version` on every duet binary: the release version, the git
 * commit of the source tree (with "-dirty" when it had uncommitted changes), the build type, and
 * whether the CUDA backend is compiled in with which GPU architectures.
 */
#ifndef DUET_COMMON_VERSION_H
#define DUET_COMMON_VERSION_H

#include <stdbool.h>

/* "0.1.0 (commit 1a2b3c4d5e6f, RelWithDebInfo, CUDA on: sm_90, sm_90a)"; static storage. */
const char *duet_version_string(void);

/* Print "PROG VERSION-STRING\n" on stdout (what `PROG --version` shows). */
void duet_version_print(const char *prog);

/*
 * For programs with their own option loop: true when argv[i] is "--version"; then the caller
 * prints duet_version_print and exits 0.
 */
bool duet_version_flag(const char *arg);

#endif
