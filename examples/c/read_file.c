/* Reads a file with gpuio's C API into host memory and, where CUDA is present, into device
 * memory, and prints a checksum (FNV-1a, 64 bits) of each.
 *
 *   cc -I gpuio-capi/include -I examples/c examples/c/read_file.c \
 *      -L target/release -lgpuio_capi -Wl,-rpath,target/release -ldl -o read_file
 *   ./read_file FILE [GPU]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_loader.h"
#include "gpuio.h"

static uint64_t fnv1a(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static int fail(const char *what, gpuio_status s) {
    fprintf(stderr, "%s: %s: %s\n", what, gpuio_status_name(s), gpuio_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s FILE [GPU]\n", argv[0]);
        return 2;
    }
    int gpu = argc == 3 ? atoi(argv[2]) : 0;
    gpuio_engine *engine = NULL;
    gpuio_status s = gpuio_engine_create(NULL, &engine); /* NULL settings: the defaults */
    if (s) return fail("gpuio_engine_create", s);
    char backend[512];
    gpuio_engine_backend(engine, backend, sizeof backend, NULL); /* truncated is fine here */
    printf("gpuio %s, backend %s\n", gpuio_version(), backend);

    gpuio_file *file = NULL;
    if ((s = gpuio_open(engine, argv[1], GPUIO_OPEN_READ, &file))) return fail("gpuio_open", s);
    uint64_t size = 0;
    if ((s = gpuio_file_size(file, &size))) return fail("gpuio_file_size", s);

    uint8_t *host = malloc(size ? size : 1);
    if (!host) return fprintf(stderr, "out of memory\n"), 1;
    gpuio_buffer dst = {.ptr = host, .len = size}; /* kind 0: host memory */
    uint64_t n = 0;
    if ((s = gpuio_read(file, &dst, 0, &n))) return fail("gpuio_read (host)", s);
    uint64_t host_sum = fnv1a(host, n);
    printf("host:   %llu bytes, fnv1a64 %016llx\n", (unsigned long long)n,
           (unsigned long long)host_sum);

    if (cuda_load(gpu)) {
        printf("device: skipped (%s)\n", cuda_why);
    } else {
        cu_ptr dev = 0;
        if (cu.mem_alloc(&dev, size ? size : 1)) return fprintf(stderr, "cuMemAlloc failed\n"), 1;
        /* No stream: the data is in device memory when gpuio_read returns. */
        gpuio_buffer ddst = {.ptr = (void *)(uintptr_t)dev, .len = size,
                             .kind = GPUIO_MEMORY_DEVICE, .device = gpu, .stream = NULL};
        if ((s = gpuio_read(file, &ddst, 0, &n))) return fail("gpuio_read (device)", s);
        memset(host, 0, size);
        if (cu.memcpy_dtoh(host, dev, n)) return fprintf(stderr, "cuMemcpyDtoH failed\n"), 1;
        uint64_t dev_sum = fnv1a(host, n);
        printf("device: %llu bytes, fnv1a64 %016llx (GPU %d) %s\n", (unsigned long long)n,
               (unsigned long long)dev_sum, gpu, dev_sum == host_sum ? "match" : "MISMATCH");
        cu.mem_free(dev);
        if (dev_sum != host_sum) return 1;
    }
    gpuio_close(file);
    gpuio_engine_free(engine);
    free(host);
    return 0;
}
