// A counting CPU allocator: the CPU analogue of the CUDA caching allocator's allocated-bytes statistics.
//
// It wraps the CPU allocator c10 uses for every tensor storage and kernel scratch buffer. Allocations made on the
// thread that called start() (the training thread) are counted; a counted allocation is uncounted when it is freed,
// on whichever thread that happens (gloo frees some tensors on its worker threads, which the profiler cannot see).
// Allocations made on other threads (gloo's own scratch) are not counted: docs/DESIGN.md keeps communication
// buffers out of peak_bytes.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace {

struct Entry {
  c10::DataPtr orig;
  size_t nbytes;
  uint64_t generation;  // 0: not counted
  uint64_t reset_serial;  // the number of reset_peak() calls before this allocation
};

std::mutex mu;
int64_t current = 0;
int64_t peak = 0;
int64_t foreign_free_count = 0;  // counted allocations freed on another thread than the training thread
int64_t foreign_free_bytes = 0;
uint64_t reset_serial = 0;
uint64_t generation = 0;  // bumped by every start(); frees of older generations are ignored
bool active = false;
std::thread::id owner;
c10::Allocator* base = nullptr;
// data pointer -> the original allocation. The returned DataPtr's context is the data pointer itself, so the
// raw_allocate / raw_deallocate API (used by some kernels) works as with the default allocator.
std::unordered_map<void*, Entry>* live = new std::unordered_map<void*, Entry>();  // never destroyed

void counted_delete(void* data) {
  c10::DataPtr orig;
  {
    std::lock_guard<std::mutex> guard(mu);
    auto it = live->find(data);
    if (it == live->end()) return;
    if (it->second.generation && it->second.generation == generation) {
      current -= static_cast<int64_t>(it->second.nbytes);
      if (std::this_thread::get_id() != owner && it->second.reset_serial == reset_serial) {
        ++foreign_free_count;
        foreign_free_bytes += static_cast<int64_t>(it->second.nbytes);
      }
    }
    orig = std::move(it->second.orig);
    live->erase(it);
  }
  // `orig` goes out of scope here, outside the lock: the original deleter frees the memory.
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr inner = base->allocate(nbytes);
    void* data = inner.get();
    if (data == nullptr || nbytes == 0) return inner;
    c10::Device device = inner.device();
    std::lock_guard<std::mutex> guard(mu);
    uint64_t gen = 0;
    if (active && std::this_thread::get_id() == owner) {
      gen = generation;
      current += static_cast<int64_t>(nbytes);
      if (current > peak) peak = current;
    }
    live->emplace(data, Entry{std::move(inner), nbytes, gen, reset_serial});
    return c10::DataPtr(data, data, &counted_delete, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator counting;

void install() {
  if (base == nullptr) {
    base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&counting, /*priority=*/100);
  }
}

void start() {
  install();
  std::lock_guard<std::mutex> guard(mu);
  ++generation;
  current = 0;
  peak = 0;
  foreign_free_count = 0;
  foreign_free_bytes = 0;
  owner = std::this_thread::get_id();
  active = true;
}

void stop() {
  std::lock_guard<std::mutex> guard(mu);
  active = false;
}

void reset_peak() {
  std::lock_guard<std::mutex> guard(mu);
  peak = current;
  ++reset_serial;
  foreign_free_count = 0;  // counted from the reset on: the window the peak is taken over
  foreign_free_bytes = 0;
}

int64_t get_current() {
  std::lock_guard<std::mutex> guard(mu);
  return current;
}

int64_t get_peak() {
  std::lock_guard<std::mutex> guard(mu);
  return peak;
}

pybind11::tuple get_foreign_frees() {
  std::lock_guard<std::mutex> guard(mu);
  return pybind11::make_tuple(foreign_free_count, foreign_free_bytes);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("start", &start);
  m.def("stop", &stop);
  m.def("reset_peak", &reset_peak);
  m.def("current", &get_current);
  m.def("peak", &get_peak);
  m.def("foreign_frees", &get_foreign_frees);
}
