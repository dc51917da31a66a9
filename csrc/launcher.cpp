#include "launcher.h"

#include <cstring>

namespace kforge {

Module::Module(const std::string& image, int ordinal) : ordinal_(ordinal) {
  ctx_ = primary_context(ordinal);
  ContextGuard guard(ctx_);
  check(driver().cuModuleLoadData(&mod_, image.data()), "loading a cubin of " + std::to_string(image.size()) +
                                                            " bytes on device " + std::to_string(ordinal));
}

Module::~Module() {
  if (!mod_ || !driver_loaded()) return;
  // Best effort: a module of a poisoned context cannot be unloaded, and a destructor must not throw.
  // The last reference may drop on any thread, so that thread's own context is put back.
  const DriverApi& d = driver();
  CUcontext cur = nullptr;
  d.cuCtxGetCurrent(&cur);
  if (cur != ctx_) d.cuCtxSetCurrent(ctx_);
  d.cuModuleUnload(mod_);
  if (cur && cur != ctx_) d.cuCtxSetCurrent(cur);
}

CUfunction Module::function(const std::string& name) const {
  CUfunction fn = nullptr;
  check(driver().cuModuleGetFunction(&fn, mod_, name.c_str()),
        "looking up kernel '" + name + "' (is it declared extern \"C\" __global__?)");
  return fn;
}

ArgKind parse_arg_kind(const std::string& kind) {
  if (kind == "in") return ArgKind::In;
  if (kind == "out") return ArgKind::Out;
  if (kind == "ws") return ArgKind::Ws;
  if (kind == "ptr") return ArgKind::Ptr;
  if (kind == "i32") return ArgKind::I32;
  if (kind == "i64") return ArgKind::I64;
  if (kind == "f32") return ArgKind::F32;
  if (kind == "f64") return ArgKind::F64;
  throw std::invalid_argument("unknown launch argument kind '" + kind + "' (in/out/ws/ptr/i32/i64/f32/f64)");
}

namespace {

std::string describe(const KernelSpec& k) {
  return "launching kernel '" + k.fn.name + "' grid=(" + std::to_string(k.grid.x) + "," + std::to_string(k.grid.y) +
         "," + std::to_string(k.grid.z) + ") block=(" + std::to_string(k.block.x) + "," + std::to_string(k.block.y) +
         "," + std::to_string(k.block.z) + ") smem=" + std::to_string(k.smem);
}

uint64_t pick(const std::vector<uint64_t>& v, int64_t i, const char* what, const KernelSpec& k) {
  if (i < 0 || static_cast<size_t>(i) >= v.size())
    throw std::out_of_range(std::string(what) + " index " + std::to_string(i) + " out of range (" +
                            std::to_string(v.size()) + " given) for kernel '" + k.fn.name + "'");
  return v[i];
}

}  // namespace

void launch_one(const KernelSpec& k, const std::vector<uint64_t>& inputs, const std::vector<uint64_t>& outputs,
                const std::vector<uint64_t>& workspaces, uint64_t stream) {
  // One 8-byte slot per argument; cuLaunchKernel reads each parameter from its slot. 512 slots are
  // CUDA's 4 KB of kernel parameters (every arch); LaunchPlan.validate refuses more (MAX_ARGS).
  constexpr size_t kMaxArgs = 512;
  if (k.args.size() > kMaxArgs) throw std::invalid_argument("kernel '" + k.fn.name + "' has more than 512 arguments");
  uint64_t slots[kMaxArgs];
  void* params[kMaxArgs];
  for (size_t a = 0; a < k.args.size(); ++a) {
    const Arg& arg = k.args[a];
    switch (arg.kind) {
      case ArgKind::In: slots[a] = pick(inputs, arg.i, "input", k); break;
      case ArgKind::Out: slots[a] = pick(outputs, arg.i, "output", k); break;
      case ArgKind::Ws: slots[a] = pick(workspaces, arg.i, "workspace", k); break;
      case ArgKind::Ptr:
      case ArgKind::I64: slots[a] = static_cast<uint64_t>(arg.i); break;
      case ArgKind::I32: {
        int32_t v = static_cast<int32_t>(arg.i);
        std::memcpy(&slots[a], &v, sizeof v);
        break;
      }
      case ArgKind::F32: {
        float v = static_cast<float>(arg.f);
        std::memcpy(&slots[a], &v, sizeof v);
        break;
      }
      case ArgKind::F64: std::memcpy(&slots[a], &arg.f, sizeof arg.f); break;
    }
    params[a] = &slots[a];
  }
  const CUstream s = reinterpret_cast<CUstream>(stream);
  if (k.cluster && !driver().cuLaunchKernelEx)
    throw std::runtime_error("kernel '" + k.fn.name + "' is launched in clusters, which needs cuLaunchKernelEx: "
                             "this driver lacks it (update the NVIDIA driver)");
  if ((k.pdl || k.cluster) && driver().cuLaunchKernelEx) {
    CUlaunchAttribute attrs[2]{};
    unsigned n = 0;
    if (k.pdl) {
      attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs[n++].value.programmatic_stream_serialization_allowed = 1;
    }
    if (k.cluster) {
      attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
      attrs[n].value.clusterDim.x = k.cluster;
      attrs[n].value.clusterDim.y = 1;
      attrs[n++].value.clusterDim.z = 1;
    }
    const CUlaunchConfig cfg{k.grid.x, k.grid.y, k.grid.z, k.block.x, k.block.y, k.block.z, k.smem, s, attrs, n};
    check(driver().cuLaunchKernelEx(&cfg, k.fn.fn, params, nullptr), describe(k));
    return;
  }
  if (k.cooperative) {
    // Refused (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE) rather than run when the grid cannot
    // be resident at once, so a grid-wide barrier never waits on a block that never starts.
    check(driver().cuLaunchCooperativeKernel(k.fn.fn, k.grid.x, k.grid.y, k.grid.z, k.block.x, k.block.y, k.block.z,
                                             k.smem, s, params),
          describe(k));
    return;
  }
  check(driver().cuLaunchKernel(k.fn.fn, k.grid.x, k.grid.y, k.grid.z, k.block.x, k.block.y, k.block.z, k.smem, s,
                                params, nullptr),
        describe(k));
}

Plan::Plan(std::vector<KernelSpec> kernels, std::vector<WorkspaceSpec> workspace)
    : kernels_(std::move(kernels)), workspace_(std::move(workspace)) {
  if (kernels_.empty()) throw std::invalid_argument("a launch plan needs at least one kernel");
  // One context per plan lets launch() make it current once, before the workspace memsets.
  ctx_ = kernels_.front().fn.module->context();
  ContextGuard guard(ctx_);
  for (auto& k : kernels_) {
    if (k.fn.module->context() != ctx_)
      throw std::invalid_argument("kernel '" + k.fn.name + "' is loaded on another device than '" +
                                  kernels_.front().fn.name + "': a plan runs on one device");
    int static_smem = 0;
    if (k.smem > 0)
      check(driver().cuFuncGetAttribute(&static_smem, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, k.fn.fn),
            "reading the static shared memory of '" + k.fn.name + "'");
    if (k.smem + static_cast<size_t>(static_smem) > 48 * 1024) {
      // A block's shared memory (static plus dynamic) above 48 KB must be opted into per
      // function; without it even exactly 48 KB of dynamic memory cannot launch.
      check(driver().cuFuncSetAttribute(k.fn.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        static_cast<int>(k.smem)),
            "raising the dynamic shared memory limit of '" + k.fn.name + "' to " + std::to_string(k.smem));
    }
    if (k.cluster > 8)  // 8 is the portable limit; Hopper runs up to 16 when the function opts in
      check(driver().cuFuncSetAttribute(k.fn.fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
            "allowing clusters of " + std::to_string(k.cluster) + " blocks for '" + k.fn.name + "'");
  }
}

void Plan::launch(const std::vector<uint64_t>& inputs, const std::vector<uint64_t>& outputs,
                  const std::vector<uint64_t>& workspaces, uint64_t stream) const {
  if (workspaces.size() < workspace_.size())
    throw std::invalid_argument("the plan needs " + std::to_string(workspace_.size()) + " workspace buffer(s), got " +
                                std::to_string(workspaces.size()));
  const DriverApi& d = driver();
  ContextGuard guard(ctx_);
  for (size_t w = 0; w < workspace_.size(); ++w) {
    if (workspace_[w].zero && workspace_[w].bytes)
      check(d.cuMemsetD8Async(workspaces[w], 0, workspace_[w].bytes, reinterpret_cast<CUstream>(stream)),
            "zeroing workspace " + std::to_string(w));
  }
  for (size_t i = 0; i < kernels_.size(); ++i) {
    try {
      launch_one(kernels_[i], inputs, outputs, workspaces, stream);
    } catch (const CudaError& e) {
      // Only the first kernel: after it, some of the plan has run (an in-place output may
      // be half written) and nothing else may take over the call.
      // A cluster that cannot be placed on one GPC is refused the same way.
      if (i == 0 && (e.code == CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE || e.code == CUDA_ERROR_INVALID_CLUSTER_SIZE))
        throw LaunchRefused(e.code, e.name, e.detail + " (refused before any kernel ran)");
      throw;
    }
  }
}

}  // namespace kforge
