"""kforge._C: the C++ core. libcuda and libnvrtc are dlopen'ed on first use."""

from typing import Sequence

class NvrtcError(RuntimeError):
    """NVRTC could not be loaded or failed outside compilation itself."""

# ---- NVRTC -----------------------------------------------------------------------------
def nvrtc_load(path: str) -> None:
    """dlopen libnvrtc at `path` (or a soname). Raises NvrtcError with dlerror() on failure."""

def nvrtc_version() -> tuple[int, int]: ...
def nvrtc_compile(source: str, name: str, options: Sequence[str], want_cubin: bool = True) -> tuple[bool, bytes, bytes]:
    """(ok, cubin or PTX image, log). ok=False means the source did not compile; see log."""

# ---- driver ----------------------------------------------------------------------------
def cuda_load(path: str = "libcuda.so.1") -> None:
    """dlopen the driver and cuInit(0). Raises CudaError (no driver / no device)."""

def driver_version() -> int: ...
def device_count() -> int: ...
def device_attributes(ordinal: int) -> dict:
    """name, cc (major*10+minor), sm_count, l2_bytes, smem_per_block_optin, max_threads_per_block, mem_bytes."""

def synchronize(ordinal: int) -> None: ...

class Function:
    name: str

class Module:
    def __init__(self, image: bytes, ordinal: int) -> None:
        """Load a cubin into the device's primary context (the one PyTorch uses)."""
    def function(self, name: str) -> Function: ...

class Plan:
    """A launch plan resolved to functions: the registry entry and the fast dispatch path.

    kernels: [(fn, grid, block, smem, [(kind, value)][, cooperative[, pdl[, cluster]]])] with kind
    in in/out/ws/ptr/i32/i64/f32/f64; a cooperative kernel is launched with every block resident
    (cuLaunchCooperativeKernel), a pdl one with programmatic stream serialization and a cluster
    one (cluster > 0 blocks along x, dividing the grid) as thread block clusters (both through
    cuLaunchKernelEx), every fn loaded on one device. workspace: [(bytes, zero)].
    """
    def __init__(self, kernels: Sequence[tuple], workspace: Sequence[tuple[int, bool]] = ()) -> None: ...
    def launch(self, inputs: Sequence[int], outputs: Sequence[int], workspaces: Sequence[int], stream: int) -> None:
        """Bind pointers, zero the workspaces that ask for it, and launch every kernel on `stream`."""

def bench(plan: Plan, inputs: Sequence[Sequence[int]], outputs: Sequence[int], workspaces: Sequence[int],
          stream: int, flush_ptr: int, flush_bytes: int, warmup_ms: float = 25.0, min_reps: int = 100,
          min_ms: float = 200.0, max_reps: int = 10000) -> list[float]:
    """Time plan.launch with one CUDA event pair per rep, the L2 flushed (a write of
    flush_bytes at flush_ptr) before each, inputs rotated among the given pointer sets;
    warm-up sized by time after one untimed launch. Returns per-rep times in milliseconds."""

class Registry:
    """Guarded dispatch table: integer variant id -> Plan."""
    def __init__(self) -> None: ...
    def add(self, plan: Plan) -> int: ...
    def launch(self, id: int, inputs: Sequence[int], outputs: Sequence[int], workspaces: Sequence[int], stream: int) -> None: ...
    def __len__(self) -> int: ...
    def address(self) -> int:
        """This registry's address, for kforge._dispatch; valid while this object lives."""
    @staticmethod
    def launch_address() -> int:
        """Address of `int kforge_registry_launch(const void* registry, int id, const uint64_t* inputs, int n_in,
        const uint64_t* outputs, int n_out, const uint64_t* workspaces, int n_ws, uint64_t stream, char* err,
        size_t err_len)`: Registry.launch behind a C ABI, 0 on success, 1 on a CUDA error, 2 on another error
        (err holds the message)."""
