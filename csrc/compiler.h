// In-process CUDA compilation with NVRTC: source + options -> cubin (or PTX) and log.
#pragma once

#include <string>
#include <vector>

namespace kforge {

struct CompileOutput {
  bool ok;            // false: the source did not compile; `log` says why
  std::string image;  // cubin (or PTX when asked) bytes
  std::string log;
};

CompileOutput nvrtc_compile(const std::string& source, const std::string& name, const std::vector<std::string>& options,
                            bool want_cubin);
std::pair<int, int> nvrtc_version();

}  // namespace kforge
