// The guarded dispatch registry: variant id -> launch plan. Guards are matched by
// kforge._dispatch (C++) or kforge.dispatch (Python); the launch path from here on is C++.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "launcher.h"

namespace kforge {

class Registry {
 public:
  int add(std::shared_ptr<Plan> plan);
  void launch(int id, const std::vector<uint64_t>& inputs, const std::vector<uint64_t>& outputs,
              const std::vector<uint64_t>& workspaces, uint64_t stream) const;
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Plan>> plans_;
};

}  // namespace kforge

// Registry::launch behind a plain C ABI, so that kforge._dispatch (built against libtorch,
// without CUDA headers) can launch through a function pointer taken from Registry.launch_address().
// `registry` is a kforge::Registry*. Returns 0 on success, KFORGE_LAUNCH_CUDA_ERROR when the
// driver failed (err holds the CudaError text, which starts with the CUDA error name) and
// KFORGE_LAUNCH_ERROR for anything else; KFORGE_LAUNCH_REFUSED when the driver refused the
// plan's first kernel before anything ran (a cooperative grid too large to be resident): the
// caller should serve the call with eager. err is always NUL-terminated. Never throws.
enum { KFORGE_LAUNCH_OK = 0, KFORGE_LAUNCH_CUDA_ERROR = 1, KFORGE_LAUNCH_ERROR = 2, KFORGE_LAUNCH_REFUSED = 3 };
extern "C" int kforge_registry_launch(const void* registry, int vid, const uint64_t* inputs, int n_in,
                                      const uint64_t* outputs, int n_out, const uint64_t* workspaces, int n_ws,
                                      uint64_t stream, char* err, size_t err_len);
