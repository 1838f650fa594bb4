// A counting CPU allocator: the CPU analogue of the CUDA caching allocator's allocated-bytes statistics.
//
// It wraps the CPU allocator c10 uses for every tensor storage and kernel scratch buffer. Allocations made on the
// thread that called start() (the training thread) are counted; a counted allocation is uncounted when it is freed,
// on whichever thread that happens (gloo frees some tensors on its worker threads, which the profiler cannot see).
// Allocations made on other threads (gloo's own scratch) are not counted: docs/DESIGN.md keeps communication
// buffers out of peak_bytes.
//
// Kernel scratch. A RecordFunction callback keeps the stack of operators running on the training thread. An
// allocation that is made and freed inside one call of an operator that has a CPU backend kernel
// (DispatchKey::CPU; not a composite, not a c10d collective) is that kernel's scratch: oneDNN's packing buffers
// inside a bf16 mm, the fp32 copies a bf16 gemm makes on a CPU without AVX-512 BF16, LayerNorm backward's partial
// sums. Which of these exist depends on the CPU's instruction set, and none of them exists in the CUDA program the
// estimate describes. `program_peak` is the peak with such allocations left out; `peak` keeps them.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <optional>
#include <mutex>
#include <thread>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct Frame {
  uint64_t id;  // unique per operator call
  bool kernel;  // the operator has a CPU backend kernel: what it frees before it returns is scratch
  const char* name;
};

struct Entry {
  c10::DataPtr orig;
  size_t nbytes;
  uint64_t generation;  // 0: not counted
  uint64_t reset_serial;  // the number of reset_peak() calls before this allocation
  size_t event;  // index of its allocation in `events`
  std::vector<uint64_t> stack;  // ids of the operator calls running when it was allocated, outermost first
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
std::vector<Frame> frames;  // operators running on the training thread, outermost first
uint64_t next_frame = 0;
// Counted bytes in time order: +n at an allocation, -n at a free; a scratch allocation's +n is set to 0 when it is
// freed, and its free adds no event. The program peak is the largest prefix sum from `reset_event` on.
std::vector<int64_t> events;
std::vector<const std::string*> event_op;  // per allocation event: its innermost operator ("" outside any)
std::vector<size_t> event_freed;  // per free event: the index of the allocation event it frees
size_t reset_event = 0;
std::unordered_map<std::string, std::unique_ptr<std::string>> op_names;  // interned operator names

// The innermost running operator that is not a factory (aten::empty*): the allocation site to report.
const char* allocating_op() {
  for (size_t i = frames.size(); i-- > 0;) {
    if (std::string(frames[i].name).rfind("aten::empty", 0) != 0) return frames[i].name;
  }
  return "";
}

const std::string* intern(const char* name) {
  auto it = op_names.find(name);
  if (it == op_names.end()) it = op_names.emplace(name, std::make_unique<std::string>(name)).first;
  return it->second.get();
}
struct Scratch {
  int64_t count = 0, largest = 0, total = 0;
};
std::unordered_map<std::string, Scratch> scratch_by_op;  // kernel scratch seen since the reset, by operator

// The innermost operator call that was running both when `e` was allocated and now: its frame, or nullptr.
const Frame* common_frame(const Entry& e) {
  size_t n = std::min(e.stack.size(), frames.size());
  for (size_t i = n; i-- > 0;) {
    if (e.stack[i] == frames[i].id) return &frames[i];
  }
  return nullptr;
}

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
      int64_t n = static_cast<int64_t>(it->second.nbytes);
      current -= n;
      const Frame* f = std::this_thread::get_id() == owner ? common_frame(it->second) : nullptr;
      if (f != nullptr && f->kernel) {
        events[it->second.event] = 0;
        if (it->second.event >= reset_event) {
          Scratch& s = scratch_by_op[f->name];
          ++s.count;
          s.total += n;
          s.largest = std::max(s.largest, n);
        }
      } else {
        events.push_back(-n);
        event_op.push_back(nullptr);
        event_freed.push_back(it->second.event);
      }
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
    std::vector<uint64_t> stack;
    if (active && std::this_thread::get_id() == owner) {
      gen = generation;
      current += static_cast<int64_t>(nbytes);
      if (current > peak) peak = current;
      events.push_back(static_cast<int64_t>(nbytes));
      event_op.push_back(intern(allocating_op()));
      event_freed.push_back(SIZE_MAX);
      stack.reserve(frames.size());
      for (const Frame& f : frames) stack.push_back(f.id);
    }
    live->emplace(data, Entry{std::move(inner), nbytes, gen, reset_serial, events.size() - 1, std::move(stack)});
    return c10::DataPtr(data, data, &counted_delete, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator counting;

// Whether an operator has its own CPU kernel (any overload of its name registered for DispatchKey::CPU), rather
// than being a composite of other operators; c10d collectives are communication, modelled apart. Cached by name;
// an unknown name (a library registered after the last look) reads the dispatcher's table again.
bool is_cpu_kernel(const at::RecordFunction& fn) {
  static std::unordered_map<std::string, bool> known;
  std::string name = fn.name();
  auto it = known.find(name);
  if (it != known.end()) return it->second;
  bool kernel = false;
  if (fn.operator_name() && name.rfind("c10d::", 0) != 0) {
    for (const auto& op : c10::Dispatcher::singleton().getAllOpNamesForDispatchKey(c10::DispatchKey::CPU)) {
      if (op.name == name) {
        kernel = true;
        break;
      }
    }
  }
  known.emplace(name, kernel);
  return kernel;
}

struct FrameContext : at::ObserverContext {
  explicit FrameContext(uint64_t id) : id(id) {}
  uint64_t id;
};

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  if (std::this_thread::get_id() != owner) return nullptr;
  bool kernel = is_cpu_kernel(fn);
  std::lock_guard<std::mutex> guard(mu);
  if (!active) return nullptr;
  uint64_t id = ++next_frame;
  frames.push_back(Frame{id, kernel, fn.name()});
  return std::make_unique<FrameContext>(id);
}

void on_exit(const at::RecordFunction&, at::ObserverContext* ctx) {
  if (ctx == nullptr) return;
  uint64_t id = static_cast<FrameContext*>(ctx)->id;
  std::lock_guard<std::mutex> guard(mu);
  while (!frames.empty()) {  // pop to (and including) this call's frame
    bool mine = frames.back().id == id;
    frames.pop_back();
    if (mine) break;
  }
}

std::optional<at::CallbackHandle> callback;

void watch_operators() {
  if (callback) return;
  callback = at::addGlobalCallback(at::RecordFunctionCallback(&on_enter, &on_exit)
                                       .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

void unwatch_operators() {
  if (!callback) return;
  at::removeCallback(*callback);
  callback.reset();
}

void install() {
  if (base == nullptr) {
    base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&counting, /*priority=*/100);
  }
}

void start() {
  install();
  watch_operators();
  std::lock_guard<std::mutex> guard(mu);
  ++generation;
  current = 0;
  peak = 0;
  frames.clear();
  events.clear();
  event_op.clear();
  event_freed.clear();
  reset_event = 0;
  scratch_by_op.clear();
  foreign_free_count = 0;
  foreign_free_bytes = 0;
  owner = std::this_thread::get_id();
  active = true;
}

void stop() {
  unwatch_operators();
  std::lock_guard<std::mutex> guard(mu);
  active = false;
  frames.clear();
}

void reset_peak() {
  std::lock_guard<std::mutex> guard(mu);
  peak = current;
  reset_event = events.size();
  scratch_by_op.clear();
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

// (live bytes at the reset, peak after it), kernel scratch left out.
pybind11::tuple get_program_peak() {
  std::lock_guard<std::mutex> guard(mu);
  int64_t live = 0;
  for (size_t i = 0; i < reset_event && i < events.size(); ++i) live += events[i];
  int64_t at_reset = live, top = live;
  for (size_t i = reset_event; i < events.size(); ++i) {
    live += events[i];
    top = std::max(top, live);
  }
  return pybind11::make_tuple(at_reset, top);
}

// {operator: (count, bytes)} of the program's allocations live at its peak (kernel scratch left out), by the
// innermost operator that allocated each: the allocation sites behind the peak.
pybind11::dict get_live_at_program_peak() {
  std::lock_guard<std::mutex> guard(mu);
  int64_t live = 0, top = INT64_MIN;
  size_t at = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    live += events[i];
    if (i + 1 >= reset_event && live > top) top = live, at = i + 1;
  }
  std::vector<char> alive(at, 0);
  for (size_t i = 0; i < at; ++i) {
    if (events[i] > 0) alive[i] = 1;
    else if (events[i] < 0 && event_freed[i] < at) alive[event_freed[i]] = 0;
  }
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> by_op;
  for (size_t i = 0; i < at; ++i) {
    if (!alive[i]) continue;
    auto& v = by_op[event_op[i] ? *event_op[i] : std::string("?")];
    ++v.first;
    v.second += events[i];
  }
  pybind11::dict out;
  for (const auto& kv : by_op) out[pybind11::str(kv.first)] = pybind11::make_tuple(kv.second.first, kv.second.second);
  return out;
}

// {operator: (count, largest, total bytes)} of the kernel scratch freed since the reset.
pybind11::dict get_scratch() {
  std::lock_guard<std::mutex> guard(mu);
  pybind11::dict out;
  for (const auto& kv : scratch_by_op) {
    out[pybind11::str(kv.first)] = pybind11::make_tuple(kv.second.count, kv.second.largest, kv.second.total);
  }
  return out;
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
  m.def("program_peak", &get_program_peak);
  m.def("scratch", &get_scratch);
  m.def("live_at_program_peak", &get_live_at_program_peak);
}
