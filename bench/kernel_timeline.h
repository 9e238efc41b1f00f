// KernelTimeline: every kernel's and copy's start and end on the GPU during a real run (graphs, PDL and side streams
// included), through CUPTI's activity records. Nsight Compute times each kernel alone (serialized, its
// caches flushed), so its per-kernel sums miss what happens between kernels and what overlap changes; this
// says, for one timed window, how long the GPU ran no kernel at all (idle), which kernel each idle stretch
// came before, and each kernel's in-situ time. Who uses it: bench_decode_step --timeline.
#pragma once
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace lmx::bench {

class KernelTimeline {
 public:
  struct Kernel {
    std::string name;  // demangled, template arguments cut
    uint64_t start, end;  // ns, GPU clock
    uint32_t stream;
  };

  // CUPTI's records on for the rest of the process: call once before the timed work, so that CUPTI's own
  // start-up (its first buffer, ~1 ms of host time seen inside a window, perf-log run 220) and whatever its
  // tracing changes apply to every timed step alike, not only to the traced one.
  static void enable() {
    static const bool enabled = [] {
      check(cuptiActivityRegisterCallbacks(&KernelTimeline::request, &KernelTimeline::complete), "register callbacks");
      check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernel records");
      check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable copy records");
      return true;
    }();
    (void)enabled;
  }
  // Keeps the kernels and copies ("copy HtoD < 64 KB") that start from now until stop(). One window at a time
  // (CUPTI's callbacks are process-wide). PRECOND: the device is idle (records before it are dropped).
  void start() {
    enable();
    check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "flush");  // earlier records: no sink, dropped
    kernels_.clear();
    check(cuptiGetTimestamp(&window_start()), "timestamp");
    sink() = &kernels_;
  }
  // Flushes the records of everything launched so far; the caller synchronizes the device first.
  void stop() {
    check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "flush");
    sink() = nullptr;
    std::erase_if(kernels_, [](const Kernel& k) { return k.start < window_start(); });
    std::sort(kernels_.begin(), kernels_.end(), [](const Kernel& a, const Kernel& b) { return a.start < b.start; });
  }
  const std::vector<Kernel>& kernels() const { return kernels_; }

  // The window's span (first kernel start to last end), busy time (the union of the kernels' intervals), idle
  // time (span - busy), then the `rows` largest idle totals by the kernel that ended each idle stretch, and the
  // `rows` largest in-situ kernel times by name (a kernel's time overlapping others counts in full).
  void print(const char* what, int rows = 16) const {
    if (kernels_.empty()) {
      std::printf("timeline (%s): no kernel recorded\n", what);
      return;
    }
    struct Total {
      double ns = 0, own_ns = 0;  // own: the busy time the item added past everything that ended before it
      double min_ns = 0, max_ns = 0;  // the shortest and longest call (in situ)
      std::vector<double> calls_ns;   // every call in order (printed for the largest few)
      int count = 0;
    };
    struct Stretch {
      uint64_t ns, at;  // length, start offset into the window
      size_t before;    // kernels_ index of the item that ended it
      size_t last;      // of the item that ended last before it
    };
    std::map<std::string, Total> idle_before, time_of;
    std::vector<Stretch> stretches;
    uint64_t busy_until = kernels_.front().start, busy = 0, idle = 0;
    size_t last = 0;
    for (size_t i = 0; i < kernels_.size(); ++i) {
      const Kernel& k = kernels_[i];
      const uint64_t busy_before = busy;
      if (k.start > busy_until) {
        stretches.push_back({k.start - busy_until, busy_until - kernels_.front().start, i, last});
        idle += k.start - busy_until;
        Total& t = idle_before[k.name];
        t.ns += double(k.start - busy_until);
        ++t.count;
        busy += k.end - k.start;
        busy_until = k.end;
        last = i;
      } else if (k.end > busy_until) {
        busy += k.end - busy_until;
        busy_until = k.end;
        last = i;
      }
      Total& t = time_of[k.name];
      t.ns += double(k.end - k.start);
      t.own_ns += double(busy - busy_before);
      const double call_ns = double(k.end - k.start);
      t.min_ns = t.count == 0 ? call_ns : std::min(t.min_ns, call_ns);
      t.max_ns = std::max(t.max_ns, call_ns);
      t.calls_ns.push_back(call_ns);
      ++t.count;
    }
    const uint64_t span = busy_until - kernels_.front().start;
    std::printf("timeline (%s): %zu kernels and copies, span %.3f ms, busy %.3f ms, idle %.3f ms (%.1f%%)\n", what,
                kernels_.size(), span * 1e-6, busy * 1e-6, idle * 1e-6, span > 0 ? 100.0 * double(idle) / double(span) : 0.0);
    auto largest = [rows](const std::map<std::string, Total>& m) {
      std::vector<std::pair<std::string, Total>> v(m.begin(), m.end());
      std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
      if (v.size() > size_t(rows)) v.resize(size_t(rows));
      return v;
    };
    std::printf("  idle before (the kernel each idle stretch ended in: total µs, stretches, mean µs)\n");
    for (const auto& [name, t] : largest(idle_before)) {
      std::printf("    %-70.70s %9.1f %6d %7.2f\n", name.c_str(), t.ns * 1e-3, t.count, t.ns * 1e-3 / t.count);
    }
    std::sort(stretches.begin(), stretches.end(), [](const Stretch& a, const Stretch& b) { return a.ns > b.ns; });
    std::printf("  longest idle stretches (µs, ms into the window, #item: after -> before)\n");
    for (size_t i = 0; i < std::min<size_t>(stretches.size(), 4); ++i) {
      const Stretch& t = stretches[i];
      std::printf("    %8.1f %8.3f  #%zu: %.60s -> %.60s\n", t.ns * 1e-3, t.at * 1e-6, t.before,
                  kernels_[t.last].name.c_str(), kernels_[t.before].name.c_str());
    }
    std::printf("  the window's first items (ms into it, µs long)\n");
    for (size_t i = 0; i < std::min<size_t>(kernels_.size(), 6); ++i) {
      const Kernel& k = kernels_[i];
      std::printf("    %8.3f %8.1f  %.70s\n", (k.start - kernels_.front().start) * 1e-6, (k.end - k.start) * 1e-3,
                  k.name.c_str());
    }
    // own: the busy time each adds past the items that ended before it (a programmatic dependent's wait
    // overlaps its predecessor and counts there); the own times sum to `busy`
    // min / max: the shortest and longest call in situ (a kernel whose calls differ by layer: routing, windows)
    std::printf("  in-situ time of kernels and copies (total µs, calls, mean µs; own total µs, own mean µs; min, max µs)\n");
    for (const auto& [name, t] : largest(time_of)) {
      std::printf("    %-60.60s %9.1f %5d %7.2f %9.1f %7.2f %7.1f %7.1f\n", name.c_str(), t.ns * 1e-3, t.count,
                  t.ns * 1e-3 / t.count, t.own_ns * 1e-3, t.own_ns * 1e-3 / t.count, t.min_ns * 1e-3, t.max_ns * 1e-3);
    }
    // the largest kernels call by call (a prefill's layers in order): layer-to-layer spread, or a slow start
    const auto top = largest(time_of);
    for (size_t i = 0; i < std::min<size_t>(top.size(), 3); ++i) {
      const Total& t = top[i].second;
      if (t.count < 2) continue;
      std::printf("  calls of %.60s (µs, in order):", top[i].first.c_str());
      for (double ns : t.calls_ns) std::printf(" %.0f", ns * 1e-3);
      std::printf("\n");
    }
  }

 private:
  static constexpr size_t kBufferBytes = size_t(8) << 20;

  static std::vector<Kernel>*& sink() {
    static std::vector<Kernel>* s = nullptr;
    return s;
  }
  static uint64_t& window_start() {
    static uint64_t t = 0;
    return t;
  }
  static void check(CUptiResult r, const char* what) {
    if (r == CUPTI_SUCCESS) return;
    const char* message = nullptr;
    cuptiGetResultString(r, &message);
    std::fprintf(stderr, "KernelTimeline: CUPTI %s failed: %s\n", what, message != nullptr ? message : "unknown error");
    std::exit(1);
  }
  // "lmx::cuda::(anonymous namespace)::grouped_gemm_persistent_kernel<2, 192, 5, false, false, false>(...)"
  // -> "grouped_gemm_persistent_kernel<2, 192, 5, false, false, false>": namespaces and parameters dropped.
  static std::string short_name(const char* mangled) {
    int status = 0;
    char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
    std::string name = status == 0 && demangled != nullptr ? demangled : mangled;
    std::free(demangled);
    int depth = 0;
    size_t cut = name.size(), begin = 0;
    for (size_t i = 0; i < name.size(); ++i) {  // the parameter list: the first '(' outside template brackets
      const char c = name[i];
      if (c == '<') ++depth;
      else if (c == '>') --depth;
      else if (c == '(' && depth == 0 && name.compare(i, 21, "(anonymous namespace)") != 0) {
        cut = i;
        break;
      } else if (c == ':' && depth == 0 && i + 1 < name.size() && name[i + 1] == ':') {
        begin = i + 2;
      }
    }
    return name.substr(begin, cut - begin);
  }
  static void CUPTIAPI request(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
    *size = kBufferBytes;
    *max_records = 0;
  }
  static void CUPTIAPI complete(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    CUpti_Activity* record = nullptr;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
      if (sink() == nullptr) continue;
      if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        sink()->push_back({short_name(k->name), k->start, k->end, k->streamId});
      } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
        const auto* c = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        const char* kind = c->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "HtoD"
                           : c->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "DtoH"
                           : c->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOD ? "DtoD"
                                                                            : "other";
        const uint64_t kb = (c->bytes + 1023) / 1024;
        sink()->push_back({std::string("copy ") + kind + (kb < 64 ? " < 64 KB" : " >= 64 KB"), c->start, c->end, c->streamId});
      }
    }
    std::free(buffer);
  }

  std::vector<Kernel> kernels_;
};

}  // namespace lmx::bench
