// kforge._dispatch: the guard path of kforge.dispatch as a boxed C++ kernel, reading the guard
// specifications of kforge.guards in their serialized form (GuardSpec.native, GUARD_FORMAT).
//
// One Override per aten op at one dispatch key (CUDA; CPU stands in for tests) replaces the
// Python torch.library kernel, whose round trip into Python is most of a dispatched call's
// host cost. A call is matched against the variants' guards here; a hit allocates outputs
// from torch's allocator and launches through a plain C function pointer (kforge._C's
// kforge_registry_launch) on torch's current stream, so it records into CUDA graphs; a miss
// counts why and calls the kernel that was registered before the override.
//
// Built only where the build's Python has torch, and linked against c10 and torch_cpu alone:
// no torch_python, no CUDA headers (the stream comes through c10's device guard interface).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/AutogradState.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace py = pybind11;

namespace kforge {
namespace {

// kforge_registry_launch's signature (registry.h): 0 on success, 1 on a CUDA error, 2 otherwise.
using LaunchFn = int (*)(const void* ctx, int vid, const uint64_t* inputs, int n_in, const uint64_t* outputs,
                         int n_out, const uint64_t* workspaces, int n_ws, uint64_t stream, char* err, size_t err_len);
constexpr int kLaunchCudaError = 1;
constexpr int kLaunchRefused = 3;  // nothing ran: the call can still go to eager

// Why a call fell back, most fundamental first: the order of kforge.guards.REASONS (checked at import).
// The last, aliasing, is not a guard difference: a call that matched a guard but whose
// written input shares memory with another input (a kernel would read what it writes).
// "autograd": an override above autograd (a composite op's) saw an input that requires grad
// with grad mode on; the kernel has no backward, so eager's decomposition served the call.
// The last two are not guard differences either: "refused", the driver refused the kernel
// before it ran (a cooperative grid that cannot be resident right now), and eager took over.
enum Reason {
  kNoVariant, kDevice, kDtype, kScalar, kShape, kStride, kAlignment, kAliasing, kAutograd, kRefused, kNumReasons
};
constexpr std::array<const char*, kNumReasons> kReasons = {"no-variant", "device", "dtype",    "scalar",   "shape",
                                                           "stride",     "alignment", "aliasing", "autograd", "refused"};

// What the override did for one card. Shared with Python (kforge.variant.Counters reads it),
// and kept across set_variants, so counts survive other packages coming and going.
struct Counts {
  std::atomic<uint64_t> hits{0};
  std::array<std::atomic<uint64_t>, kNumReasons> fallbacks{};
};

// ---- guards: kforge.guards.GuardSpec, as compared here -----------------------------------------

struct TensorGuard {
  bool present = false;  // false: the card has None here
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::DeviceType device = c10::DeviceType::CPU;
  int align = 16;
};

struct ValueGuard {
  enum Kind { None, Bool, Int, Float, Ints, Str, Enum, Device } kind = None;
  bool b = false;
  int64_t i = 0;  // Int, and Enum: a dtype, memory format or layout, which the stack holds as an int
  double f = 0;
  std::vector<int64_t> ints;
  std::string s;
  c10::DeviceType device = c10::DeviceType::CPU;
};

enum class SlotKind { Tensor, Tensors, Value };

struct Slot {
  SlotKind kind = SlotKind::Value;
  TensorGuard tensor;
  std::vector<TensorGuard> tensors;
  ValueGuard value;
};

struct OutSpec {
  int alias = -1;  // index of the input this output is (in-place and out=), or -1: allocate
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

// The Python callable device index -> launcher context (a registry's address). Its reference
// is dropped with the GIL, whichever thread lets go of the variant last.
struct Resolver {
  py::object fn;
  explicit Resolver(py::object f) : fn(std::move(f)) {}
  ~Resolver() {
    if (!Py_IsInitialized()) {
      fn.release();  // the interpreter is gone: nothing to give the reference back to
      return;
    }
    py::gil_scoped_acquire gil;
    fn = py::object();
  }
};

constexpr size_t kMaxDevices = 64;

struct Variant {
  std::vector<Slot> slots;  // one per schema argument
  std::vector<OutSpec> outputs;
  std::vector<int64_t> workspace;  // bytes per workspace buffer
  std::vector<int> written;        // inputs (card order) the kernel writes: in-place and out= arguments
  std::vector<size_t> device_slots;  // Device arguments: each must name the inputs' device
  LaunchFn fn = nullptr;
  int vid = 0;
  std::shared_ptr<Resolver> resolver;
  std::shared_ptr<Counts> counts;
  // Launcher context by device index + 1 (CPU tensors have index -1), resolved on first use.
  mutable std::array<std::atomic<uint64_t>, kMaxDevices + 1> ctx{};
  mutable std::array<std::atomic<bool>, kMaxDevices + 1> ctx_known{};
  mutable std::array<std::atomic<bool>, kMaxDevices + 1> ctx_failed{};  // could not be prepared there: eager serves
};

// The differences of a call from one variant: the most fundamental reason and how many.
struct Diff {
  int first = kNumReasons;
  int count = 0;
  void add(int reason) {
    if (reason < first) first = reason;
    ++count;
  }
};

int alignment_of(const void* p) {
  const auto low = reinterpret_cast<uintptr_t>(p) & 15;
  for (int a : {16, 8, 4, 2})
    if (low % a == 0) return a;
  return 1;
}

bool same(c10::IntArrayRef got, const std::vector<int64_t>& want) {
  return got.size() == want.size() && std::equal(got.begin(), got.end(), want.begin());
}

// As kforge.guards._tensor_differences: a Python scalar in a tensor slot (here a wrapped
// number), a conjugate or negative view (the bit is part of what the kernel must do) or
// None where the card has a tensor (or the other way round) differ by "no-variant".
bool defined(const c10::IValue& v) { return v.isTensor() && v.toTensor().defined(); }

void compare_tensor(const c10::IValue& v, const TensorGuard& g, Diff& d) {
  const at::Tensor* t = defined(v) ? &v.toTensor() : nullptr;
  if (!t && !v.isNone() && !v.isTensor()) return d.add(kNoVariant);
  if (!t || !g.present) {
    if (t || g.present) d.add(kNoVariant);
    return;
  }
  if (t->unsafeGetTensorImpl()->is_wrapped_number() || t->is_conj() || t->is_neg() || t->layout() != c10::kStrided)
    return d.add(kNoVariant);
  if (t->device().type() != g.device) d.add(kDevice);
  if (t->scalar_type() != g.dtype) d.add(kDtype);
  if (!same(t->sizes(), g.sizes)) d.add(kShape);
  if (!same(t->strides(), g.strides)) d.add(kStride);
  if (alignment_of(t->const_data_ptr()) != g.align) d.add(kAlignment);
}

bool int_of(const c10::IValue& v, int64_t& out) {
  if (v.isInt()) {
    out = v.toInt();
    return true;
  }
  if (v.isSymInt()) {
    auto i = v.toSymInt().maybe_as_int();
    if (i) out = *i;
    return i.has_value();
  }
  return false;
}

// As kforge.guards.value_key: 1, 1.0 and True differ; 0.0 and -0.0 differ; NaN equals NaN.
bool value_equal(const c10::IValue& v, const ValueGuard& g) {
  int64_t i = 0;
  switch (g.kind) {
    case ValueGuard::None: return v.isNone();
    case ValueGuard::Bool: return v.isBool() && v.toBool() == g.b;
    case ValueGuard::Int: return int_of(v, i) && i == g.i;
    case ValueGuard::Enum: return v.isInt() && v.toInt() == g.i;
    case ValueGuard::Float: {
      if (!v.isDouble()) return false;
      const double x = v.toDouble();
      if (std::isnan(x) || std::isnan(g.f)) return std::isnan(x) && std::isnan(g.f);
      return std::memcmp(&x, &g.f, sizeof x) == 0;
    }
    case ValueGuard::Ints: {
      if (!v.isList()) return false;
      auto items = v.toListRef();
      if (items.size() != g.ints.size()) return false;
      for (size_t k = 0; k < items.size(); ++k)
        if (!int_of(items[k], i) || i != g.ints[k]) return false;
      return true;
    }
    case ValueGuard::Str: return v.isString() && v.toStringRef() == g.s;
    case ValueGuard::Device: return v.isDevice() && v.toDevice().type() == g.device;
  }
  return false;
}

// Every way a call differs from a variant (see kforge.guards.differences); with `stop`, only
// whether it differs at all.
Diff compare(const Variant& v, c10::ArrayRef<c10::IValue> args, bool stop) {
  Diff d;
  for (size_t a = 0; a < args.size() && !(stop && d.count); ++a) {
    const Slot& s = v.slots[a];
    switch (s.kind) {
      case SlotKind::Tensor: compare_tensor(args[a], s.tensor, d); break;
      case SlotKind::Tensors: {
        if (!args[a].isList()) {
          d.add(kNoVariant);
          break;
        }
        auto items = args[a].toListRef();
        if (items.size() != s.tensors.size()) {
          d.add(kNoVariant);
          break;
        }
        for (size_t k = 0; k < items.size() && !(stop && d.count); ++k) compare_tensor(items[k], s.tensors[k], d);
        break;
      }
      case SlotKind::Value:
        if (!value_equal(args[a], s.value)) d.add(kScalar);
        break;
    }
  }
  return d;
}

// ---- the override of one op -------------------------------------------------------------------

struct Table {
  std::vector<std::shared_ptr<const Variant>> variants;  // later ones win on equal guards
};

class State {
 public:
  State(c10::OperatorHandle op, c10::SafeKernelFunction original, std::string name, bool above_autograd)
      : op_(std::move(op)),
        original_(std::move(original)),
        name_(std::move(name)),
        above_autograd_(above_autograd),
        num_args_(op_.schema().arguments().size()),
        table_(std::make_shared<Table>()) {}

  size_t num_args() const { return num_args_; }
  size_t num_returns() const { return op_.schema().returns().size(); }
  const std::string& name() const { return name_; }

  std::shared_ptr<const Table> table() const {
    std::lock_guard<std::mutex> lock(mu_);
    return table_;
  }

  void set_table(std::shared_ptr<const Table> t) {
    std::shared_ptr<const Table> old;  // dropped outside the lock: its resolvers take the GIL
    std::lock_guard<std::mutex> lock(mu_);
    old.swap(table_);
    table_ = std::move(t);
  }

  void call(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) const {
    // Above autograd, a call on anything but plain dense tensors belongs to the layer that
    // wraps them (fake tensors, functionalization, functorch, subclasses and modes, lazy
    // views); it goes to the decomposition, uncounted, before any guard reads a pointer.
    if (above_autograd_ && !(ks & wrapped_keys()).empty()) {
      original_.callBoxed(op, ks, stack);
      return;
    }
    const auto table = this->table();
    const auto args = torch::jit::last(*stack, num_args_);
    const auto& vs = table->variants;
    for (auto it = vs.rbegin(); it != vs.rend(); ++it) {
      if (compare(**it, args, /*stop=*/true).count != 0) continue;
      const Variant& v = **it;
      Inputs ins = inputs(v, args);
      int why = unrunnable(v, ins, args);
      if (why == kNumReasons && above_autograd_ && needs_grad(ins)) why = kAutograd;
      if (why == kNumReasons) why = run(v, ins, stack);
      if (why == kNumReasons) return;
      v.counts->fallbacks[why].fetch_add(1, std::memory_order_relaxed);
      original_.callBoxed(op, ks, stack);
      return;
    }
    count_miss(vs, args);
    original_.callBoxed(op, ks, stack);
  }

 private:
  using Inputs = c10::SmallVector<const at::Tensor*, 8>;

  // Inputs in card order: tensor arguments and the tensors of list arguments, None left out.
  static Inputs inputs(const Variant& v, c10::ArrayRef<c10::IValue> args) {
    Inputs ins;
    for (size_t a = 0; a < args.size(); ++a) {
      if (v.slots[a].kind == SlotKind::Tensor && defined(args[a])) {
        ins.push_back(&args[a].toTensor());
      } else if (v.slots[a].kind == SlotKind::Tensors) {
        for (const auto& item : args[a].toListRef())
          if (defined(item)) ins.push_back(&item.toTensor());
      }
    }
    return ins;
  }

  // What the guard key cannot see: every input on one device, and any device argument
  // naming that device, an index-less one meaning the current device (the key holds device
  // types, not indices, and a kernel launched on one device cannot read or write another's
  // memory: x.to("cuda:1") of a cuda:0 tensor is eager's), and no written input sharing
  // memory with another input. kNumReasons when runnable.
  // Grad mode on and an input that requires grad, or an input with a forward-mode tangent:
  // only eager's decomposition records the backward or carries the tangent.
  static bool needs_grad(const Inputs& ins) {
    const bool grad = c10::GradMode::is_enabled(), forward = c10::AutogradState::get_tls_state().get_fw_grad_mode();
    for (const at::Tensor* t : ins) {
      if (grad && t->requires_grad()) return true;
      if (forward && t->_fw_grad(/*level=*/0).defined()) return true;
    }
    return false;
  }

  // The layers between autograd and the backend a kernel must not bypass (kforge.composite.WRAPPED).
  static c10::DispatchKeySet wrapped_keys() {
    using K = c10::DispatchKey;
    static const c10::DispatchKeySet keys({K::Python, K::PythonTLSSnapshot, K::Functionalize,
                                           K::FuncTorchDynamicLayerFrontMode, K::FuncTorchDynamicLayerBackMode,
                                           K::FuncTorchGradWrapper, K::FuncTorchBatched, K::FuncTorchVmapMode,
                                           K::Batched, K::BatchedNestedTensor, K::Conjugate, K::Negative,
                                           K::ZeroTensor, K::Sparse, K::SparseCsr, K::NestedTensor, K::Quantized});
    return keys;
  }

  static int unrunnable(const Variant& v, const Inputs& ins, c10::ArrayRef<c10::IValue> args) {
    const c10::Device device = ins.front()->device();
    for (const at::Tensor* t : ins)
      if (t->device() != device) return kDevice;
    for (size_t slot : v.device_slots) {
      if (!args[slot].isDevice()) continue;  // None
      c10::Device d = args[slot].toDevice();
      // An index-less device means the current one ("cuda" is whichever device is current).
      if (!d.has_index() && d.type() != c10::DeviceType::CPU)
        d = c10::impl::getDeviceGuardImpl(d.type())->getDevice();
      if (d.has_index() && d != device) return kDevice;
    }
    for (int w : v.written) {
      for (size_t i = 0; i < ins.size(); ++i) {
        if (static_cast<int>(i) != w && ins[i]->storage().is_alias_of(ins[w]->storage())) return kAliasing;
      }
    }
    return kNumReasons;
  }

  // Launches the variant and replaces the arguments on the stack with its outputs
  // (kNumReasons); or, with the stack untouched, why eager must serve the call: the kernel
  // could not be prepared on this device (kDevice), or the driver refused the launch
  // before anything ran (kRefused).
  int run(const Variant& v, const Inputs& ins, torch::jit::Stack* stack) const {
    const c10::Device device = ins.front()->device();
    uint64_t ctx = 0;
    if (!context(v, device.index(), ctx)) return kDevice;
    c10::SmallVector<at::Tensor, 4> outs;
    for (const auto& o : v.outputs) {
      outs.push_back(o.alias >= 0 ? *ins[o.alias]
                                  : at::empty_strided(o.sizes, o.strides, at::TensorOptions().dtype(o.dtype).device(device)));
    }
    c10::SmallVector<at::Tensor, 2> ws;
    for (int64_t n : v.workspace) ws.push_back(at::empty({n}, at::TensorOptions().dtype(at::kByte).device(device)));
    // Outputs first: taking a writable pointer may materialize a copy-on-write input it aliases.
    c10::SmallVector<uint64_t, 4> out_ptrs, ws_ptrs;
    c10::SmallVector<uint64_t, 8> in_ptrs;
    for (auto& t : outs) out_ptrs.push_back(reinterpret_cast<uint64_t>(t.mutable_data_ptr()));
    for (auto& t : ws) ws_ptrs.push_back(reinterpret_cast<uint64_t>(t.mutable_data_ptr()));
    for (const at::Tensor* t : ins) in_ptrs.push_back(reinterpret_cast<uint64_t>(t->const_data_ptr()));
    uint64_t stream = 0;  // the CPU has none
    if (device.is_cuda()) {
      stream = reinterpret_cast<uint64_t>(
          c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle());
    }
    char err[2048];
    err[0] = '\0';
    const int rc = v.fn(reinterpret_cast<const void*>(ctx), v.vid, in_ptrs.data(),
                        static_cast<int>(in_ptrs.size()), out_ptrs.data(), static_cast<int>(out_ptrs.size()),
                        ws_ptrs.data(), static_cast<int>(ws_ptrs.size()), stream, err, sizeof err);
    if (rc == kLaunchRefused) return kRefused;
    if (rc != 0) {
      err[sizeof err - 1] = '\0';
      // "CUDA error" lets kforge.worker (and people) tell a device fault from a refused launch.
      TORCH_CHECK(false, rc == kLaunchCudaError ? "CUDA error in" : "launch failed in", " kforge's kernel for ", name_,
                  " (variant ", v.vid, "): ", err);
    }
    v.counts->hits.fetch_add(1, std::memory_order_relaxed);
    torch::jit::drop(*stack, num_args_);
    for (auto& t : outs) stack->emplace_back(std::move(t));
    return kNumReasons;
  }

  // The launcher context for a device, resolved once through Python. False when it cannot be
  // had there (a module that does not load on that GPU): remembered, warned about once, and
  // every call on that device goes to eager.
  static bool context(const Variant& v, c10::DeviceIndex index, uint64_t& out) {
    const size_t slot = static_cast<size_t>(index + 1);
    if (slot < v.ctx.size()) {
      if (v.ctx_failed[slot].load(std::memory_order_acquire)) return false;
      if (v.ctx_known[slot].load(std::memory_order_acquire)) {
        out = v.ctx[slot].load(std::memory_order_relaxed);
        return true;
      }
    }
    uint64_t ctx = 0;
    std::string error;
    {
      py::gil_scoped_acquire gil;
      try {
        ctx = v.resolver->fn(static_cast<int>(index)).cast<uint64_t>();
      } catch (py::error_already_set& e) {
        error = e.what();
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    if (!error.empty()) {
      TORCH_WARN("kforge could not prepare its kernel on device ", static_cast<int>(index), " (", error,
                 "); calls there run PyTorch's kernel");
      if (slot < v.ctx.size()) v.ctx_failed[slot].store(true, std::memory_order_release);
      return false;
    }
    if (slot < v.ctx.size()) {
      v.ctx[slot].store(ctx, std::memory_order_relaxed);
      v.ctx_known[slot].store(true, std::memory_order_release);
    }
    out = ctx;
    return true;
  }

  // Charged to the nearest variant: its most fundamental difference is the least fundamental,
  // then it differs in the fewest ways, then it was installed first (as kforge.guards.nearest).
  static void count_miss(const std::vector<std::shared_ptr<const Variant>>& vs, c10::ArrayRef<c10::IValue> args) {
    const Variant* nearest = nullptr;
    Diff best;
    for (const auto& v : vs) {
      Diff d = compare(*v, args, /*stop=*/false);
      if (d.count == 0) d.add(kNoVariant);
      if (!nearest || d.first > best.first || (d.first == best.first && d.count < best.count)) {
        nearest = v.get();
        best = d;
      }
    }
    if (nearest) nearest->counts->fallbacks[best.first].fetch_add(1, std::memory_order_relaxed);
  }

  c10::OperatorHandle op_;
  c10::SafeKernelFunction original_;
  std::string name_;
  bool above_autograd_;  // registered at CompositeImplicitAutograd: grad mode is this override's to check
  size_t num_args_;
  mutable std::mutex mu_;
  std::shared_ptr<const Table> table_;
};

class Kernel final : public c10::OperatorKernel {
 public:
  explicit Kernel(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    state_->call(op, ks, stack);
  }

 private:
  std::shared_ptr<const State> state_;
};

// Swallows the dispatcher's "Overriding a previously registered kernel" warning (overriding is
// the point) and passes every other warning on.
class QuietOverride final : public c10::WarningHandler {
 public:
  explicit QuietOverride(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& w) override {
    if (w.msg().find("Overriding a previously registered kernel") != std::string::npos) return;
    if (next_) next_->process(w);
  }

 private:
  c10::WarningHandler* next_;
};

// ---- building variants from Python's descriptions (kforge.native_override) ----------------------

c10::ScalarType parse_dtype(const std::string& name) {
  const auto& names = c10::getStringToDtypeMap();
  auto it = names.find(name);
  if (it == names.end()) throw std::invalid_argument("unknown dtype '" + name + "'");
  return it->second;
}

c10::DeviceType parse_device(const std::string& name) { return c10::Device(name).type(); }

int64_t parse_enum(const std::string& name) {
  static const std::pair<const char*, int64_t> names[] = {
      {"contiguous_format", static_cast<int64_t>(c10::MemoryFormat::Contiguous)},
      {"preserve_format", static_cast<int64_t>(c10::MemoryFormat::Preserve)},
      {"channels_last", static_cast<int64_t>(c10::MemoryFormat::ChannelsLast)},
      {"channels_last_3d", static_cast<int64_t>(c10::MemoryFormat::ChannelsLast3d)},
      {"strided", static_cast<int64_t>(c10::kStrided)},
  };
  for (const auto& [n, v] : names)
    if (name == n) return v;
  return static_cast<int64_t>(parse_dtype(name));
}

TensorGuard to_tensor_guard(const py::handle& h) {
  TensorGuard g;
  if (h.is_none()) return g;
  auto t = h.cast<py::tuple>();
  if (t.size() != 5) throw std::invalid_argument("a tensor guard is (sizes, strides, dtype, device, align)");
  g.present = true;
  g.sizes = t[0].cast<std::vector<int64_t>>();
  g.strides = t[1].cast<std::vector<int64_t>>();
  g.dtype = parse_dtype(t[2].cast<std::string>());
  g.device = parse_device(t[3].cast<std::string>());
  g.align = t[4].cast<int>();
  if (g.sizes.size() != g.strides.size()) throw std::invalid_argument("a tensor guard needs one stride per size");
  return g;
}

ValueGuard to_value_guard(const py::handle& h) {
  auto t = h.cast<py::tuple>();
  if (t.size() < 1) throw std::invalid_argument("a value guard is (kind, value)");
  const auto kind = t[0].cast<std::string>();
  ValueGuard g;
  if (kind == "none") return g;
  if (t.size() != 2) throw std::invalid_argument("a value guard is (kind, value)");
  if (kind == "bool") {
    g.kind = ValueGuard::Bool;
    g.b = t[1].cast<bool>();
  } else if (kind == "int") {
    g.kind = ValueGuard::Int;
    g.i = t[1].cast<int64_t>();
  } else if (kind == "float") {
    g.kind = ValueGuard::Float;
    g.f = t[1].cast<double>();
  } else if (kind == "ints") {
    g.kind = ValueGuard::Ints;
    g.ints = t[1].cast<std::vector<int64_t>>();
  } else if (kind == "str") {
    g.kind = ValueGuard::Str;
    g.s = t[1].cast<std::string>();
  } else if (kind == "enum") {
    g.kind = ValueGuard::Enum;
    g.i = parse_enum(t[1].cast<std::string>());
  } else if (kind == "device") {
    g.kind = ValueGuard::Device;
    g.device = parse_device(t[1].cast<std::string>());
  } else {
    throw std::invalid_argument("unknown value guard kind '" + kind + "'");
  }
  return g;
}

// The guard format this module reads (kforge.guards.FORMAT): bumped with any change to it.
constexpr int kGuardFormat = 1;  // kforge.guards.FORMAT

// A variant's guard specification as kforge.guards.GuardSpec.native() writes it:
// (format, slots, written, device slots); returns how many tensor inputs it guards.
size_t read_guard(const py::handle& h, const State& state, Variant& v) {
  auto g = h.cast<py::tuple>();
  if (g.size() != 4) throw std::invalid_argument("a guard is (format, slots, written, device_slots)");
  const int format = g[0].cast<int>();
  if (format != kGuardFormat)
    throw std::invalid_argument("guard format " + std::to_string(format) + ", this kforge._dispatch reads " +
                                std::to_string(kGuardFormat) + ": rebuild kforge");
  size_t inputs = 0;
  for (auto item : g[1].cast<py::sequence>()) {
    auto s = item.cast<py::tuple>();
    if (s.size() != 2) throw std::invalid_argument("a slot is (kind, guard)");
    const auto kind = s[0].cast<std::string>();
    Slot slot;
    if (kind == "tensor") {
      slot.kind = SlotKind::Tensor;
      slot.tensor = to_tensor_guard(s[1]);
      inputs += slot.tensor.present;
    } else if (kind == "tensors") {
      slot.kind = SlotKind::Tensors;
      for (auto t : s[1].cast<py::sequence>()) {
        slot.tensors.push_back(to_tensor_guard(t));
        inputs += slot.tensors.back().present;
      }
    } else if (kind == "value") {
      slot.value = to_value_guard(s[1]);
    } else {
      throw std::invalid_argument("unknown slot kind '" + kind + "'");
    }
    v.slots.push_back(std::move(slot));
  }
  if (v.slots.size() != state.num_args())
    throw std::invalid_argument(state.name() + " takes " + std::to_string(state.num_args()) + " arguments, the guard has " +
                                std::to_string(v.slots.size()));
  if (inputs == 0) throw std::invalid_argument("a variant needs a tensor input to guard on");
  for (auto w : g[2].cast<std::vector<int>>()) {
    if (w < 0 || static_cast<size_t>(w) >= inputs) throw std::invalid_argument("written input " + std::to_string(w) + " names no input");
    v.written.push_back(w);
  }
  for (auto d : g[3].cast<std::vector<size_t>>()) {
    if (d >= v.slots.size() || v.slots[d].kind != SlotKind::Value)
      throw std::invalid_argument("device slot " + std::to_string(d) + " is not a value argument");
    v.device_slots.push_back(d);
  }
  return inputs;
}

std::shared_ptr<const Variant> to_variant(const py::handle& h, const State& state) {
  auto t = h.cast<py::tuple>();
  if (t.size() != 7)
    throw std::invalid_argument("a variant is (guard, outputs, workspace, launch_address, vid, resolve, counts)");
  auto v = std::make_shared<Variant>();
  const size_t inputs = read_guard(t[0], state, *v);
  for (auto item : t[1].cast<py::sequence>()) {
    auto o = item.cast<py::tuple>();
    if (o.size() != 4) throw std::invalid_argument("an output is (alias, sizes, strides, dtype)");
    OutSpec spec;
    if (!o[0].is_none()) {
      spec.alias = o[0].cast<int>();
      if (spec.alias < 0 || static_cast<size_t>(spec.alias) >= inputs)
        throw std::invalid_argument("output alias " + std::to_string(spec.alias) + " names no input");
    } else {
      spec.sizes = o[1].cast<std::vector<int64_t>>();
      spec.strides = o[2].cast<std::vector<int64_t>>();
      spec.dtype = parse_dtype(o[3].cast<std::string>());
    }
    v->outputs.push_back(std::move(spec));
  }
  if (v->outputs.size() != state.num_returns())
    throw std::invalid_argument(state.name() + " returns " + std::to_string(state.num_returns()) + " tensors, the variant has " +
                                std::to_string(v->outputs.size()) + " outputs");
  v->workspace = t[2].cast<std::vector<int64_t>>();
  v->fn = reinterpret_cast<LaunchFn>(t[3].cast<uintptr_t>());
  if (!v->fn) throw std::invalid_argument("a variant needs a launch function");
  v->vid = t[4].cast<int>();
  v->resolver = std::make_shared<Resolver>(py::reinterpret_borrow<py::object>(t[5]));
  v->counts = t[6].cast<std::shared_ptr<Counts>>();
  return v;
}

// ---- the Python-facing override -------------------------------------------------------------------

class Override {
 public:
  // key: the backend key whose computed kernel serves misses. at: where the override is
  // registered, the same key or, for a composite op (no kernel of its own at the backend),
  // CompositeImplicitAutograd, which puts it above autograd.
  Override(const std::string& op_name, const std::string& overload, const std::string& key, const std::string& at) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(op_name.c_str(), overload.c_str());
    const c10::DispatchKey k = c10::parseDispatchKey(key);
    const c10::DispatchKey where = at.empty() ? k : c10::parseDispatchKey(at);
    if (where != k && where != c10::DispatchKey::CompositeImplicitAutograd)
      throw std::invalid_argument("an override is registered at its backend key or at CompositeImplicitAutograd, not " + at);
    const auto sep = op_name.find("::");
    if (sep == std::string::npos) throw std::invalid_argument("op name '" + op_name + "' has no namespace");
    const std::string ns = op_name.substr(0, sep);
    const std::string name = op_name.substr(sep + 2) + (overload.empty() ? "" : "." + overload);
    // Taken before the override exists: the kernel every miss goes to.
    auto original = op.getComputedKernelForDispatchKey(k);
    state_ = std::make_shared<State>(op, std::move(original), op_name + (overload.empty() ? "" : "." + overload),
                                     where != k);
    QuietOverride quiet(c10::WarningUtils::get_warning_handler());
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    lib_ = std::make_unique<torch::Library>(torch::Library::IMPL, ns, where, "kforge._dispatch (csrc/torch_dispatch.cpp)",
                                            __LINE__);
    lib_->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel>(state_)));
  }

  ~Override() { destroy(); }
  Override(const Override&) = delete;
  Override& operator=(const Override&) = delete;

  void set_variants(const py::sequence& variants) {
    if (!state_) throw std::runtime_error("this override was destroyed: create a new one");
    auto table = std::make_shared<Table>();
    for (auto item : variants) table->variants.push_back(to_variant(item, *state_));
    state_->set_table(std::move(table));
  }

  py::list counters() const {
    py::list out;
    if (!state_) return out;
    for (const auto& v : state_->table()->variants) out.append(py::make_tuple(v->counts->hits.load(), fallbacks(*v->counts)));
    return out;
  }

  static py::dict fallbacks(const Counts& c) {
    py::dict out;
    for (size_t r = 0; r < kNumReasons; ++r) {
      const auto n = c.fallbacks[r].load();
      if (n) out[kReasons[r]] = n;
    }
    return out;
  }

  // Drops the registration, which restores the previous kernel exactly. Calls already inside
  // the kernel finish on the state they hold.
  void destroy() {
    lib_.reset();
    if (state_) {
      state_->set_table(std::make_shared<Table>());  // the variants (and their registries) go now
      // The state itself is never freed: a call that entered the kernel just before the
      // registration went may still be running on it. It is small once its table is empty.
      static std::mutex mu;
      static std::vector<std::shared_ptr<State>> retired;
      std::lock_guard<std::mutex> lock(mu);
      retired.push_back(std::move(state_));
    }
  }

  bool active() const { return lib_ != nullptr; }

 private:
  std::shared_ptr<State> state_;
  std::unique_ptr<torch::Library> lib_;
};

}  // namespace
}  // namespace kforge

#ifndef KFORGE_TORCH_VERSION
#error "KFORGE_TORCH_VERSION (torch.__version__ at build time) must be defined by the build"
#endif

PYBIND11_MODULE(_dispatch, m) {
  using namespace kforge;
  m.doc() = "kforge's guarded dispatch as a boxed C++ kernel (optional; see csrc/torch_dispatch.cpp)";
  m.attr("TORCH_VERSION") = KFORGE_TORCH_VERSION;
  py::tuple reasons(static_cast<size_t>(kNumReasons));
  for (size_t r = 0; r < kNumReasons; ++r) reasons[r] = kReasons[r];
  m.attr("REASONS") = reasons;
  m.attr("GUARD_FORMAT") = kGuardFormat;

  py::class_<Counts, std::shared_ptr<Counts>>(m, "Counts")
      .def(py::init<>())
      .def_property_readonly("hits", [](const Counts& c) { return c.hits.load(); })
      .def("fallbacks", [](const Counts& c) { return Override::fallbacks(c); });

  py::class_<Override>(m, "Override")
      .def(py::init<const std::string&, const std::string&, const std::string&, const std::string&>(), py::arg("op"),
           py::arg("overload"), py::arg("key"), py::arg("at") = "")
      .def("set_variants", &Override::set_variants, py::arg("variants"))
      .def("counters", &Override::counters)
      .def("destroy", &Override::destroy)
      .def_property_readonly("active", &Override::active);

  m.def(
      "current_stream",
      [](const std::string& device_type, int index) {
        const c10::Device device(c10::Device(device_type).type(), static_cast<c10::DeviceIndex>(index));
        return reinterpret_cast<uint64_t>(c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle());
      },
      py::arg("device_type"), py::arg("index"));
}
