/* runtime.cu — the CUDA backend's device allocator, upload path, streams, events and graphs (cuda_ops.h; the rule of cuda_common.cuh). */
#include "cuda_common.cuh"

extern "C" const char *smoe_cu_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

extern "C" int smoe_cu_device(int ordinal, char *name, size_t cap, int *sm_major, int *sm_minor, size_t *free_bytes,
                              size_t *total_bytes) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) return (int)e;
    if (ordinal >= count) return (int)cudaErrorInvalidDevice;
    if ((e = cudaSetDevice(ordinal)) != cudaSuccess) return (int)e;
    cudaDeviceProp p;
    if ((e = cudaGetDeviceProperties(&p, ordinal)) != cudaSuccess) return (int)e;
    if (name && cap) {
        size_t i = 0;
        for (; i + 1 < cap && p.name[i]; i++) name[i] = p.name[i];
        name[i] = 0;
    }
    *sm_major = p.major;
    *sm_minor = p.minor;
    return (int)cudaMemGetInfo(free_bytes, total_bytes);
}

extern "C" int smoe_cu_alloc(void **p, size_t bytes) { return (int)cudaMalloc(p, bytes ? bytes : 256); }
extern "C" int smoe_cu_out_of_memory(int err) { return err == (int)cudaErrorMemoryAllocation; }
extern "C" void smoe_cu_free(void *p) { if (p) cudaFree(p); }
extern "C" int smoe_cu_host_alloc(void **p, size_t bytes) { return (int)cudaHostAlloc(p, bytes ? bytes : 64, cudaHostAllocDefault); }
extern "C" void smoe_cu_host_free(void *p) { if (p) cudaFreeHost(p); }
extern "C" int smoe_cu_host_register(void *p, size_t bytes) { return (int)cudaHostRegister(p, bytes, cudaHostRegisterDefault); }
extern "C" void smoe_cu_host_unregister(void *p) { if (p) cudaHostUnregister(p); }
extern "C" int smoe_cu_upload(void *dst, const void *src, size_t bytes, smoe_cu_stream st) {
    return (int)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, (cudaStream_t)st);
}
extern "C" int smoe_cu_download(void *dst, const void *src, size_t bytes, smoe_cu_stream st) {
    return (int)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)st);
}
extern "C" int smoe_cu_copy(void *dst, const void *src, size_t bytes, smoe_cu_stream st) {
    return (int)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)st);
}
extern "C" int smoe_cu_memset(void *dst, int v, size_t bytes, smoe_cu_stream st) {
    return (int)cudaMemsetAsync(dst, v, bytes, (cudaStream_t)st);
}
extern "C" int smoe_cu_stream_new(smoe_cu_stream *st) {
    cudaStream_t s;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    *st = e == cudaSuccess ? (void *)s : NULL;
    return (int)e;
}
extern "C" void smoe_cu_stream_free(smoe_cu_stream st) { if (st) cudaStreamDestroy((cudaStream_t)st); }

extern "C" int smoe_cu_capture_begin(smoe_cu_stream st) {
    return (int)cudaStreamBeginCapture((cudaStream_t)st, cudaStreamCaptureModeThreadLocal);
}

extern "C" int smoe_cu_capture_end(smoe_cu_stream st, int keep, smoe_cu_graph *out) {
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture((cudaStream_t)st, &g);
    *out = NULL;
    if (e == cudaSuccess && keep) {
        cudaGraphExec_t x;
        e = cudaGraphInstantiate(&x, g, 0);
        if (e == cudaSuccess) *out = (void *)x;
    }
    if (g) cudaGraphDestroy(g);
    return (int)e;
}

extern "C" int smoe_cu_graph_launch(smoe_cu_graph g, smoe_cu_stream st) {
    return (int)cudaGraphLaunch((cudaGraphExec_t)g, (cudaStream_t)st);
}

extern "C" void smoe_cu_graph_free(smoe_cu_graph g) { if (g) cudaGraphExecDestroy((cudaGraphExec_t)g); }
extern "C" int smoe_cu_stream_sync(smoe_cu_stream st) { return (int)cudaStreamSynchronize((cudaStream_t)st); }
extern "C" int smoe_cu_event_new(smoe_cu_event *ev) {
    cudaEvent_t e;
    cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    *ev = r == cudaSuccess ? (void *)e : NULL;
    return (int)r;
}
extern "C" void smoe_cu_event_free(smoe_cu_event ev) { if (ev) cudaEventDestroy((cudaEvent_t)ev); }
extern "C" int smoe_cu_event_record(smoe_cu_event ev, smoe_cu_stream st) {
    return (int)cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)st);
}
extern "C" int smoe_cu_event_sync(smoe_cu_event ev) { return (int)cudaEventSynchronize((cudaEvent_t)ev); }
extern "C" int smoe_cu_stream_wait(smoe_cu_stream st, smoe_cu_event ev) {
    return (int)cudaStreamWaitEvent((cudaStream_t)st, (cudaEvent_t)ev, 0);
}
extern "C" int smoe_cu_last_error(void) { return (int)cudaGetLastError(); }

extern "C" int smoe_cu_pdl_level(void) {
    static int level = -1;
    if (level < 0) {
        const char *e = getenv("SMOE_CUDA_PDL");
        int dev = 0, major = 0;
        const bool sm90 = cudaGetDevice(&dev) == 0 &&
                          cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == 0 && major >= 9;
        level = !sm90 || (e && e[0] == '0') ? 0 : e && e[0] == '2' ? 2 : 1;
    }
    return level;
}
