/* A stand-in for libcuda.so.1 with two fake devices, so that the C++ core's context
 * handling, resource lifetimes and benchmark protocol can be tested without a GPU
 * (tests/test_core_fake_driver.py). Every stream operation checks that the stream's
 * context is current, as the real driver does, and is logged as one letter:
 * F flush (cuMemsetD32Async), Z workspace zeroing (cuMemsetD8Async), L kernel launch,
 * R event record, S stream synchronize, E event synchronize.
 * Streams are 0x1000 * (device + 1); stream 0 belongs to the current context. */
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
enum { OK = 0, INVALID_VALUE = 1, INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_FOUND = 500, LAUNCH_FAILED = 719 };

struct ctx { int device; };
struct mod { struct ctx* ctx; };
struct fn { struct mod* mod; };
struct ev { int recorded; };

static struct ctx g_ctx[2] = {{0}, {1}};
static __thread struct ctx* t_current = 0;
static char g_log[1 << 16];
static size_t g_log_len = 0;
static int g_live_events = 0, g_live_modules = 0, g_fail_launch_after = -1, g_coop_too_large = 0;
static float g_elapsed_ms = 1.0f;
static int g_static_smem = 0, g_max_dynamic_smem = -1; /* per process: every function alike */

static void log_op(char c) {
  if (g_log_len + 1 < sizeof g_log) g_log[g_log_len++] = c, g_log[g_log_len] = 0;
}

static CUresult on_stream(void* stream, char op) {
  size_t s = (size_t)stream;
  if (!t_current) return INVALID_CONTEXT;
  if (s && s != 0x1000u * (size_t)(t_current->device + 1)) return INVALID_CONTEXT;
  log_op(op);
  return OK;
}

/* ---- test hooks ---- */
const char* fake_log(void) { return g_log; }
void fake_reset(void) { g_log_len = 0; g_log[0] = 0; g_fail_launch_after = -1; }
int fake_live_events(void) { return g_live_events; }
int fake_live_modules(void) { return g_live_modules; }
void fake_set_current(int device) { t_current = device < 0 ? 0 : &g_ctx[device]; }
int fake_current(void) { return t_current ? t_current->device : -1; }
void fake_fail_launch_after(int n) { g_fail_launch_after = n; }
void fake_refuse_cooperative(int on) { g_coop_too_large = on; }
void fake_set_elapsed_ms(float ms) { g_elapsed_ms = ms; }
void fake_set_static_smem(int bytes) { g_static_smem = bytes; g_max_dynamic_smem = -1; }
int fake_max_dynamic_smem(void) { return g_max_dynamic_smem; } /* -1: never raised */

/* ---- driver API ---- */
CUresult cuInit(unsigned flags) { return OK; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return OK; }
CUresult cuGetErrorName(CUresult r, const char** s) {
  switch (r) {
    case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return OK;
    case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; return OK;
    case INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; return OK;
    case NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; return OK;
    case LAUNCH_FAILED: *s = "CUDA_ERROR_LAUNCH_FAILED"; return OK;
    case 720: *s = "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"; return OK;
  }
  *s = 0;
  return INVALID_VALUE;
}
CUresult cuGetErrorString(CUresult r, const char** s) { *s = "fake driver error"; return OK; }
CUresult cuDeviceGetCount(int* n) { *n = 2; return OK; }
CUresult cuDeviceGet(int* dev, int ordinal) {
  if (ordinal < 0 || ordinal > 1) return INVALID_VALUE;
  *dev = ordinal;
  return OK;
}
CUresult cuDeviceGetName(char* name, int len, int dev) { strncpy(name, "Fake GPU", len); return OK; }
CUresult cuDeviceGetAttribute(int* v, int attr, int dev) { *v = attr == 75 ? 9 : 0; return OK; }
CUresult cuDeviceTotalMem_v2(size_t* bytes, int dev) { *bytes = (size_t)80 << 30; return OK; }
CUresult cuDevicePrimaryCtxRetain(struct ctx** c, int dev) { *c = &g_ctx[dev]; return OK; }
CUresult cuCtxGetCurrent(struct ctx** c) { *c = t_current; return OK; }
CUresult cuCtxSetCurrent(struct ctx* c) { t_current = c; return OK; }
CUresult cuCtxSynchronize(void) { return t_current ? OK : INVALID_CONTEXT; }
CUresult cuModuleLoadData(struct mod** m, const void* image) {
  if (!t_current) return INVALID_CONTEXT;
  *m = malloc(sizeof **m);
  (*m)->ctx = t_current;
  g_live_modules++;
  return OK;
}
CUresult cuModuleUnload(struct mod* m) {
  if (t_current != m->ctx) return INVALID_CONTEXT;
  free(m);
  g_live_modules--;
  return OK;
}
CUresult cuModuleGetFunction(struct fn** f, struct mod* m, const char* name) {
  if (strncmp(name, "missing", 7) == 0) return NOT_FOUND;
  *f = malloc(sizeof **f); /* leaked on purpose: a real CUfunction lives as long as its module */
  (*f)->mod = m;
  return OK;
}
CUresult cuFuncGetAttribute(int* v, int attr, struct fn* f) { *v = attr == 1 ? g_static_smem : 0; return OK; }
static int g_nonportable_cluster = 0, g_cluster_x = 0, g_cluster_yz = 0, g_refuse_cluster = 0;
int fake_nonportable_cluster(void) { return g_nonportable_cluster; }
int fake_cluster_x(void) { return g_cluster_x; }
int fake_cluster_yz(void) { return g_cluster_yz; } /* y * 100 + z of the last cluster launch */
void fake_refuse_cluster(int on) { g_refuse_cluster = on; }
CUresult cuFuncSetAttribute(struct fn* f, int attr, int value) {
  if (t_current != f->mod->ctx) return INVALID_CONTEXT;
  if (attr == 8) g_max_dynamic_smem = value; /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES */
  if (attr == 14) g_nonportable_cluster = value; /* CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED */
  return OK;
}
CUresult cuLaunchKernel(struct fn* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, void* stream, void** params, void** extra) {
  if (t_current != f->mod->ctx) return INVALID_CONTEXT;
  if (g_fail_launch_after == 0) return LAUNCH_FAILED;
  if (g_fail_launch_after > 0) g_fail_launch_after--;
  return on_stream(stream, 'L');
}
CUresult cuLaunchCooperativeKernel(struct fn* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                   unsigned bz, unsigned smem, void* stream, void** params) {
  if (t_current != f->mod->ctx) return INVALID_CONTEXT;
  if (g_coop_too_large) return 720; /* CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE */
  return on_stream(stream, 'C');
}
/* cuLaunchKernelEx with cuda.h's layout; logs 'P' for a programmatic-stream-serialization
   attribute set to 1, 'Q' for a cluster dimension (its x kept for fake_cluster_x; refused
   with CUDA_ERROR_INVALID_CLUSTER_SIZE after fake_refuse_cluster(1)), 'B' for both, 'X' for
   anything else. */
struct launch_attr { int id; char pad[4]; union { char bytes[64]; int value; unsigned dim[3]; } v; };
struct launch_config {
  unsigned gx, gy, gz, bx, by, bz, smem;
  void* stream;
  struct launch_attr* attrs;
  unsigned n_attrs;
};
CUresult cuLaunchKernelEx(const struct launch_config* c, struct fn* f, void** params, void** extra) {
  if (t_current != f->mod->ctx) return INVALID_CONTEXT;
  int pdl = 0, cluster = 0, other = 0;
  for (unsigned i = 0; i < c->n_attrs; ++i) {
    if (c->attrs[i].id == 6 && c->attrs[i].v.value == 1) pdl = 1;
    else if (c->attrs[i].id == 4) { /* clusterDim */
      cluster = c->attrs[i].v.dim[0];
      g_cluster_yz = c->attrs[i].v.dim[1] * 100 + c->attrs[i].v.dim[2];
    }
    else other = 1;
  }
  if (cluster) {
    if (g_refuse_cluster) return 912; /* CUDA_ERROR_INVALID_CLUSTER_SIZE */
    g_cluster_x = cluster;
  }
  return on_stream(c->stream, other ? 'X' : cluster && pdl ? 'B' : cluster ? 'Q' : pdl ? 'P' : 'X');
}
CUresult cuMemsetD8Async(unsigned long long p, unsigned char v, size_t n, void* stream) { return on_stream(stream, 'Z'); }
CUresult cuMemsetD32Async(unsigned long long p, unsigned v, size_t n, void* stream) { return on_stream(stream, 'F'); }
CUresult cuEventCreate(struct ev** e, unsigned flags) {
  if (!t_current) return INVALID_CONTEXT;
  *e = calloc(1, sizeof **e);
  g_live_events++;
  return OK;
}
CUresult cuEventDestroy_v2(struct ev* e) {
  free(e);
  g_live_events--;
  return OK;
}
CUresult cuEventRecord(struct ev* e, void* stream) {
  e->recorded = 1;
  return on_stream(stream, 'R');
}
CUresult cuEventSynchronize(struct ev* e) {
  log_op('E');
  return e->recorded ? OK : INVALID_HANDLE;
}
CUresult cuEventElapsedTime_v2(float* ms, struct ev* a, struct ev* b) {
  if (!a->recorded || !b->recorded) return INVALID_HANDLE;
  *ms = g_elapsed_ms;
  return OK;
}
CUresult cuStreamSynchronize(void* stream) { return on_stream(stream, 'S'); }
