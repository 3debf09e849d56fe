/* Agents: two in one process over host memory (malloc): metadata exchange, READ, a prepared
 * WRITE that swaps two ranges with a notification that arrives after the data, notifications
 * on their own, descriptor lists serialised, every bad input a status with a message, and
 * deregistration waiting for a transfer in flight. The target agent is made with flags 0
 * (UCX where it loads: its metadata then carries a UCX address, unused between agents of one
 * process) or with GPUIO_AGENT_TEST_FLAGS (e.g. 1, GPUIO_AGENT_UCX_OFF) where that is set; the
 * initiator never loads UCX. */
#include <pthread.h>
#include <time.h>

#include "common.h"

#define LEN (1u << 20)
#define BIG (64u << 20)
#define BLOCK 4096u

static gpuio_desc desc(const void *p, uint64_t len) {
    gpuio_desc d;
    memset(&d, 0, sizeof d);
    d.addr = (uint64_t)(uintptr_t)p;
    d.len = len;
    return d;
}

/* The agent's metadata, asked for its size first. */
static uint8_t *metadata(gpuio_agent *a, size_t *len) {
    *len = 0;
    EXPECT(gpuio_agent_metadata(a, NULL, 0, len) == GPUIO_ERR_RANGE);
    EXPECT(*len > 0);
    uint8_t *buf = malloc(*len);
    if (!buf) FAIL("malloc");
    size_t got = 0;
    CHECK(gpuio_agent_metadata(a, buf, *len, &got));
    EXPECT(got == *len);
    return buf;
}

/* Posts and waits for `x`, polling its status at least once. */
static void run(gpuio_xfer *x) {
    CHECK(gpuio_xfer_post(x));
    gpuio_status st = gpuio_xfer_status(x);
    EXPECT(st == GPUIO_OK || st == GPUIO_PENDING);
    CHECK(gpuio_xfer_wait(x));
    CHECK(gpuio_xfer_status(x));
}

/* Waits for good for a notification to `arg`, an agent nobody sends to. */
static void *wait_forever(void *arg) {
    char from[16];
    size_t len = 0;
    static gpuio_status st;
    st = gpuio_agent_get_notif(arg, -1, from, sizeof from, NULL, NULL, 0, &len);
    if (st != GPUIO_ERR_BAD_HANDLE || !strstr(gpuio_last_error(), "freed while this call waited"))
        FAIL("a wait on a freed agent: %s: %s", gpuio_status_name(st), gpuio_last_error());
    return &st;
}

int main(void) {
    /* Large host copies on copy threads even on a small machine (with one, a transfer is
     * copied inside gpuio_xfer_post), so that deregistration meets one in flight. */
    setenv("GPUIO_AGENT_COPY_THREADS", "4", 0);
    uint32_t flags = 0;
    const char *env = getenv("GPUIO_AGENT_TEST_FLAGS");
    if (env) flags = (uint32_t)strtoul(env, NULL, 0);

    gpuio_engine *engine = NULL;
    CHECK(gpuio_engine_create(NULL, &engine));

    /* Creation: flags, names, null pointers. */
    gpuio_agent *target = NULL, *init = NULL, *other = NULL;
    EXPECT_ERR(gpuio_agent_create(engine, "x", GPUIO_AGENT_UCX_OFF | GPUIO_AGENT_UCX_REQUIRED,
                                  &other),
               GPUIO_ERR_INVALID, "contradict");
    EXPECT_ERR(gpuio_agent_create(engine, "x", 64, &other), GPUIO_ERR_INVALID,
               "unknown flag bits 0x40");
    EXPECT_ERR(gpuio_agent_create(engine, NULL, 0, &other), GPUIO_ERR_INVALID,
               "name is a null pointer");
    EXPECT_ERR(gpuio_agent_create(engine, "x", 0, NULL), GPUIO_ERR_INVALID,
               "out is a null pointer");
    EXPECT_ERR(gpuio_agent_create(engine, "", GPUIO_AGENT_UCX_OFF, &other), GPUIO_ERR_INVALID,
               "needs a name");
    EXPECT(other == NULL);
    CHECK(gpuio_agent_create(engine, "target", flags, &target));
    CHECK(gpuio_agent_create(engine, "initiator", GPUIO_AGENT_UCX_OFF | GPUIO_AGENT_NO_IPC,
                             &init));
    CHECK(gpuio_agent_create(engine, "other", GPUIO_AGENT_UCX_OFF, &other));
    printf("ok agents created (target flags %u)\n", flags);

    /* Memory: the target's holds the pattern, the initiator's starts zeroed. */
    uint8_t *tbuf = malloc(LEN), *ibuf = calloc(1, LEN);
    if (!tbuf || !ibuf) FAIL("malloc");
    for (size_t i = 0; i < LEN; i++) tbuf[i] = pattern_at(i);
    gpuio_registration *treg = NULL, *ireg = NULL, *oreg = NULL;
    EXPECT_ERR(gpuio_agent_register(target, GPUIO_MEMORY_HOST, 0, LEN, 0, &treg),
               GPUIO_ERR_INVALID, "null address");
    EXPECT_ERR(gpuio_agent_register(target, 7, (uint64_t)(uintptr_t)tbuf, LEN, 0, &treg),
               GPUIO_ERR_INVALID, "memory 7 is not");
    EXPECT_ERR(gpuio_agent_register(target, GPUIO_MEMORY_HOST, (uint64_t)(uintptr_t)tbuf, 0, 0,
                                    &treg),
               GPUIO_ERR_INVALID, "zero bytes");
    EXPECT_ERR(gpuio_agent_register(target, GPUIO_MEMORY_HOST, (uint64_t)(uintptr_t)tbuf, LEN,
                                    0, NULL),
               GPUIO_ERR_INVALID, "out is a null pointer");
    CHECK(gpuio_agent_register(target, GPUIO_MEMORY_HOST, (uint64_t)(uintptr_t)tbuf, LEN, 0,
                               &treg));
    EXPECT_ERR(gpuio_agent_register(target, GPUIO_MEMORY_HOST, (uint64_t)(uintptr_t)tbuf + 10,
                                    100, 0, &oreg),
               GPUIO_ERR_INVALID, "overlap");
    CHECK(gpuio_agent_register(init, GPUIO_MEMORY_HOST, (uint64_t)(uintptr_t)ibuf, LEN, 0,
                               &ireg));

    /* Metadata: size query, too small, garbage, own; then each loads the other. */
    size_t tlen = 0, ilen = 0, small = 0;
    uint8_t *tmeta = metadata(target, &tlen);
    uint8_t *imeta = metadata(init, &ilen);
    EXPECT_ERR(gpuio_agent_metadata(target, tmeta, tlen - 1, &small), GPUIO_ERR_RANGE,
               "do not fit");
    EXPECT(small == tlen);
    EXPECT_ERR(gpuio_agent_metadata(target, tmeta, tlen, NULL), GPUIO_ERR_INVALID,
               "len is a null pointer");
    EXPECT_ERR(gpuio_agent_metadata(target, NULL, 5, &small), GPUIO_ERR_INVALID,
               "null pointer with a capacity");
    const uint8_t garbage[] = "this is no metadata";
    EXPECT_ERR(gpuio_agent_add_peer(init, garbage, sizeof garbage, NULL, 0), GPUIO_ERR_INVALID,
               "invalid input");
    EXPECT_ERR(gpuio_agent_add_peer(init, tmeta, tlen / 2, NULL, 0), GPUIO_ERR_INVALID,
               "invalid input");
    EXPECT_ERR(gpuio_agent_add_peer(init, NULL, tlen, NULL, 0), GPUIO_ERR_INVALID,
               "metadata is a null pointer");
    EXPECT_ERR(gpuio_agent_add_peer(init, imeta, ilen, NULL, 0), GPUIO_ERR_INVALID,
               "own metadata");
    char name[64];
    EXPECT_ERR(gpuio_agent_add_peer(init, tmeta, tlen, name, 3), GPUIO_ERR_RANGE,
               "peer \"target\" was loaded, but its name needs 7 bytes");
    EXPECT(strcmp(name, "ta") == 0);
    CHECK(gpuio_agent_add_peer(init, tmeta, tlen, name, sizeof name));
    EXPECT(strcmp(name, "target") == 0);
    CHECK(gpuio_agent_add_peer(target, imeta, ilen, NULL, 0));
    printf("ok metadata exchanged (%zu and %zu bytes)\n", tlen, ilen);

    /* READ: two ranges of the target's into the initiator's, at other offsets. */
    gpuio_desc rl[2] = {desc(ibuf, 65536), desc(ibuf + 100000, 777)};
    gpuio_desc rr[2] = {desc(tbuf + 4096, 65536), desc(tbuf + 300001, 777)};
    gpuio_xfer *read = NULL;
    CHECK(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, rl, 2, "target",
                            GPUIO_MEMORY_HOST, rr, 2, NULL, 0, &read));
    EXPECT_ERR(gpuio_xfer_status(read), GPUIO_ERR_INVALID, "has not been posted");
    EXPECT_ERR(gpuio_xfer_wait(read), GPUIO_ERR_INVALID, "has not been posted");
    run(read);
    expect_pattern(ibuf, 4096, 65536);
    expect_pattern(ibuf + 100000, 300001, 777);
    /* Posted again once done: the same bytes again. */
    memset(ibuf, 0, 65536);
    run(read);
    expect_pattern(ibuf, 4096, 65536);
    printf("ok read\n");

    /* Prepared WRITE: two initiator blocks into two target blocks, swapped ([0,1] -> [1,0]),
     * with a notification that arrives only after the data. */
    for (size_t i = 0; i < 2 * BLOCK; i++) ibuf[i] = (uint8_t)(i < BLOCK ? 0xa1 : 0xb2);
    gpuio_desc pl[2] = {desc(ibuf, BLOCK), desc(ibuf + BLOCK, BLOCK)};
    gpuio_desc pr[2] = {desc(tbuf + 100 * BLOCK, BLOCK), desc(tbuf + 120 * BLOCK, BLOCK)};
    gpuio_prep *lprep = NULL, *rprep = NULL, *oprep = NULL;
    CHECK(gpuio_prep_create(init, NULL, GPUIO_MEMORY_HOST, pl, 2, &lprep));
    CHECK(gpuio_prep_create(init, "target", GPUIO_MEMORY_HOST, pr, 2, &rprep));
    const size_t li[2] = {0, 1}, ri[2] = {1, 0};
    const uint8_t note[] = "written";
    gpuio_xfer *write = NULL;
    CHECK(gpuio_xfer_create_prepped(init, GPUIO_XFER_WRITE, lprep, li, 2, rprep, ri, 2, note,
                                    sizeof note - 1, &write));
    CHECK(gpuio_xfer_post(write));
    char from[64];
    uint8_t msg[64];
    size_t from_len = 0, msg_len = 0;
    CHECK(gpuio_agent_get_notif(target, 10000, from, sizeof from, &from_len, msg, sizeof msg,
                                &msg_len));
    /* The data is there when the notification is, before waiting on the transfer. */
    for (size_t i = 0; i < BLOCK; i++) {
        if (tbuf[120 * BLOCK + i] != 0xa1 || tbuf[100 * BLOCK + i] != 0xb2)
            FAIL("byte %zu of the swapped blocks missing when the notification came", i);
    }
    EXPECT(strcmp(from, "initiator") == 0 && from_len == strlen("initiator") + 1);
    EXPECT(msg_len == sizeof note - 1 && memcmp(msg, note, msg_len) == 0);
    CHECK(gpuio_xfer_wait(write));
    expect_pattern(tbuf + 101 * BLOCK, 101 * BLOCK, 19 * BLOCK); /* between them: untouched */
    printf("ok prepared write [0,1]->[1,0], notification after the data\n");

    /* Notifications on their own: none yet, size queries, too small, then fetched. */
    EXPECT_ERR(gpuio_agent_get_notif(init, 0, from, sizeof from, NULL, msg, sizeof msg,
                                     &msg_len),
               GPUIO_ERR_TIMEOUT, "no notification within 0 ms");
    EXPECT_ERR(gpuio_agent_get_notif(init, 30, from, sizeof from, NULL, msg, sizeof msg,
                                     &msg_len),
               GPUIO_ERR_TIMEOUT, "within 30 ms");
    const uint8_t hello[] = "hello, initiator";
    CHECK(gpuio_agent_send_notif(target, "initiator", hello, sizeof hello));
    CHECK(gpuio_agent_send_notif(target, "initiator", NULL, 0));
    EXPECT_ERR(gpuio_agent_get_notif(init, 1000, NULL, 0, &from_len, NULL, 0, &msg_len),
               GPUIO_ERR_RANGE, "stays queued");
    EXPECT(from_len == strlen("target") + 1 && msg_len == sizeof hello);
    EXPECT_ERR(gpuio_agent_get_notif(init, 0, from, sizeof from, NULL, msg, 4, &msg_len),
               GPUIO_ERR_RANGE, "msg holds 4");
    EXPECT_ERR(gpuio_agent_get_notif(init, 0, from, 3, NULL, msg, sizeof msg, &msg_len),
               GPUIO_ERR_RANGE, "from holds 3");
    EXPECT_ERR(gpuio_agent_get_notif(init, 0, from, sizeof from, NULL, msg, sizeof msg, NULL),
               GPUIO_ERR_INVALID, "msg_len is a null pointer");
    EXPECT_ERR(gpuio_agent_get_notif(init, 0, NULL, 9, NULL, msg, sizeof msg, &msg_len),
               GPUIO_ERR_INVALID, "from is a null pointer with a capacity of 9");
    uint8_t *exact = malloc(msg_len); /* exactly as large: ASan sees any overrun */
    char *from_exact = malloc(from_len);
    if (!exact || !from_exact) FAIL("malloc");
    CHECK(gpuio_agent_get_notif(init, 0, from_exact, from_len, NULL, exact, msg_len,
                                &msg_len));
    EXPECT(strcmp(from_exact, "target") == 0);
    EXPECT(msg_len == sizeof hello && memcmp(exact, hello, sizeof hello) == 0);
    CHECK(gpuio_agent_get_notif(init, 0, from_exact, from_len, NULL, NULL, 0, &msg_len));
    EXPECT(msg_len == 0);
    free(exact);
    free(from_exact);
    EXPECT_ERR(gpuio_agent_send_notif(target, "nobody", hello, 5), GPUIO_ERR_INVALID,
               "knows no agent \"nobody\"");
    EXPECT_ERR(gpuio_agent_send_notif(target, "initiator", NULL, 5), GPUIO_ERR_INVALID,
               "msg is a null pointer with a length of 5");
    printf("ok notifications: size query, too small kept, fetched\n");

    /* Descriptor lists serialised and read back. */
    size_t slen = 0, count = 0;
    uint32_t mem = 99;
    EXPECT(gpuio_descs_serialize(GPUIO_MEMORY_HOST, rr, 2, NULL, 0, &slen) == GPUIO_ERR_RANGE);
    uint8_t *ser = malloc(slen);
    if (!ser) FAIL("malloc");
    CHECK(gpuio_descs_serialize(GPUIO_MEMORY_HOST, rr, 2, ser, slen, &slen));
    gpuio_desc back[2];
    EXPECT_ERR(gpuio_descs_deserialize(ser, slen, &mem, back, 1, &count), GPUIO_ERR_RANGE,
               "2 descriptors do not fit an array of 1");
    EXPECT(count == 2);
    CHECK(gpuio_descs_deserialize(ser, slen, &mem, back, 2, &count));
    EXPECT(mem == GPUIO_MEMORY_HOST && count == 2);
    EXPECT(back[0].addr == rr[0].addr && back[0].len == rr[0].len);
    EXPECT(back[1].addr == rr[1].addr && back[1].len == rr[1].len);
    EXPECT_ERR(gpuio_descs_deserialize(ser, slen - 1, &mem, back, 2, &count), GPUIO_ERR_INVALID,
               "gpuio_descs_deserialize");
    EXPECT_ERR(gpuio_descs_deserialize(garbage, sizeof garbage, &mem, back, 2, &count),
               GPUIO_ERR_INVALID, "gpuio_descs_deserialize");
    EXPECT_ERR(gpuio_descs_serialize(GPUIO_MEMORY_HOST, NULL, 2, ser, slen, &slen),
               GPUIO_ERR_INVALID, "descriptors is a null pointer with a count of 2");
    free(ser);
    printf("ok descriptor lists serialised\n");

    /* Bad transfers: each a status with a message, nothing made. */
    gpuio_xfer *bad = NULL;
    gpuio_desc outside = desc(ibuf + LEN - 100, 200), inside = desc(tbuf, 200);
    EXPECT_ERR(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, &outside, 1,
                                 "target", GPUIO_MEMORY_HOST, &inside, 1, NULL, 0, &bad),
               GPUIO_ERR_INVALID, "local descriptor 0");
    gpuio_desc fine = desc(ibuf, 200), past = desc(tbuf + LEN - 1, 200);
    EXPECT_ERR(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, &fine, 1, "target",
                                 GPUIO_MEMORY_HOST, &past, 1, NULL, 0, &bad),
               GPUIO_ERR_INVALID, "lies in none of the peer's registrations");
    EXPECT_ERR(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, &fine, 1, "nobody",
                                 GPUIO_MEMORY_HOST, &inside, 1, NULL, 0, &bad),
               GPUIO_ERR_INVALID, "knows no agent \"nobody\"");
    EXPECT_ERR(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, rl, 2, "target",
                                 GPUIO_MEMORY_HOST, rr, 1, NULL, 0, &bad),
               GPUIO_ERR_INVALID, "2 local descriptors against 1 remote");
    EXPECT_ERR(gpuio_xfer_create(init, 5, GPUIO_MEMORY_HOST, &fine, 1, "target",
                                 GPUIO_MEMORY_HOST, &inside, 1, NULL, 0, &bad),
               GPUIO_ERR_INVALID, "operation 5");
    EXPECT_ERR(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, NULL, 1, "target",
                                 GPUIO_MEMORY_HOST, &inside, 1, NULL, 0, &bad),
               GPUIO_ERR_INVALID, "local: descriptors is a null pointer");
    EXPECT_ERR(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, &fine, 1, NULL,
                                 GPUIO_MEMORY_HOST, &inside, 1, NULL, 0, &bad),
               GPUIO_ERR_INVALID, "peer is a null pointer");
    EXPECT_ERR(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, &fine, 1, "target",
                                 GPUIO_MEMORY_HOST, &inside, 1, NULL, 4, &bad),
               GPUIO_ERR_INVALID, "notif is a null pointer with a length of 4");
    EXPECT_ERR(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, &fine, 1, "target",
                                 GPUIO_MEMORY_HOST, &inside, 1, NULL, 0, NULL),
               GPUIO_ERR_INVALID, "out is a null pointer");
    EXPECT_ERR(gpuio_xfer_create(NULL, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, &fine, 1, "target",
                                 GPUIO_MEMORY_HOST, &inside, 1, NULL, 0, &bad),
               GPUIO_ERR_INVALID, "gpuio_agent is a null pointer");
    EXPECT_ERR(gpuio_xfer_create((gpuio_agent *)engine, GPUIO_XFER_READ, GPUIO_MEMORY_HOST,
                                 &fine, 1, "target", GPUIO_MEMORY_HOST, &inside, 1, NULL, 0,
                                 &bad),
               GPUIO_ERR_BAD_HANDLE, "is not a live gpuio_agent");
    const size_t far[1] = {2};
    EXPECT_ERR(gpuio_xfer_create_prepped(init, GPUIO_XFER_WRITE, lprep, far, 1, rprep, ri, 1,
                                         NULL, 0, &bad),
               GPUIO_ERR_INVALID, "local index 2 is past");
    EXPECT_ERR(gpuio_xfer_create_prepped(init, GPUIO_XFER_WRITE, rprep, li, 2, lprep, ri, 2,
                                         NULL, 0, &bad),
               GPUIO_ERR_INVALID, "prepared without a peer");
    EXPECT_ERR(gpuio_xfer_create_prepped(init, GPUIO_XFER_WRITE, lprep, NULL, 2, rprep, ri, 2,
                                         NULL, 0, &bad),
               GPUIO_ERR_INVALID, "li is a null pointer");
    CHECK(gpuio_prep_create(other, NULL, GPUIO_MEMORY_HOST, NULL, 0, &oprep));
    EXPECT_ERR(gpuio_xfer_create_prepped(init, GPUIO_XFER_WRITE, oprep, li, 2, rprep, ri, 2,
                                         NULL, 0, &bad),
               GPUIO_ERR_INVALID, "made on another agent");
    EXPECT_ERR(gpuio_prep_create(init, NULL, GPUIO_MEMORY_HOST, &outside, 1, &oprep),
               GPUIO_ERR_INVALID, "lies in no registration");
    EXPECT_ERR(gpuio_prep_create(init, "nobody", GPUIO_MEMORY_HOST, pr, 2, &oprep),
               GPUIO_ERR_INVALID, "knows no agent");
    EXPECT(bad == NULL);
    printf("ok bad transfers refused\n");

    /* A removed peer: no new transfer, no posting of one made before; loaded again, both
     * work. */
    CHECK(gpuio_agent_remove_peer(init, "target"));
    EXPECT_ERR(gpuio_agent_remove_peer(init, "target"), GPUIO_ERR_INVALID, "knows no agent");
    EXPECT_ERR(gpuio_agent_remove_peer(init, NULL), GPUIO_ERR_INVALID, "name is a null pointer");
    EXPECT_ERR(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, rl, 2, "target",
                                 GPUIO_MEMORY_HOST, rr, 2, NULL, 0, &bad),
               GPUIO_ERR_INVALID, "knows no agent \"target\"");
    EXPECT_ERR(gpuio_xfer_post(read), GPUIO_ERR_INVALID, "was removed or reloaded");
    EXPECT_ERR(gpuio_xfer_status(read), GPUIO_ERR_INVALID, "has not been posted");
    CHECK(gpuio_agent_add_peer(init, tmeta, tlen, NULL, 0));
    gpuio_xfer *again = NULL;
    CHECK(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, rl, 2, "target",
                            GPUIO_MEMORY_HOST, rr, 2, NULL, 0, &again));
    memset(ibuf, 0, 65536);
    run(again);
    expect_pattern(ibuf, 4096, 65536);
    printf("ok removed peer refused, reloaded peer served\n");

    /* Deregistration waits for a transfer in flight, even one whose handle was freed. */
    uint8_t *bsrc = malloc(BIG), *bdst = malloc(BIG);
    if (!bsrc || !bdst) FAIL("malloc");
    memset(bsrc, 0x5c, BIG);
    memset(bdst, 0, BIG);
    gpuio_registration *bsreg = NULL, *bdreg = NULL;
    CHECK(gpuio_agent_register(target, GPUIO_MEMORY_HOST, (uint64_t)(uintptr_t)bsrc, BIG, 0,
                               &bsreg));
    CHECK(gpuio_agent_register(init, GPUIO_MEMORY_HOST, (uint64_t)(uintptr_t)bdst, BIG, 0,
                               &bdreg));
    gpuio_desc bl = desc(bdst, BIG), br = desc(bsrc, BIG);
    gpuio_xfer *big = NULL;
    CHECK(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, &bl, 1, "target",
                            GPUIO_MEMORY_HOST, &br, 1, NULL, 0, &big));
    CHECK(gpuio_xfer_post(big));
    int in_flight = gpuio_xfer_status(big) == GPUIO_PENDING;
    if (in_flight)
        EXPECT_ERR(gpuio_xfer_post(big), GPUIO_ERR_INVALID, "still in progress");
    CHECK(gpuio_xfer_free(big));
    CHECK(gpuio_agent_deregister(bdreg));
    for (size_t i = 0; i < BIG; i += 4093)
        if (bdst[i] != 0x5c) FAIL("byte %zu not copied when deregistration returned", i);
    free(bdst); /* ASan: a write after this would be a use after free */
    EXPECT_ERR(gpuio_agent_deregister(bdreg), GPUIO_ERR_BAD_HANDLE, "gpuio_registration");
    EXPECT_ERR(gpuio_agent_deregister(NULL), GPUIO_ERR_INVALID, "null pointer");
    printf("ok deregistration waited for the transfer (in flight at free: %s)\n",
           in_flight ? "yes" : "no");

    /* The target's memory deregistered: a transfer made before fails to post, a new one is
     * refused. */
    CHECK(gpuio_agent_deregister(treg));
    EXPECT_ERR(gpuio_xfer_post(again), GPUIO_ERR_INVALID, "remote registration");
    EXPECT_ERR(gpuio_xfer_post(write), GPUIO_ERR_INVALID, "was removed or reloaded");
    EXPECT_ERR(gpuio_xfer_create(init, GPUIO_XFER_READ, GPUIO_MEMORY_HOST, rl, 2, "target",
                                 GPUIO_MEMORY_HOST, rr, 2, NULL, 0, &bad),
               GPUIO_ERR_INVALID, "lies in none of the peer's registrations");
    printf("ok deregistered memory refused\n");

    /* Freeing: an agent deregisters what is left (bsreg, ireg); their handles die. */
    CHECK(gpuio_xfer_free(again));
    CHECK(gpuio_xfer_free(read));
    CHECK(gpuio_xfer_free(write));
    EXPECT_ERR(gpuio_xfer_free(write), GPUIO_ERR_BAD_HANDLE, "gpuio_xfer");
    CHECK(gpuio_prep_free(lprep));
    CHECK(gpuio_prep_free(rprep));
    CHECK(gpuio_prep_free(oprep));
    CHECK(gpuio_agent_free(target));
    EXPECT_ERR(gpuio_agent_deregister(bsreg), GPUIO_ERR_BAD_HANDLE, "gpuio_registration");
    EXPECT_ERR(gpuio_agent_free(target), GPUIO_ERR_BAD_HANDLE, "gpuio_agent");
    CHECK(gpuio_agent_free(init));
    EXPECT_ERR(gpuio_agent_deregister(ireg), GPUIO_ERR_BAD_HANDLE, "gpuio_registration");
    /* A thread waiting for good on an agent that is freed returns. */
    pthread_t waiter;
    if (pthread_create(&waiter, NULL, wait_forever, other)) FAIL("pthread_create");
    struct timespec pause = {0, 50 * 1000 * 1000};
    nanosleep(&pause, NULL);
    CHECK(gpuio_agent_free(other));
    if (pthread_join(waiter, NULL)) FAIL("pthread_join");
    printf("ok a wait for good ends when the agent is freed\n");
    CHECK(gpuio_engine_free(engine));
    free(bsrc);
    free(tbuf);
    free(ibuf);
    free(tmeta);
    free(imeta);
    printf("ok freed\n");
    printf("PASS agent\n");
    return 0;
}
