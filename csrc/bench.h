// The CUDA-event benchmark harness: one event pair per rep, the L2 flushed before each.
#pragma once

#include <cstdint>
#include <vector>

#include "launcher.h"

namespace kforge {

struct BenchConfig {
  uint64_t flush_ptr = 0;  // device buffer written before every rep (>= 2x L2 so nothing stays cached)
  size_t flush_bytes = 0;
  double warmup_ms = 25;
  int min_reps = 100;
  double min_ms = 200;
  int max_reps = 10000;
};

// Times plan.launch; input sets are rotated rep by rep. Returns milliseconds per rep.
std::vector<float> bench_plan(const Plan& plan, const std::vector<std::vector<uint64_t>>& input_sets,
                              const std::vector<uint64_t>& outputs, const std::vector<uint64_t>& workspaces,
                              uint64_t stream, const BenchConfig& cfg);

}  // namespace kforge
