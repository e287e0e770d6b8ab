/*
 * version.c: the build facts behind --version. The commit comes from a header the build rewrites
 * when HEAD moves (cmake/git_commit.cmake); the rest from the configure step.
 */
#include "common/version.h"

#include <stdio.h>
#include <string.h>

#include "duet_git_commit.h"

#ifdef DUET_HAVE_CUDA
#define DUET__CUDA_TEXT "CUDA on: " DUET_CUDA_ARCH_TEXT
#else
#define DUET__CUDA_TEXT "CUDA off"
#endif

const char *duet_version_string(void)
{
    return DUET_VERSION " (commit " DUET_GIT_COMMIT ", " DUET_BUILD_TYPE ", " DUET__CUDA_TEXT ")";
}

void duet_version_print(const char *prog)
{
    printf("%s %s\n", prog, duet_version_string());
}

bool duet_version_flag(const char *arg)
{
    return arg != NULL && strcmp(arg, "--version") == 0;
}
