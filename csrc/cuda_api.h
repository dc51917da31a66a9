// The slice of the CUDA driver API and NVRTC that kforge uses, declared here and
// resolved with dlopen/dlsym on first use. Neither library is linked, so the extension
// builds without a CUDA toolkit and imports on machines without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace kforge {

// ---- driver API types (ABI-compatible with cuda.h) -----------------------------------
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
struct CUctx_st;
struct CUmod_st;
struct CUfunc_st;
struct CUstream_st;
struct CUevent_st;
using CUcontext = CUctx_st*;
using CUmodule = CUmod_st*;
using CUfunction = CUfunc_st*;
using CUstream = CUstream_st*;
using CUevent = CUevent_st*;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720;
constexpr CUresult CUDA_ERROR_INVALID_CLUSTER_SIZE = 912;
constexpr int CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1;
constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
constexpr int CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97;
constexpr int CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1;
constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
constexpr int CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14;
constexpr int CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4;
constexpr int CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6;

// cuLaunchKernelEx's configuration, laid out as cuda.h has it (CUDA 11.8+).
struct CUlaunchAttribute {
  int id;
  char pad[4];
  union {
    char bytes[64];
    int programmatic_stream_serialization_allowed;
    struct {
      unsigned x, y, z;
    } clusterDim;
  } value;
};
struct CUlaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_mem_bytes;
  CUstream stream;
  CUlaunchAttribute* attrs;
  unsigned num_attrs;
};
static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute must match cuda.h");
static_assert(sizeof(CUlaunchConfig) == 56, "CUlaunchConfig must match cuda.h");

struct DriverApi {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetName)(char*, int, CUdevice);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDeviceTotalMem)(size_t*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuFuncGetAttribute)(int*, int, CUfunction);
  CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  // Every block resident at once (grid-wide barriers); refuses grids that cannot be.
  CUresult (*cuLaunchCooperativeKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                        unsigned, CUstream, void**);
  // Launch attributes; here programmatic stream serialization (Hopper's programmatic dependent
  // launch). Optional: null with a driver too old for it, and such kernels launch plainly.
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*cuMemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent);
  CUresult (*cuStreamSynchronize)(CUstream);
};

// ---- NVRTC ----------------------------------------------------------------------------
using nvrtcResult = int;
struct _nvrtcProgram;
using nvrtcProgram = _nvrtcProgram*;
constexpr nvrtcResult NVRTC_SUCCESS = 0;
constexpr nvrtcResult NVRTC_ERROR_COMPILATION = 6;

struct NvrtcApi {
  const char* (*nvrtcGetErrorString)(nvrtcResult);
  nvrtcResult (*nvrtcVersion)(int*, int*);
  nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                                    const char* const*);
  nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram*);
  nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetPTXSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetPTX)(nvrtcProgram, char*);
};

// Raised for any failing driver call: `name` is the driver's error name (CUDA_ERROR_ILLEGAL_ADDRESS),
// `code` its CUresult (-1 where no driver call failed: the library is missing or too old);
// what() is "<name>: <detail>". Python sees kforge.errors.CudaError with .name and .code.
class CudaError : public std::runtime_error {
 public:
  CudaError(CUresult code, const std::string& name, const std::string& detail)
      : std::runtime_error(name + ": " + detail), code(code), name(name), detail(detail) {}
  CUresult code;
  std::string name;
  std::string detail;
};

// A launch the driver refused before any kernel of the plan ran (a cooperative grid that
// cannot be resident on this GPU right now): the caller may serve the call another way.
// Python sees kforge.errors.LaunchRefused.
class LaunchRefused : public CudaError {
 public:
  using CudaError::CudaError;
};

class NvrtcError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void load_driver(const std::string& path);  // dlopen + cuInit(0); throws CudaError
bool driver_loaded();
const DriverApi& driver();  // throws CudaError when not loaded

void load_nvrtc(const std::string& path);  // throws NvrtcError with dlerror()
bool nvrtc_loaded();
const NvrtcApi& nvrtc();

std::string error_name(CUresult r);
// Throws CudaError "<NAME>: <description> (while <what>)" when r is not CUDA_SUCCESS.
void check(CUresult r, const std::string& what);

// The primary context of `ordinal` (retained once, never released: PyTorch shares it).
CUcontext primary_context(int ordinal);

// Makes `ctx` current on this thread for the scope, then puts back the context that was
// current before, so a launch on another device does not silently move PyTorch's current
// device. Costs one cuCtxGetCurrent when `ctx` is already current. A thread that had no
// context keeps `ctx` (what the CUDA runtime would make current there anyway).
class ContextGuard {
 public:
  explicit ContextGuard(CUcontext ctx);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  CUcontext prev_ = nullptr;
};

}  // namespace kforge
