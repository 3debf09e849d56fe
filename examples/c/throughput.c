/* C async read throughput, to set beside `gpuio bench` on the same file: QD requests in
 * flight, each with its own buffer (on a GPU, its own stream and device buffer), reading
 * BS-byte blocks in sequence (block k at k * BS, wrapping at the end of the file), for SECONDS.
 * Each completion callback starts that slot's next read, as each of bench's tasks does. The
 * engine gets the settings bench gives it for the same --bs and --qd.
 *
 *   throughput FILE [--bs BYTES] [--qd N] [--seconds S] [--gpu N] [--direct]
 *
 * Prints one line: "c-async ... GB/s". */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_loader.h"
#include "gpuio.h"

struct run {
    gpuio_file *file;
    uint64_t bs, blocks;
    double deadline;
    pthread_mutex_t lock;
    pthread_cond_t idle;
    uint64_t next_block, bytes, running;
    gpuio_status error;
    char message[512];
};

struct slot {
    struct run *run;
    gpuio_buffer buf;
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void start(struct slot *slot);

/* Runs on a gpuio executor thread: count, then start the slot's next read (not blocking). */
static void done(gpuio_request *req, gpuio_status status, uint64_t bytes, void *user) {
    struct slot *slot = user;
    struct run *r = slot->run;
    gpuio_request_free(req);
    pthread_mutex_lock(&r->lock);
    r->bytes += bytes;
    if (status != GPUIO_OK && r->error == GPUIO_OK) {
        r->error = status;
        snprintf(r->message, sizeof r->message, "%s", gpuio_last_error());
    }
    int again = status == GPUIO_OK && now() < r->deadline;
    if (!again) {
        r->running--;
        pthread_cond_broadcast(&r->idle);
    }
    pthread_mutex_unlock(&r->lock);
    if (again) start(slot);
}

static void start(struct slot *slot) {
    struct run *r = slot->run;
    pthread_mutex_lock(&r->lock);
    uint64_t block = r->next_block++ % r->blocks;
    pthread_mutex_unlock(&r->lock);
    gpuio_request *req = NULL;
    gpuio_status s = gpuio_read_async(r->file, &slot->buf, block * r->bs, done, slot, &req);
    if (s != GPUIO_OK) {
        pthread_mutex_lock(&r->lock);
        if (r->error == GPUIO_OK) {
            r->error = s;
            snprintf(r->message, sizeof r->message, "%s", gpuio_last_error());
        }
        r->running--;
        pthread_cond_broadcast(&r->idle);
        pthread_mutex_unlock(&r->lock);
    }
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE [--bs BYTES] [--qd N] [--seconds S] [--gpu N] [--direct]\n",
                argv[0]);
        return 2;
    }
    uint64_t bs = 1 << 20, qd = 32;
    double seconds = 5;
    int gpu = -1, direct = 0;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--direct")) direct = 1;
        else if (i + 1 < argc && !strcmp(argv[i], "--bs")) bs = strtoull(argv[++i], NULL, 0);
        else if (i + 1 < argc && !strcmp(argv[i], "--qd")) qd = strtoull(argv[++i], NULL, 0);
        else if (i + 1 < argc && !strcmp(argv[i], "--seconds")) seconds = atof(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--gpu")) gpu = atoi(argv[++i]);
        else return fprintf(stderr, "unknown argument %s\n", argv[i]), 2;
    }
    if (bs == 0 || qd == 0 || seconds <= 0) return fprintf(stderr, "bad --bs/--qd/--seconds\n"), 2;
    if (gpu >= 0 && cuda_load(gpu)) return fprintf(stderr, "--gpu %d: %s\n", gpu, cuda_why), 1;

    /* bench's engine settings for this --bs and --qd (gpuio-cli/src/bench.rs, measure()): the
     * engine's defaults, with the queue depth and the pool raised to what QD requests need. */
    gpuio_sizing base;
    if (gpuio_engine_sizing(NULL, &base)) return fprintf(stderr, "%s\n", gpuio_last_error()), 1;
    uint64_t chunk = direct ? base.direct_chunk : base.buffered_chunk;
    uint64_t pieces = (bs + chunk - 1) / chunk, qd_engine = qd * (pieces ? pieces : 1);
    if (qd_engine < base.queue_depth) qd_engine = base.queue_depth;
    if (qd_engine > 4096) qd_engine = 4096;
    uint64_t pool = 2 * qd * (bs > 4096 ? bs : 4096);
    if (pool < base.bounce_bytes) pool = base.bounce_bytes;
    uint64_t slots = (pool + base.bounce_block - 1) / base.bounce_block;
    if (slots < 4) slots = 4;
    if (slots > 65535) slots = 65535;
    gpuio_engine_settings settings = {0};
    settings.queue_depth = (uint32_t)qd_engine;
    settings.bounce_slots = (uint32_t)slots;

    gpuio_engine *engine = NULL;
    gpuio_status s = gpuio_engine_create(&settings, &engine);
    if (s) return fprintf(stderr, "engine: %s\n", gpuio_last_error()), 1;
    struct run r = {.bs = bs, .lock = PTHREAD_MUTEX_INITIALIZER, .idle = PTHREAD_COND_INITIALIZER};
    s = gpuio_open(engine, argv[1], GPUIO_OPEN_READ | (direct ? GPUIO_OPEN_DIRECT : 0), &r.file);
    if (s) return fprintf(stderr, "open: %s\n", gpuio_last_error()), 1;
    uint64_t size = 0;
    gpuio_file_size(r.file, &size);
    r.blocks = size / bs;
    if (r.blocks == 0) return fprintf(stderr, "%s is smaller than --bs %llu\n", argv[1],
                                      (unsigned long long)bs), 1;

    struct slot *slot = calloc(qd, sizeof *slot);
    cu_stream *streams = calloc(qd, sizeof *streams);
    for (uint64_t i = 0; i < qd; i++) {
        slot[i].run = &r;
        slot[i].buf.len = bs;
        if (gpu < 0) {
            slot[i].buf.ptr = malloc(bs);
            if (!slot[i].buf.ptr) return fprintf(stderr, "out of memory\n"), 1;
            memset(slot[i].buf.ptr, 0xa5, bs);
        } else {
            cu_ptr d = 0;
            if (cu.stream_create(&streams[i], 1) || cu.mem_alloc(&d, bs))
                return fprintf(stderr, "CUDA stream/alloc failed\n"), 1;
            slot[i].buf.ptr = (void *)(uintptr_t)d;
            slot[i].buf.kind = GPUIO_MEMORY_DEVICE;
            slot[i].buf.device = gpu;
            slot[i].buf.stream = streams[i];
        }
    }
    double t0 = now();
    r.deadline = t0 + seconds;
    r.running = qd;
    for (uint64_t i = 0; i < qd; i++) start(&slot[i]);
    pthread_mutex_lock(&r.lock);
    while (r.running > 0) pthread_cond_wait(&r.idle, &r.lock);
    pthread_mutex_unlock(&r.lock);
    if (gpu >= 0)
        for (uint64_t i = 0; i < qd; i++) cu.stream_synchronize(streams[i]);
    double elapsed = now() - t0;
    if (r.error != GPUIO_OK) {
        fprintf(stderr, "read failed: %s: %s\n", gpuio_status_name(r.error), r.message);
        return 1;
    }
    printf("c-async: %s, bs %llu, qd %llu, %s: %llu bytes in %.3f s: %.3f GB/s\n", argv[1],
           (unsigned long long)bs, (unsigned long long)qd, gpu < 0 ? "host" : "device",
           (unsigned long long)r.bytes, elapsed, (double)r.bytes / elapsed / 1e9);
    for (uint64_t i = 0; i < qd; i++) {
        if (gpu < 0) {
            free(slot[i].buf.ptr);
        } else {
            cu.mem_free((cu_ptr)(uintptr_t)slot[i].buf.ptr);
            cu.stream_destroy(streams[i]);
        }
    }
    gpuio_close(r.file);
    gpuio_engine_free(engine);
    free(slot);
    free(streams);
    return 0;
}
