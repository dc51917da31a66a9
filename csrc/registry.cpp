#include "registry.h"

#include <cstdio>
#include <stdexcept>
#include <string>

namespace kforge {

int Registry::add(std::shared_ptr<Plan> plan) {
  if (!plan) throw std::invalid_argument("Registry.add needs a Plan, got None");
  std::lock_guard<std::mutex> lock(mu_);
  plans_.push_back(std::move(plan));
  return static_cast<int>(plans_.size() - 1);
}

void Registry::launch(int id, const std::vector<uint64_t>& inputs, const std::vector<uint64_t>& outputs,
                      const std::vector<uint64_t>& workspaces, uint64_t stream) const {
  std::shared_ptr<Plan> plan;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (id < 0 || static_cast<size_t>(id) >= plans_.size() || !plans_[id])
      throw std::out_of_range("no launch plan with id " + std::to_string(id) + " in the registry");
    plan = plans_[id];
  }
  plan->launch(inputs, outputs, workspaces, stream);
}

size_t Registry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plans_.size();
}

}  // namespace kforge

namespace {

int report(char* err, size_t err_len, int code, const char* what) {
  if (err && err_len) std::snprintf(err, err_len, "%s", what);
  return code;
}

}  // namespace

extern "C" int kforge_registry_launch(const void* registry, int vid, const uint64_t* inputs, int n_in,
                                      const uint64_t* outputs, int n_out, const uint64_t* workspaces, int n_ws,
                                      uint64_t stream, char* err, size_t err_len) {
  if (err && err_len) err[0] = '\0';
  try {
    if (!registry) return report(err, err_len, KFORGE_LAUNCH_ERROR, "no registry to launch from");
    static_cast<const kforge::Registry*>(registry)->launch(
        vid, std::vector<uint64_t>(inputs, inputs + n_in), std::vector<uint64_t>(outputs, outputs + n_out),
        std::vector<uint64_t>(workspaces, workspaces + n_ws), stream);
    return KFORGE_LAUNCH_OK;
  } catch (const kforge::LaunchRefused& e) {
    return report(err, err_len, KFORGE_LAUNCH_REFUSED, e.what());
  } catch (const kforge::CudaError& e) {
    return report(err, err_len, KFORGE_LAUNCH_CUDA_ERROR, e.what());
  } catch (const std::exception& e) {
    return report(err, err_len, KFORGE_LAUNCH_ERROR, e.what());
  } catch (...) {
    return report(err, err_len, KFORGE_LAUNCH_ERROR, "unknown C++ exception");
  }
}
