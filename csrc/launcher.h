// Loading cubins into the primary context and launching kernels on a given stream.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda_api.h"

namespace kforge {

class Module {
 public:
  Module(const std::string& image, int ordinal);
  ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  CUfunction function(const std::string& name) const;  // throws CudaError naming the kernel
  CUcontext context() const { return ctx_; }
  int ordinal() const { return ordinal_; }

 private:
  CUmodule mod_ = nullptr;
  CUcontext ctx_ = nullptr;
  int ordinal_;
};

// A kernel handle that keeps its module loaded.
struct Function {
  std::shared_ptr<Module> module;
  CUfunction fn;
  std::string name;
};

enum class ArgKind : uint8_t { In, Out, Ws, Ptr, I32, I64, F32, F64 };
ArgKind parse_arg_kind(const std::string& kind);

struct Arg {
  ArgKind kind;
  int64_t i = 0;  // buffer index for In/Out/Ws, value for Ptr/I32/I64
  double f = 0;   // value for F32/F64
};

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct KernelSpec {
  Function fn;
  Dim3 grid, block;
  unsigned smem = 0;
  std::vector<Arg> args;
  bool cooperative = false;  // cuLaunchCooperativeKernel: all blocks resident, so grid-wide barriers are safe
  // Programmatic dependent launch (sm_90+): may start while the previous kernel on the stream
  // finishes; the kernel must execute griddepcontrol.wait before it reads anything that
  // kernel wrote. Launched plainly (fully ordered) where the driver lacks cuLaunchKernelEx.
  bool pdl = false;
  // Thread block cluster (sm_90+): this many consecutive blocks along x run at once on one GPC
  // and may barrier together and read each other's shared memory. 0: no cluster.
  unsigned cluster = 0;
};

struct WorkspaceSpec {
  size_t bytes;
  bool zero;
};

// A launch plan resolved to functions. Launching binds buffer pointers to the
// arguments and runs each kernel in order on one stream; no host code of the
// candidate ever runs.
class Plan {
 public:
  Plan(std::vector<KernelSpec> kernels, std::vector<WorkspaceSpec> workspace);
  void launch(const std::vector<uint64_t>& inputs, const std::vector<uint64_t>& outputs,
              const std::vector<uint64_t>& workspaces, uint64_t stream) const;
  const std::vector<KernelSpec>& kernels() const { return kernels_; }
  const std::vector<WorkspaceSpec>& workspace() const { return workspace_; }
  CUcontext context() const { return ctx_; }

 private:
  std::vector<KernelSpec> kernels_;
  std::vector<WorkspaceSpec> workspace_;
  CUcontext ctx_ = nullptr;
};

// The caller makes the function's context current (a ContextGuard).
void launch_one(const KernelSpec& k, const std::vector<uint64_t>& inputs, const std::vector<uint64_t>& outputs,
                const std::vector<uint64_t>& workspaces, uint64_t stream);

}  // namespace kforge
