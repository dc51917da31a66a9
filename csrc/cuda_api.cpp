#include "cuda_api.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace kforge {
namespace {

DriverApi g_driver{};
NvrtcApi g_nvrtc{};
// Published with release after the tables are filled, read with acquire without the lock:
// other threads launch while one thread may still be loading.
std::atomic<void*> g_driver_handle{nullptr};
std::atomic<void*> g_nvrtc_handle{nullptr};
std::mutex g_mutex;

template <typename Fn>
void resolve(void* handle, Fn& slot, std::initializer_list<const char*> names, const std::string& lib) {
  for (const char* name : names) {
    if (void* sym = dlsym(handle, name)) {
      slot = reinterpret_cast<Fn>(sym);
      return;
    }
  }
  throw std::runtime_error(lib + " lacks symbol " + *names.begin() + ": it is too old for kforge");
}

}  // namespace

void load_driver(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_driver_handle) return;
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* err = dlerror();
    throw CudaError(-1, "CUDA_ERROR_NO_DRIVER", "cannot load the CUDA driver library " + path + " (" +
                            (err ? err : "unknown") + "); install an NVIDIA driver or set KFORGE_LIBCUDA_PATH");
  }
  DriverApi d{};
  try {
    // cuda.h maps cuDeviceTotalMem, cuEventDestroy and cuEventElapsedTime to their _v2 symbols.
    // The plain cuEventDestroy/cuEventElapsedTime share the signature (older drivers lack
    // cuEventElapsedTime_v2); the plain cuDeviceTotalMem takes an unsigned int*, so it is no fallback.
    resolve(h, d.cuInit, {"cuInit"}, path);
    resolve(h, d.cuDriverGetVersion, {"cuDriverGetVersion"}, path);
    resolve(h, d.cuGetErrorName, {"cuGetErrorName"}, path);
    resolve(h, d.cuGetErrorString, {"cuGetErrorString"}, path);
    resolve(h, d.cuDeviceGetCount, {"cuDeviceGetCount"}, path);
    resolve(h, d.cuDeviceGet, {"cuDeviceGet"}, path);
    resolve(h, d.cuDeviceGetName, {"cuDeviceGetName"}, path);
    resolve(h, d.cuDeviceGetAttribute, {"cuDeviceGetAttribute"}, path);
    resolve(h, d.cuDeviceTotalMem, {"cuDeviceTotalMem_v2"}, path);
    resolve(h, d.cuDevicePrimaryCtxRetain, {"cuDevicePrimaryCtxRetain"}, path);
    resolve(h, d.cuCtxGetCurrent, {"cuCtxGetCurrent"}, path);
    resolve(h, d.cuCtxSetCurrent, {"cuCtxSetCurrent"}, path);
    resolve(h, d.cuCtxSynchronize, {"cuCtxSynchronize"}, path);
    resolve(h, d.cuModuleLoadData, {"cuModuleLoadData"}, path);
    resolve(h, d.cuModuleUnload, {"cuModuleUnload"}, path);
    resolve(h, d.cuModuleGetFunction, {"cuModuleGetFunction"}, path);
    resolve(h, d.cuFuncGetAttribute, {"cuFuncGetAttribute"}, path);
    resolve(h, d.cuFuncSetAttribute, {"cuFuncSetAttribute"}, path);
    resolve(h, d.cuLaunchKernel, {"cuLaunchKernel"}, path);
    resolve(h, d.cuLaunchCooperativeKernel, {"cuLaunchCooperativeKernel"}, path);
    d.cuLaunchKernelEx = reinterpret_cast<decltype(d.cuLaunchKernelEx)>(dlsym(h, "cuLaunchKernelEx"));
    resolve(h, d.cuMemsetD8Async, {"cuMemsetD8Async"}, path);
    resolve(h, d.cuMemsetD32Async, {"cuMemsetD32Async"}, path);
    resolve(h, d.cuEventCreate, {"cuEventCreate"}, path);
    resolve(h, d.cuEventDestroy, {"cuEventDestroy_v2", "cuEventDestroy"}, path);
    resolve(h, d.cuEventRecord, {"cuEventRecord"}, path);
    resolve(h, d.cuEventSynchronize, {"cuEventSynchronize"}, path);
    resolve(h, d.cuEventElapsedTime, {"cuEventElapsedTime_v2", "cuEventElapsedTime"}, path);
    resolve(h, d.cuStreamSynchronize, {"cuStreamSynchronize"}, path);
  } catch (const std::runtime_error& e) {
    dlclose(h);
    throw CudaError(-1, "CUDA_ERROR_NOT_SUPPORTED", e.what());
  }
  CUresult r = d.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    d.cuGetErrorName(r, &name);
    dlclose(h);
    throw CudaError(r, name ? name : "CUDA_ERROR_UNKNOWN",
                    "cuInit failed: no usable NVIDIA GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES)");
  }
  g_driver = d;
  g_driver_handle.store(h, std::memory_order_release);
}

bool driver_loaded() { return g_driver_handle.load(std::memory_order_acquire) != nullptr; }

const DriverApi& driver() {
  if (!driver_loaded()) throw CudaError(-1, "CUDA_ERROR_NOT_INITIALIZED", "the CUDA driver is not loaded; call kforge.cuda.require()");
  return g_driver;
}

void load_nvrtc(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_nvrtc_handle) return;
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* err = dlerror();
    throw NvrtcError("cannot load NVRTC from " + path + " (" + (err ? err : "unknown") + ")");
  }
  NvrtcApi n{};
  try {
    resolve(h, n.nvrtcGetErrorString, {"nvrtcGetErrorString"}, path);
    resolve(h, n.nvrtcVersion, {"nvrtcVersion"}, path);
    resolve(h, n.nvrtcCreateProgram, {"nvrtcCreateProgram"}, path);
    resolve(h, n.nvrtcDestroyProgram, {"nvrtcDestroyProgram"}, path);
    resolve(h, n.nvrtcCompileProgram, {"nvrtcCompileProgram"}, path);
    resolve(h, n.nvrtcGetProgramLogSize, {"nvrtcGetProgramLogSize"}, path);
    resolve(h, n.nvrtcGetProgramLog, {"nvrtcGetProgramLog"}, path);
    resolve(h, n.nvrtcGetCUBINSize, {"nvrtcGetCUBINSize"}, path);
    resolve(h, n.nvrtcGetCUBIN, {"nvrtcGetCUBIN"}, path);
    resolve(h, n.nvrtcGetPTXSize, {"nvrtcGetPTXSize"}, path);
    resolve(h, n.nvrtcGetPTX, {"nvrtcGetPTX"}, path);
  } catch (const std::runtime_error& e) {
    dlclose(h);
    throw NvrtcError(e.what());
  }
  g_nvrtc = n;
  g_nvrtc_handle.store(h, std::memory_order_release);
}

bool nvrtc_loaded() { return g_nvrtc_handle.load(std::memory_order_acquire) != nullptr; }

const NvrtcApi& nvrtc() {
  if (!nvrtc_loaded()) throw NvrtcError("NVRTC is not loaded; call kforge.compiler.compile(), which finds it");
  return g_nvrtc;
}

std::string error_name(CUresult r) {
  const char* name = nullptr;
  if (driver_loaded() && g_driver.cuGetErrorName(r, &name) == CUDA_SUCCESS && name) return name;
  return "CUDA_ERROR_" + std::to_string(r);
}

void check(CUresult r, const std::string& what) {
  if (r == CUDA_SUCCESS) return;
  const char* desc = nullptr;
  if (driver_loaded()) g_driver.cuGetErrorString(r, &desc);
  throw CudaError(r, error_name(r), std::string(desc ? desc : "unknown error") + " (while " + what + ")");
}

CUcontext primary_context(int ordinal) {
  static std::unordered_map<int, CUcontext> contexts;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = contexts.find(ordinal);
  if (it != contexts.end()) return it->second;
  const DriverApi& d = driver();
  CUdevice dev;
  check(d.cuDeviceGet(&dev, ordinal), "getting device " + std::to_string(ordinal));
  CUcontext ctx;
  check(d.cuDevicePrimaryCtxRetain(&ctx, dev), "retaining the primary context of device " + std::to_string(ordinal));
  contexts[ordinal] = ctx;
  return ctx;
}

ContextGuard::ContextGuard(CUcontext ctx) {
  const DriverApi& d = driver();
  CUcontext cur = nullptr;
  check(d.cuCtxGetCurrent(&cur), "querying the current context");
  if (cur == ctx) return;
  check(d.cuCtxSetCurrent(ctx), "making the primary context current");
  prev_ = cur;
}

ContextGuard::~ContextGuard() {
  if (prev_) driver().cuCtxSetCurrent(prev_);  // best effort: a destructor must not throw
}

}  // namespace kforge
