// A small C++17 RAII wrapper over gpuio's C API: handles freed by destructors, failures as
// exceptions carrying the status and gpuio's message. Header-only; link with -lgpuio_capi.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "gpuio.h"

namespace gpuio {

/// A failed gpuio call: the status and gpuio_last_error()'s message.
class error : public std::runtime_error {
  public:
    error(gpuio_status status, const std::string &what)
        : std::runtime_error(what + ": " + gpuio_last_error()), status_(status) {}
    gpuio_status status() const noexcept { return status_; }

  private:
    gpuio_status status_;
};

inline void check(gpuio_status s, const char *what) {
    if (s != GPUIO_OK) throw error(s, std::string(what) + " (" + gpuio_status_name(s) + ")");
}

/// An owned C handle of type T, freed with Free on destruction; movable, not copyable.
template <typename T, gpuio_status (*Free)(T *)>
class handle {
  public:
    handle() = default;
    explicit handle(T *raw) : raw_(raw) {}
    handle(handle &&o) noexcept : raw_(std::exchange(o.raw_, nullptr)) {}
    handle &operator=(handle &&o) noexcept {
        if (this != &o) {
            reset();
            raw_ = std::exchange(o.raw_, nullptr);
        }
        return *this;
    }
    handle(const handle &) = delete;
    handle &operator=(const handle &) = delete;
    ~handle() { reset(); }
    T *get() const noexcept { return raw_; }
    void reset() noexcept {
        if (raw_) Free(raw_);  // destructors do not throw: a failed free has nothing to undo
        raw_ = nullptr;
    }

  private:
    T *raw_ = nullptr;
};

/// A running or finished asynchronous read or write. Destroying a running request cancels it
/// and waits (gpuio_request_free), so the buffer is the caller's again afterwards.
class request {
  public:
    explicit request(gpuio_request *raw) : h_(raw) {}
    /// Waits for completion; returns the bytes moved or throws.
    uint64_t wait(int64_t timeout_ns = -1) {
        uint64_t n = 0;
        check(gpuio_request_wait(h_.get(), timeout_ns, &n), "gpuio_request_wait");
        return n;
    }
    /// Whether it has completed (throws if it failed).
    bool ready() {
        gpuio_status s = gpuio_request_test(h_.get(), nullptr);
        if (s == GPUIO_PENDING) return false;
        check(s, "gpuio_request_test");
        return true;
    }

  private:
    handle<gpuio_request, gpuio_request_free> h_;
};

class file {
  public:
    explicit file(gpuio_file *raw) : h_(raw) {}
    uint64_t size() const {
        uint64_t n = 0;
        check(gpuio_file_size(h_.get(), &n), "gpuio_file_size");
        return n;
    }
    /// Reads into host memory; returns the bytes read (short only at end of file).
    uint64_t read(void *dst, size_t len, uint64_t offset) const {
        gpuio_buffer b{dst, len, GPUIO_MEMORY_HOST, 0, nullptr};
        return read(b, offset);
    }
    uint64_t read(const gpuio_buffer &dst, uint64_t offset) const {
        uint64_t n = 0;
        check(gpuio_read(h_.get(), &dst, offset, &n), "gpuio_read");
        return n;
    }
    uint64_t write(const gpuio_buffer &src, uint64_t offset) const {
        uint64_t n = 0;
        check(gpuio_write(h_.get(), &src, offset, &n), "gpuio_write");
        return n;
    }
    /// Starts a read; `dst`'s memory must stay valid until the request completes or is
    /// destroyed.
    request read_async(const gpuio_buffer &dst, uint64_t offset) const {
        gpuio_request *r = nullptr;
        check(gpuio_read_async(h_.get(), &dst, offset, nullptr, nullptr, &r), "gpuio_read_async");
        return request(r);
    }
    gpuio_file *get() const noexcept { return h_.get(); }

  private:
    handle<gpuio_file, gpuio_close> h_;
};

class engine {
  public:
    /// An engine with `settings` (default: all zero, the library's defaults).
    explicit engine(const gpuio_engine_settings &settings = gpuio_engine_settings{}) {
        gpuio_engine *raw = nullptr;
        check(gpuio_engine_create(&settings, &raw), "gpuio_engine_create");
        h_ = handle<gpuio_engine, gpuio_engine_free>(raw);
    }
    file open(const std::string &path, uint32_t flags = GPUIO_OPEN_READ) const {
        gpuio_file *raw = nullptr;
        check(gpuio_open(h_.get(), path.c_str(), flags, &raw), ("gpuio_open " + path).c_str());
        return file(raw);
    }
    std::string backend() const {
        size_t needed = 0;
        gpuio_engine_backend(h_.get(), nullptr, 0, &needed);
        std::string s(needed, '\0');
        check(gpuio_engine_backend(h_.get(), s.data(), s.size(), nullptr), "gpuio_engine_backend");
        s.resize(needed ? needed - 1 : 0);
        return s;
    }

  private:
    handle<gpuio_engine, gpuio_engine_free> h_;
};

}  // namespace gpuio
