/* The few CUDA driver calls the C examples and tests use, loaded with dlopen so that they
 * build without CUDA headers and run (host memory only) on machines without CUDA.
 * cuda_load() returns 0, or -1 with the reason in cuda_why. */
#ifndef GPUIO_CUDA_LOADER_H
#define GPUIO_CUDA_LOADER_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef int cu_result;           /* CUresult */
typedef int cu_device;           /* CUdevice */
typedef void *cu_context;        /* CUcontext */
typedef void *cu_stream;         /* CUstream */
typedef unsigned long long cu_ptr; /* CUdeviceptr */

struct cuda_api {
    cu_result (*init)(unsigned);
    cu_result (*device_get_count)(int *);
    cu_result (*device_get)(cu_device *, int);
    cu_result (*primary_ctx_retain)(cu_context *, cu_device);
    cu_result (*ctx_set_current)(cu_context);
    cu_result (*mem_alloc)(cu_ptr *, size_t);
    cu_result (*mem_free)(cu_ptr);
    cu_result (*memcpy_dtoh)(void *, cu_ptr, size_t);
    cu_result (*memcpy_htod)(cu_ptr, const void *, size_t);
    cu_result (*memset_d8)(cu_ptr, unsigned char, size_t);
    cu_result (*stream_create)(cu_stream *, unsigned);
    cu_result (*stream_synchronize)(cu_stream);
    cu_result (*stream_destroy)(cu_stream);
    cu_result (*ctx_synchronize)(void);
};

static struct cuda_api cu;
static char cuda_why[256];

#define CUDA_SYM(field, name)                                                   \
    if (!(*(void **)&cu.field = dlsym(lib, name))) {                            \
        snprintf(cuda_why, sizeof cuda_why, "libcuda.so.1 lacks %s", name);     \
        return -1;                                                              \
    }

/* Loads libcuda, initialises it, and makes device `device`'s primary context current (the
 * context gpuio uses for that device). */
static int cuda_load(int device) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(cuda_why, sizeof cuda_why, "no CUDA driver: %s", dlerror());
        return -1;
    }
    CUDA_SYM(init, "cuInit");
    CUDA_SYM(device_get_count, "cuDeviceGetCount");
    CUDA_SYM(device_get, "cuDeviceGet");
    CUDA_SYM(primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    CUDA_SYM(ctx_set_current, "cuCtxSetCurrent");
    CUDA_SYM(mem_alloc, "cuMemAlloc_v2");
    CUDA_SYM(mem_free, "cuMemFree_v2");
    CUDA_SYM(memcpy_dtoh, "cuMemcpyDtoH_v2");
    CUDA_SYM(memcpy_htod, "cuMemcpyHtoD_v2");
    CUDA_SYM(memset_d8, "cuMemsetD8_v2");
    CUDA_SYM(stream_create, "cuStreamCreate");
    CUDA_SYM(stream_synchronize, "cuStreamSynchronize");
    CUDA_SYM(stream_destroy, "cuStreamDestroy_v2");
    CUDA_SYM(ctx_synchronize, "cuCtxSynchronize");
    int n = 0;
    cu_result r = cu.init(0);
    if (r == 0) r = cu.device_get_count(&n);
    if (r != 0) {
        snprintf(cuda_why, sizeof cuda_why, "cuInit/cuDeviceGetCount failed: CUresult %d", r);
        return -1;
    }
    if (device >= n) {
        snprintf(cuda_why, sizeof cuda_why, "no GPU %d: this machine has %d", device, n);
        return -1;
    }
    cu_device dev;
    cu_context ctx;
    if ((r = cu.device_get(&dev, device)) || (r = cu.primary_ctx_retain(&ctx, dev)) ||
        (r = cu.ctx_set_current(ctx))) {
        snprintf(cuda_why, sizeof cuda_why, "setting up GPU %d failed: CUresult %d", device, r);
        return -1;
    }
    return 0;
}

#endif
