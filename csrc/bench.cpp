#include "bench.h"

#include <algorithm>
#include <cmath>

namespace kforge {
namespace {

// Events are created and destroyed together so an exception cannot leak them.
struct Events {
  std::vector<CUevent> ev;
  explicit Events(size_t n) {
    ev.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      CUevent e;
      check(driver().cuEventCreate(&e, 0), "creating a CUDA event");
      ev.push_back(e);
    }
  }
  ~Events() {
    for (CUevent e : ev) driver().cuEventDestroy(e);
  }
};

}  // namespace

std::vector<float> bench_plan(const Plan& plan, const std::vector<std::vector<uint64_t>>& input_sets,
                              const std::vector<uint64_t>& outputs, const std::vector<uint64_t>& workspaces,
                              uint64_t stream, const BenchConfig& cfg) {
  if (input_sets.empty()) throw std::invalid_argument("bench needs at least one input set");
  const DriverApi& d = driver();
  CUstream s = reinterpret_cast<CUstream>(stream);
  ContextGuard guard(plan.context());  // declared before the events, so it outlives them
  auto flush = [&] {
    if (cfg.flush_bytes >= 4)
      check(d.cuMemsetD32Async(cfg.flush_ptr, 0x5a5a5a5a, cfg.flush_bytes / 4, s), "flushing the L2 cache");
  };
  auto elapsed = [&](CUevent a, CUevent b) {
    float ms = 0;
    check(d.cuEventElapsedTime(&ms, a, b), "reading CUDA event times");
    return ms;
  };

  // The first launch of a function may load it (CUDA's lazy loading); that must not be
  // the launch that sizes the warm-up and the rep count.
  plan.launch(input_sets[0], outputs, workspaces, stream);
  check(d.cuStreamSynchronize(s), "synchronizing after the first launch");

  // Size the warm-up by time: one timed launch estimates the cost of a rep.
  Events probe(2);
  flush();
  check(d.cuEventRecord(probe.ev[0], s), "recording an event");
  plan.launch(input_sets[0], outputs, workspaces, stream);
  check(d.cuEventRecord(probe.ev[1], s), "recording an event");
  check(d.cuEventSynchronize(probe.ev[1]), "waiting for the first timed launch");
  double est = std::max(1e-4, static_cast<double>(elapsed(probe.ev[0], probe.ev[1])));
  int warmup = static_cast<int>(std::min(1000.0, std::ceil(cfg.warmup_ms / est)));
  for (int i = 0; i < warmup; ++i) {
    flush();
    plan.launch(input_sets[i % input_sets.size()], outputs, workspaces, stream);
  }
  check(d.cuStreamSynchronize(s), "synchronizing after warm-up");

  // Clamped as a double first: min_ms / est can exceed INT_MAX. At least one rep, so there is a time.
  double want = std::min<double>(cfg.max_reps, std::ceil(cfg.min_ms / est));
  int reps = std::max({1, cfg.min_reps, static_cast<int>(want)});
  Events ev(2 * static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    flush();
    check(d.cuEventRecord(ev.ev[2 * i], s), "recording an event");
    plan.launch(input_sets[i % input_sets.size()], outputs, workspaces, stream);
    check(d.cuEventRecord(ev.ev[2 * i + 1], s), "recording an event");
  }
  check(d.cuEventSynchronize(ev.ev.back()), "waiting for the timed launches");
  std::vector<float> out(reps);
  for (int i = 0; i < reps; ++i) out[i] = elapsed(ev.ev[2 * i], ev.ev[2 * i + 1]);
  return out;
}

}  // namespace kforge
