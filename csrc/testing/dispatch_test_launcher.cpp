// kforge._dispatch_test: a stand-in launcher for the tests of kforge._dispatch on the CPU key.
// It has the C launch ABI of kforge_registry_launch (registry.h) and logs every call, so a
// test sees what the guarded path passed. Built only with KFORGE_TESTING (CMakeLists.txt):
// it is no part of kforge._dispatch, which ships.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "../registry.h"

namespace py = pybind11;

namespace {

struct TestLog {
  std::mutex mu;
  uint64_t calls = 0;
  int vid = -1, n_in = 0, n_out = 0, n_ws = 0;
  uint64_t stream = 0, in0 = 0, out0 = 0, ctx = 0;
};

TestLog& test_log() {
  static TestLog log;
  return log;
}

// vid 0: copy ctx bytes from input 0 to output 0. vid 1: output 0 = relu(input 0) over ctx / 4
// floats. vid 2: fail with a message. CPU pointers only.
int kforge_test_launch(const void* ctx, int vid, const uint64_t* inputs, int n_in, const uint64_t* outputs,
                       int n_out, const uint64_t* workspaces, int n_ws, uint64_t stream, char* err, size_t err_len) {
  const auto n = reinterpret_cast<uintptr_t>(ctx);
  {
    TestLog& log = test_log();
    std::lock_guard<std::mutex> lock(log.mu);
    log.calls++;
    log.vid = vid;
    log.n_in = n_in;
    log.n_out = n_out;
    log.n_ws = n_ws;
    log.stream = stream;
    log.in0 = n_in ? inputs[0] : 0;
    log.out0 = n_out ? outputs[0] : 0;
    log.ctx = n;
  }
  if (vid == 3) {  // acts out a driver refusing the launch before anything ran
    std::snprintf(err, err_len, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE (refused before any kernel ran)");
    return KFORGE_LAUNCH_REFUSED;
  }
  if (vid == 2 || n_in < 1 || n_out < 1) {
    std::snprintf(err, err_len, "the test launcher was told to fail (vid %d, %d inputs, %d outputs)", vid, n_in, n_out);
    return KFORGE_LAUNCH_ERROR;
  }
  void* out = reinterpret_cast<void*>(outputs[0]);
  const void* in = reinterpret_cast<const void*>(inputs[0]);
  if (vid == 0) {
    std::memmove(out, in, n);
  } else {
    const auto* x = static_cast<const float*>(in);
    auto* y = static_cast<float*>(out);
    for (size_t i = 0; i < n / sizeof(float); ++i) y[i] = x[i] > 0.f ? x[i] : 0.f;
  }
  return KFORGE_LAUNCH_OK;
}

}  // namespace

PYBIND11_MODULE(_dispatch_test, m) {
  m.doc() = "a stand-in launcher for kforge._dispatch's tests (CPU pointers only)";
  m.def("test_launcher_address", [] { return reinterpret_cast<uintptr_t>(&kforge_test_launch); });
  m.def("test_launcher_log", [] {
    TestLog& log = test_log();
    std::lock_guard<std::mutex> lock(log.mu);
    py::dict d;
    d["calls"] = log.calls;
    d["vid"] = log.vid;
    d["n_in"] = log.n_in;
    d["n_out"] = log.n_out;
    d["n_ws"] = log.n_ws;
    d["stream"] = log.stream;
    d["in0"] = log.in0;
    d["out0"] = log.out0;
    d["ctx"] = log.ctx;
    return d;
  });
}
