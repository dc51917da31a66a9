// Python bindings of the C++ core (kforge._C). See python/kforge/_C.pyi for the API.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bench.h"
#include "compiler.h"
#include "cuda_api.h"
#include "launcher.h"
#include "registry.h"

namespace py = pybind11;
using namespace kforge;

namespace {

Dim3 to_dim3(const std::vector<unsigned>& v, const char* what) {
  if (v.empty() || v.size() > 3) throw std::invalid_argument(std::string(what) + " needs 1 to 3 dimensions");
  Dim3 d;
  d.x = v[0];
  if (v.size() > 1) d.y = v[1];
  if (v.size() > 2) d.z = v[2];
  return d;
}

Arg to_arg(const py::handle& item) {
  auto t = item.cast<py::tuple>();
  if (t.size() != 2) throw std::invalid_argument("a launch argument is a (kind, value) pair");
  Arg a;
  a.kind = parse_arg_kind(t[0].cast<std::string>());
  if (a.kind == ArgKind::F32 || a.kind == ArgKind::F64)
    a.f = t[1].cast<double>();
  else
    a.i = t[1].cast<int64_t>();
  return a;
}

std::vector<Arg> to_args(const py::sequence& seq) {
  std::vector<Arg> args;
  for (auto item : seq) args.push_back(to_arg(item));
  return args;
}

std::shared_ptr<Plan> make_plan(const py::sequence& kernels, const py::sequence& workspace) {
  std::vector<KernelSpec> specs;
  for (auto item : kernels) {
    auto t = item.cast<py::tuple>();
    if (t.size() < 5 || t.size() > 8)
      throw std::invalid_argument("a plan kernel is (function, grid, block, smem, args[, cooperative[, pdl[, cluster]]])");
    KernelSpec k;
    k.fn = t[0].cast<Function>();
    k.grid = to_dim3(t[1].cast<std::vector<unsigned>>(), "grid");
    k.block = to_dim3(t[2].cast<std::vector<unsigned>>(), "block");
    k.smem = t[3].cast<unsigned>();
    k.args = to_args(t[4].cast<py::sequence>());
    k.cooperative = t.size() >= 6 && t[5].cast<bool>();
    k.pdl = t.size() >= 7 && t[6].cast<bool>();
    k.cluster = t.size() == 8 ? t[7].cast<unsigned>() : 0;
    if (k.cooperative && k.pdl) throw std::invalid_argument("a plan kernel is cooperative or pdl, not both");
    if (k.cluster && (k.cooperative || k.cluster > 16 || k.grid.x % k.cluster))
      throw std::invalid_argument("a cluster is 1 to 16 blocks along x that divide the grid, and not cooperative");
    specs.push_back(std::move(k));
  }
  std::vector<WorkspaceSpec> ws;
  for (auto item : workspace) {
    auto t = item.cast<py::tuple>();
    ws.push_back({t[0].cast<size_t>(), t[1].cast<bool>()});
  }
  return std::make_shared<Plan>(std::move(specs), std::move(ws));
}

// The Python types live in kforge.errors, so the error a caller catches is one type whether
// C++ or Python raised it, with the driver's error as data (.name, .code), not as text.
void raise_cuda_error(const char* type, const CudaError& e) {
  py::object cls = py::module_::import("kforge.errors").attr(type);
  py::object err = cls(e.what(), e.name, static_cast<int>(e.code));
  PyErr_SetObject(cls.ptr(), err.ptr());
}

int attr(int a, CUdevice dev) {
  int v = 0;
  check(driver().cuDeviceGetAttribute(&v, a, dev), "reading device attribute " + std::to_string(a));
  return v;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kforge C++ core: NVRTC compiler, driver-API launcher, CUDA-event harness, dispatch registry";

  static py::exception<NvrtcError> nvrtc_error(m, "NvrtcError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const LaunchRefused& e) {
      raise_cuda_error("LaunchRefused", e);
    } catch (const CudaError& e) {
      raise_cuda_error("CudaError", e);
    } catch (const NvrtcError& e) {
      py::set_error(nvrtc_error, e.what());
    }
  });

  // ---- NVRTC ----
  m.def("nvrtc_load", &load_nvrtc, py::arg("path"));
  m.def("nvrtc_version", &nvrtc_version);
  m.def(
      "nvrtc_compile",
      [](const std::string& source, const std::string& name, const std::vector<std::string>& options, bool want_cubin) {
        CompileOutput out;
        {
          py::gil_scoped_release release;  // compiles take 100s of ms; let other threads run
          out = nvrtc_compile(source, name, options, want_cubin);
        }
        return py::make_tuple(out.ok, py::bytes(out.image), py::bytes(out.log));  // the log may quote non-UTF-8 bytes
      },
      py::arg("source"), py::arg("name"), py::arg("options"), py::arg("want_cubin") = true);

  // ---- driver ----
  m.def("cuda_load", &load_driver, py::arg("path") = "libcuda.so.1");
  m.def("driver_version", [] {
    int v = 0;
    check(driver().cuDriverGetVersion(&v), "reading the driver version");
    return v;
  });
  m.def("device_count", [] {
    int n = 0;
    check(driver().cuDeviceGetCount(&n), "counting devices");
    return n;
  });
  m.def("device_attributes", [](int ordinal) {
    const DriverApi& d = driver();
    CUdevice dev;
    check(d.cuDeviceGet(&dev, ordinal), "getting device " + std::to_string(ordinal));
    char name[256] = {0};
    check(d.cuDeviceGetName(name, sizeof name, dev), "reading the device name");
    size_t mem = 0;
    check(d.cuDeviceTotalMem(&mem, dev), "reading the device memory size");
    py::dict out;
    out["name"] = std::string(name);
    out["cc"] = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev) * 10 +
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
    out["sm_count"] = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    out["l2_bytes"] = attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev);
    out["smem_per_block_optin"] = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev);
    out["max_threads_per_block"] = attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, dev);
    out["mem_bytes"] = mem;
    return out;
  }, py::arg("ordinal"));
  m.def("synchronize", [](int ordinal) {
    ContextGuard guard(primary_context(ordinal));
    py::gil_scoped_release release;
    check(driver().cuCtxSynchronize(), "synchronizing device " + std::to_string(ordinal));
  }, py::arg("ordinal"));

  py::class_<Function>(m, "Function").def_readonly("name", &Function::name);

  py::class_<Module, std::shared_ptr<Module>>(m, "Module")
      .def(py::init([](py::bytes image, int ordinal) {
             std::string bytes(image);
             py::gil_scoped_release release;  // loading a large cubin takes milliseconds
             return std::make_shared<Module>(bytes, ordinal);
           }),
           py::arg("image"), py::arg("ordinal"))
      .def("function", [](std::shared_ptr<Module> self, const std::string& name) {
        return Function{self, self->function(name), name};
      }, py::arg("name"));

  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def(py::init(&make_plan), py::arg("kernels"), py::arg("workspace") = py::list())
      .def("launch", &Plan::launch, py::arg("inputs"), py::arg("outputs"), py::arg("workspaces"), py::arg("stream"));

  m.def(
      "bench",
      [](const Plan& plan, const std::vector<std::vector<uint64_t>>& inputs, const std::vector<uint64_t>& outputs,
         const std::vector<uint64_t>& workspaces, uint64_t stream, uint64_t flush_ptr, size_t flush_bytes,
         double warmup_ms, int min_reps, double min_ms, int max_reps) {
        BenchConfig cfg{flush_ptr, flush_bytes, warmup_ms, min_reps, min_ms, max_reps};
        py::gil_scoped_release release;
        return bench_plan(plan, inputs, outputs, workspaces, stream, cfg);
      },
      py::arg("plan"), py::arg("inputs"), py::arg("outputs"), py::arg("workspaces"), py::arg("stream"),
      py::arg("flush_ptr"), py::arg("flush_bytes"), py::arg("warmup_ms") = 25.0, py::arg("min_reps") = 100,
      py::arg("min_ms") = 200.0, py::arg("max_reps") = 10000);

  py::class_<Registry>(m, "Registry")
      .def(py::init<>())
      .def("add", &Registry::add, py::arg("plan"))
      .def("launch", &Registry::launch, py::arg("id"), py::arg("inputs"), py::arg("outputs"), py::arg("workspaces"),
           py::arg("stream"))
      .def("__len__", &Registry::size)
      // For kforge._dispatch: launch_address() is kforge_registry_launch (registry.h), address() this
      // registry, valid while the Python object lives.
      .def("address", [](const Registry& self) { return reinterpret_cast<uintptr_t>(&self); })
      .def_static("launch_address", [] { return reinterpret_cast<uintptr_t>(&kforge_registry_launch); });
}
