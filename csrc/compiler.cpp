#include "compiler.h"

#include "cuda_api.h"

namespace kforge {
namespace {

void check_nvrtc(nvrtcResult r, const char* what) {
  if (r != NVRTC_SUCCESS) throw NvrtcError(std::string(what) + ": " + nvrtc().nvrtcGetErrorString(r));
}

// Destroys the program on every path out of nvrtc_compile.
struct Program {
  nvrtcProgram prog = nullptr;
  ~Program() {
    if (prog) nvrtc().nvrtcDestroyProgram(&prog);
  }
};

}  // namespace

CompileOutput nvrtc_compile(const std::string& source, const std::string& name, const std::vector<std::string>& options,
                            bool want_cubin) {
  const NvrtcApi& n = nvrtc();
  Program p;
  check_nvrtc(n.nvrtcCreateProgram(&p.prog, source.c_str(), name.c_str(), 0, nullptr, nullptr), "nvrtcCreateProgram");
  std::vector<const char*> opts;
  opts.reserve(options.size());
  for (const auto& o : options) opts.push_back(o.c_str());
  nvrtcResult r = n.nvrtcCompileProgram(p.prog, static_cast<int>(opts.size()), opts.data());

  CompileOutput out;
  size_t log_size = 0;
  check_nvrtc(n.nvrtcGetProgramLogSize(p.prog, &log_size), "nvrtcGetProgramLogSize");
  out.log.resize(log_size);
  if (log_size) check_nvrtc(n.nvrtcGetProgramLog(p.prog, &out.log[0]), "nvrtcGetProgramLog");
  while (!out.log.empty() && out.log.back() == '\0') out.log.pop_back();

  if (r == NVRTC_ERROR_COMPILATION) {
    out.ok = false;
    return out;
  }
  if (r != NVRTC_SUCCESS) {
    // Option errors land here; they are the caller's mistake, so report them like a failed compile.
    out.ok = false;
    out.log = std::string(n.nvrtcGetErrorString(r)) + (out.log.empty() ? "" : "\n" + out.log);
    return out;
  }
  size_t size = 0;
  if (want_cubin) {
    check_nvrtc(n.nvrtcGetCUBINSize(p.prog, &size), "nvrtcGetCUBINSize");
    if (size == 0) {
      out.ok = false;
      out.log += "\nNVRTC produced no cubin: pass a real architecture (-arch=sm_XY), not compute_XY";
      return out;
    }
    out.image.resize(size);
    check_nvrtc(n.nvrtcGetCUBIN(p.prog, &out.image[0]), "nvrtcGetCUBIN");
  } else {
    check_nvrtc(n.nvrtcGetPTXSize(p.prog, &size), "nvrtcGetPTXSize");
    out.image.resize(size);
    check_nvrtc(n.nvrtcGetPTX(p.prog, &out.image[0]), "nvrtcGetPTX");
  }
  out.ok = true;
  return out;
}

std::pair<int, int> nvrtc_version() {
  int major = 0, minor = 0;
  check_nvrtc(nvrtc().nvrtcVersion(&major, &minor), "nvrtcVersion");
  return {major, minor};
}

}  // namespace kforge
