// The C++ wrapper (gpuio.hpp) at work: read a file whole, then again as 1 MiB async pieces,
// and print both checksums. Handles close themselves; failures arrive as gpuio::error.
//
//   c++ -std=c++17 -I gpuio-capi/include -I examples/c examples/c/raii.cpp
//       -L target/release -lgpuio_capi -Wl,-rpath,target/release -o raii   (one line)
#include <cstdio>
#include <vector>

#include "gpuio.hpp"

static uint64_t fnv1a(const std::vector<uint8_t> &v) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint8_t b : v) h = (h ^ b) * 0x100000001b3ull;
    return h;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s FILE\n", argv[0]);
        return 2;
    }
    try {
        gpuio::engine engine;
        gpuio::file file = engine.open(argv[1]);
        std::vector<uint8_t> whole(file.size());
        uint64_t n = file.read(whole.data(), whole.size(), 0);
        std::printf("sync:  %llu bytes, fnv1a64 %016llx (%s)\n", (unsigned long long)n,
                    (unsigned long long)fnv1a(whole), engine.backend().c_str());

        const size_t piece = 1 << 20;
        std::vector<uint8_t> again(whole.size());
        std::vector<gpuio::request> running;
        for (size_t at = 0; at < again.size(); at += piece) {
            size_t len = again.size() - at < piece ? again.size() - at : piece;
            gpuio_buffer b{again.data() + at, len, GPUIO_MEMORY_HOST, 0, nullptr};
            running.push_back(file.read_async(b, at));
        }
        uint64_t total = 0;
        for (auto &r : running) total += r.wait();
        std::printf("async: %llu bytes, fnv1a64 %016llx in %zu requests\n",
                    (unsigned long long)total, (unsigned long long)fnv1a(again), running.size());
        // A failure is an exception with gpuio's message.
        try {
            engine.open(std::string(argv[1]) + ".missing");
        } catch (const gpuio::error &e) {
            std::printf("error: %s\n", e.what());
        }
        return fnv1a(whole) == fnv1a(again) ? 0 : 1;
    } catch (const gpuio::error &e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 1;
    }
}
