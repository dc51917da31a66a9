// The guarded dispatch registry: variant id -> launch plan. Guards are matched in
// Python (a tuple key and a dict lookup); the launch path from here on is C++.
#pragma once

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
  void clear();

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Plan>> plans_;
};

}  // namespace kforge
