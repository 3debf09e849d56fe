/* Shared by the C API tests: checks that print what failed and exit non-zero, and the
 * pattern the test files are filled with (each byte a function of its offset). */
#ifndef GPUIO_TEST_COMMON_H
#define GPUIO_TEST_COMMON_H

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpuio.h"

#define FAIL(...)                                                          \
    do {                                                                   \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);               \
        fprintf(stderr, __VA_ARGS__);                                      \
        fprintf(stderr, "\n");                                             \
        exit(1);                                                           \
    } while (0)

/* A call that must succeed. */
#define CHECK(call)                                                        \
    do {                                                                   \
        gpuio_status check_status_ = (call);                               \
        if (check_status_ != GPUIO_OK)                                     \
            FAIL("%s -> %s: %s", #call, gpuio_status_name(check_status_),  \
                 gpuio_last_error());                                      \
    } while (0)

#define EXPECT(cond)                                                       \
    do {                                                                   \
        if (!(cond)) FAIL("expected %s", #cond);                           \
    } while (0)

/* A call that must fail with `want`, its message containing `part`; prints the message. */
#define EXPECT_ERR(call, want, part)                                       \
    do {                                                                   \
        gpuio_status got_ = (call);                                        \
        if (got_ != (want))                                                \
            FAIL("%s -> %s, expected %s (%s)", #call, gpuio_status_name(got_), \
                 gpuio_status_name(want), gpuio_last_error());             \
        if (!strstr(gpuio_last_error(), (part)))                           \
            FAIL("%s: message \"%s\" lacks \"%s\"", #call, gpuio_last_error(), (part)); \
        printf("ok error %s: %s\n", gpuio_status_name(want), gpuio_last_error()); \
    } while (0)

static inline uint8_t pattern_at(uint64_t off) {
    return (uint8_t)((off * 131u) ^ (off >> 12) ^ 0x5a);
}

/* Creates `path` with `len` bytes of the pattern (plain stdio: independent of gpuio). */
static inline void make_file(const char *path, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f) FAIL("fopen %s: %s", path, strerror(errno));
    unsigned char chunk[65536];
    for (size_t at = 0; at < len;) {
        size_t n = len - at < sizeof chunk ? len - at : sizeof chunk;
        for (size_t i = 0; i < n; i++) chunk[i] = pattern_at(at + i);
        if (fwrite(chunk, 1, n, f) != n) FAIL("fwrite %s", path);
        at += n;
    }
    if (fclose(f)) FAIL("fclose %s", path);
}

/* Whether `buf` holds the pattern of file bytes [off, off + len). */
static inline void expect_pattern(const uint8_t *buf, uint64_t off, size_t len) {
    for (size_t i = 0; i < len; i++)
        if (buf[i] != pattern_at(off + i))
            FAIL("byte %zu (file offset %llu) is %u, expected %u", i,
                 (unsigned long long)(off + i), buf[i], pattern_at(off + i));
}

static inline gpuio_buffer host_buffer(void *ptr, size_t len) {
    gpuio_buffer b;
    memset(&b, 0, sizeof b);
    b.ptr = ptr;
    b.len = len;
    return b;
}

static inline char *join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (!p) FAIL("malloc");
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

#endif
