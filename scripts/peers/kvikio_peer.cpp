// kvikio-peer: KvikIO's C++ API measured with gpuio bench's settings, so `gpuio bench
// --compare` can put KvikIO beside gpuio in the same run. Built by scripts/kvikio-peer.sh
// against the libkvikio wheel; never linked into gpuio.
//
// Model: `qd` requests of `bs` bytes outstanding at once (KvikIO futures from
// FileHandle::pread/pwrite, each split into task_size pieces on KvikIO's thread pool),
// sequential or random offsets, for `seconds`; the best of the thread counts given wins,
// as the performance issue asks ("KvikIO's best thread count"). Memory is device memory
// (cuMemAlloc, through libcuda loaded at run time) or host memory.
//
// Prints one JSON line per thread count, then {"best":...} last.

#include <dlfcn.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <random>
#include <string>
#include <vector>

#include <kvikio/defaults.hpp>
#include <kvikio/file_handle.hpp>

namespace {

struct Args {
  std::string file;
  std::size_t bs = 1 << 20;
  std::size_t qd = 8;
  std::size_t span = 0;  // 0: the file's size
  double seconds = 3.0;
  bool random = false;
  bool write = false;
  bool direct = false;
  bool gpu = false;
  int device = 0;
  std::string compat = "on";
  std::vector<unsigned> threads{8};
};

[[noreturn]] void die(std::string const& why) {
  std::fprintf(stderr, "kvikio-peer: %s\n", why.c_str());
  std::exit(2);
}

std::size_t parse_size(std::string s) {
  if (s.empty()) die("empty size");
  std::size_t mul = 1;
  switch (s.back()) {
    case 'K': case 'k': mul = 1ull << 10; s.pop_back(); break;
    case 'M': case 'm': mul = 1ull << 20; s.pop_back(); break;
    case 'G': case 'g': mul = 1ull << 30; s.pop_back(); break;
    default: break;
  }
  char* end = nullptr;
  auto v = std::strtoull(s.c_str(), &end, 10);
  if (end == s.c_str() || *end != '\0') die("bad size: " + s);
  return v * mul;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value for " + k);
      return argv[++i];
    };
    if (k == "--file") a.file = val();
    else if (k == "--bs") a.bs = parse_size(val());
    else if (k == "--qd") a.qd = parse_size(val());
    else if (k == "--span") a.span = parse_size(val());
    else if (k == "--seconds") a.seconds = std::atof(val().c_str());
    else if (k == "--pattern") a.random = val() == "rand";
    else if (k == "--rw") a.write = val() == "write";
    else if (k == "--direct") a.direct = true;
    else if (k == "--gpu") a.gpu = true;
    else if (k == "--device") a.device = std::atoi(val().c_str());
    else if (k == "--compat") a.compat = val();
    else if (k == "--threads") {
      a.threads.clear();
      std::string v = val();
      std::size_t p = 0;
      while (p <= v.size()) {
        auto q = v.find(',', p);
        if (q == std::string::npos) q = v.size();
        a.threads.push_back(static_cast<unsigned>(parse_size(v.substr(p, q - p))));
        p = q + 1;
      }
    } else die("unknown argument " + k);
  }
  if (a.file.empty()) die("--file is required");
  if (a.bs == 0 || a.qd == 0 || !(a.seconds > 0)) die("--bs, --qd and --seconds must be positive");
  for (auto t : a.threads) if (t == 0) die("--threads must be positive");
  return a;
}

// The few driver calls the harness needs, from libcuda at run time (no link-time CUDA).
struct Driver {
  using Init = int (*)(unsigned);
  using DeviceGet = int (*)(int*, int);
  using Retain = int (*)(void**, int);
  using SetCurrent = int (*)(void*);
  using Alloc = int (*)(unsigned long long*, std::size_t);
  using Free = int (*)(unsigned long long);
  Alloc alloc = nullptr;
  Free free = nullptr;

  explicit Driver(int ordinal) {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!h) die(std::string("libcuda.so.1: ") + dlerror());
    auto sym = [&](char const* n) {
      void* p = dlsym(h, n);
      if (!p) die(std::string("libcuda lacks ") + n);
      return p;
    };
    auto init = reinterpret_cast<Init>(sym("cuInit"));
    auto get = reinterpret_cast<DeviceGet>(sym("cuDeviceGet"));
    auto retain = reinterpret_cast<Retain>(sym("cuDevicePrimaryCtxRetain"));
    auto set = reinterpret_cast<SetCurrent>(sym("cuCtxSetCurrent"));
    alloc = reinterpret_cast<Alloc>(sym("cuMemAlloc_v2"));
    free = reinterpret_cast<Free>(sym("cuMemFree_v2"));
    int dev = 0;
    void* ctx = nullptr;
    if (init(0) != 0 || get(&dev, ordinal) != 0 || retain(&ctx, dev) != 0 || set(ctx) != 0)
      die("no usable CUDA device " + std::to_string(ordinal));
  }
};

double cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  auto s = [](timeval t) { return double(t.tv_sec) + double(t.tv_usec) / 1e6; };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

struct Result {
  unsigned threads;
  double gbps, iops, cores;
};

Result run_point(Args const& a, kvikio::FileHandle& f, std::vector<void*> const& bufs,
                 std::size_t span, unsigned threads) {
  kvikio::defaults::set_thread_pool_nthreads(threads);
  std::size_t blocks = span / a.bs;
  std::mt19937_64 rng(42);
  std::size_t next = 0;
  auto offset = [&]() -> std::size_t {
    std::size_t b = a.random ? rng() % blocks : (next++ % blocks);
    return b * a.bs;
  };
  std::deque<std::pair<std::future<std::size_t>, std::size_t>> inflight;
  auto issue = [&](std::size_t slot) {
    void* buf = bufs[slot];
    auto off = offset();
    auto fut = a.write ? f.pwrite(buf, a.bs, off) : f.pread(buf, a.bs, off);
    inflight.emplace_back(std::move(fut), slot);
  };
  std::size_t bytes = 0, ops = 0;
  auto t0 = std::chrono::steady_clock::now();
  double c0 = cpu_seconds();
  auto deadline = t0 + std::chrono::duration<double>(a.seconds);
  for (std::size_t s = 0; s < a.qd; ++s) issue(s);
  while (!inflight.empty()) {
    auto [fut, slot] = std::move(inflight.front());
    inflight.pop_front();
    std::size_t n = fut.get();
    if (n != a.bs) die("short transfer: " + std::to_string(n) + " of " + std::to_string(a.bs));
    bytes += n;
    ++ops;
    if (std::chrono::steady_clock::now() < deadline) issue(slot);
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double cpu = cpu_seconds() - c0;
  return {threads, double(bytes) / secs / 1e9, double(ops) / secs, cpu / secs};
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  if (a.compat == "on") kvikio::defaults::set_compat_mode(kvikio::CompatMode::ON);
  else if (a.compat == "auto") kvikio::defaults::set_compat_mode(kvikio::CompatMode::AUTO);
  else if (a.compat == "off") kvikio::defaults::set_compat_mode(kvikio::CompatMode::OFF);
  else die("--compat on|auto|off");
  if (a.direct) {
    kvikio::defaults::set_auto_direct_io_read(true);
    kvikio::defaults::set_auto_direct_io_write(true);
  }
  Driver* drv = a.gpu ? new Driver(a.device) : nullptr;
  std::vector<void*> bufs;
  for (std::size_t i = 0; i < a.qd; ++i) {
    void* p = nullptr;
    if (drv) {
      unsigned long long d = 0;
      if (drv->alloc(&d, a.bs) != 0) die("cuMemAlloc failed");
      p = reinterpret_cast<void*>(d);
    } else if (posix_memalign(&p, 4096, a.bs) != 0) {
      die("out of host memory");
    } else {
      std::memset(p, 0x5a, a.bs);
    }
    bufs.push_back(p);
  }
  try {
    kvikio::FileHandle f(a.file, a.write ? "r+" : "r");
    std::size_t span = a.span ? a.span : f.nbytes();
    if (a.write && span == 0) span = a.span;
    if (span < a.bs) die("file span smaller than --bs");
    Result best{0, 0, 0, 0};
    for (auto t : a.threads) {
      Result r = run_point(a, f, bufs, span, t);
      std::printf("{\"threads\":%u,\"gbps\":%.4f,\"iops\":%.1f,\"cores\":%.3f}\n", r.threads,
                  r.gbps, r.iops, r.cores);
      if (r.gbps > best.gbps) best = r;
    }
    std::printf(
        "{\"best\":true,\"threads\":%u,\"gbps\":%.4f,\"iops\":%.1f,\"cores\":%.3f,"
        "\"compat\":\"%s\",\"memory\":\"%s\"}\n",
        best.threads, best.gbps, best.iops, best.cores, a.compat.c_str(),
        a.gpu ? "device" : "host");
    std::fflush(stdout);
  } catch (std::exception const& e) {
    die(std::string("KvikIO: ") + e.what());
  }
  for (auto p : bufs) {
    if (drv) drv->free(reinterpret_cast<unsigned long long>(p));
    else std::free(p);
  }
  return 0;
}
