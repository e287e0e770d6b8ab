/* Device discovery when the CUDA backend is not compiled in: there is no device to use. */
#include "kernels/kernels.h"

#ifndef DUET_HAVE_CUDA
int duet_cuda_device_count(void)
{
    return 0;
}
#endif
