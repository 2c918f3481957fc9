/* backend.c — which backend runs a session (backend.h). */
#include "backend.h"

extern const smoe_backend smoe_backend_cpu; /* cpu/backend_cpu.c */
#if SMOE_CUDA
extern const smoe_backend smoe_backend_cuda; /* cuda/backend_cuda.c */
#endif

smoe_status smoe_backend_for(smoe_device device, const smoe_backend **out) {
    *out = NULL;
    switch (device) {
    case SMOE_DEVICE_CPU:
        *out = &smoe_backend_cpu;
        return SMOE_OK;
    case SMOE_DEVICE_CUDA:
#if SMOE_CUDA
        *out = &smoe_backend_cuda;
        return SMOE_OK;
#else
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "device cuda: this libsmoe was built without CUDA (build it with "
                                               "`make CUDA=1` on a machine with nvcc)");
#endif
    default:
        return smoe_fail(SMOE_ERR_INVALID_ARG, "device %u is not a smoe_device (0 cpu, 1 cuda)", (unsigned)device);
    }
}
