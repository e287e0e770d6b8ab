/* Device discovery when the CUDA backend is not compiled in: there is no device to use. */
#include "kernels/kernels.h"

#ifndef DUET_HAVE_CUDA
#include <stdio.h>

int duet_cuda_device_count(void)
{
    return 0;
}

int duet_cuda_device_usable(char *why, size_t cap)
{
    if (why != NULL && cap > 0)
        snprintf(why, cap,
                 "this binary was built without the CUDA backend (no nvcc at build "
                 "time)");
    return 0;
}
#endif
