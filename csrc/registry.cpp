#include "registry.h"

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

void Registry::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  plans_.clear();
}

}  // namespace kforge
