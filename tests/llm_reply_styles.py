"""Reply styles of the models people use, each wrapping the same correct kernel.

Written for the replay test from how GPT-4o/4.1/5, o3, Claude, Gemini, DeepSeek-R1, Qwen
(Coder, Qwen3) and models served by vLLM or Ollama answer a "write a CUDA kernel + JSON plan"
prompt: their fences, prose, reasoning, plan habits and slips. The kernel is softmax over
4096 rows of 1024 float32 (llm_cards.softmax_card): tests/data/llm_replies/softmax_v3_warp,
one warp per row.

A style is the replies a scripted model gives, in order: the first answer, then, where the
first is expected to be sent back (a parse problem, or a compile error fed back through
repair), the model's corrected answer. `needs_prelude` marks styles whose kernel uses what
only kforge's compile box provides (INFINITY, FLT_MAX, int64_t predefined; <cmath> dropped):
NVRTC alone rejects them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llm_cards import plan, source
from llm_server import Step, reply

KERNEL = source("softmax_v3_warp")
PLAN = plan("softmax_v3_warp")
LAUNCH = PLAN["kernels"][0]
ARGS = LAUNCH["args"]
PLAN_JSON = json.dumps(PLAN)
PLAN_PRETTY = json.dumps(PLAN, indent=2)
NEG_INF = "__int_as_float(0xff800000)"


@dataclass
class Style:
    name: str
    model: str
    replies: list[Step]
    needs_prelude: bool = False
    note: str = ""
    turns: int = field(init=False)

    def __post_init__(self) -> None:
        self.turns = len(self.replies)


def _kernel(*, name: str = "softmax_warp_row", neg_inf: str = NEG_INF, index_type: str = "long long",
            extern: str = 'extern "C" ') -> str:
    return (KERNEL.replace(NEG_INF, neg_inf).replace("(long long)row", f"({index_type})row")
            .replace("softmax_warp_row", name).replace('extern "C" ', extern))


def _plan(**launch) -> str:
    return json.dumps(dict(PLAN, kernels=[dict(LAUNCH, **launch)]))


def _answer(src: str = KERNEL, plan_text: str = PLAN_JSON, *, cuda: str = "cuda", js: str = "json",
            before: str = "Here is the kernel.", after: str = "kind: custom") -> str:
    return f"{before}\n\n```{cuda}\n{src.rstrip()}\n```\n\n```{js}\n{plan_text}\n```\n{after}\n"


CANONICAL = _answer()

EXTERN_BLOCK = 'extern "C" {\n\n' + _kernel(extern="") + '\n}  // extern "C"\n'

HELPERS = """__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
"""
WITH_HELPERS = (KERNEL
                .replace("#pragma unroll\n    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));",
                         "m = warp_max(m);")
                .replace("#pragma unroll\n    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);",
                         "s = warp_sum(s);"))
assert WITH_HELPERS.count("warp_") == 2 + KERNEL.count("warp_")

DRAFT = """extern "C" __global__ void softmax_naive(const float* x, float* y, int rows)
{
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    float m = -1e30f, s = 0.f;
    for (int i = 0; i < 1024; ++i) m = fmaxf(m, x[row * 1024 + i]);
    for (int i = 0; i < 1024; ++i) s += expf(x[row * 1024 + i] - m);
    for (int i = 0; i < 1024; ++i) y[row * 1024 + i] = expf(x[row * 1024 + i] - m) / s;
}
"""

HOST = """
// Host launcher
void launch_softmax(const float* x, float* y, int rows, cudaStream_t stream)
{
    dim3 block(256), grid((rows + 7) / 8);
    softmax_warp_row<<<grid, block, 0, stream>>>(reinterpret_cast<const float4*>(x), reinterpret_cast<float4*>(y), rows);
}
"""

TEMPLATED = KERNEL.replace('extern "C" __global__ void __launch_bounds__(256)',
                           "template <int VEC>\n__global__ void __launch_bounds__(256)").replace(
    "#define VEC_PER_LANE 8  // 1024 floats / 32 lanes / 4 floats per float4\n", "").replace("VEC_PER_LANE", "VEC")

JSONC = """{
  // one warp per row: 8 rows per 256-thread block
  "kernels": [
    {
      "name": "softmax_warp_row",
      "grid": [512, 1, 1],   // 4096 rows / 8
      "block": [256, 1, 1],
      "smem": 0,             /* registers only */
      "args": [{"in": 0}, {"out": 0}, {"i32": 4096}],
    },
  ],
  "workspace": [],
  "options": [],
}"""

THINK_DRAFTS = f"""<think>
The user wants softmax over rows of 1024 floats. First idea: one thread per row.

```cuda
{DRAFT}```

That reads each row three times from HBM with uncoalesced loads, too slow. Better: one warp per
row, 8 float4 per lane held in registers. Plan would be {{"kernels": [{{"name": "softmax_naive"}}]}}... no,
the grid is 4096 / 8 = 512 blocks of 256 threads.

```cuda
extern "C" __global__ void softmax_warp_row(const float4* x, float4* y, int rows) {{ /* sketch */ }}
```
Let me write it fully.
</think>

"""

STYLES: list[Style] = [
    # ---- OpenAI -----------------------------------------------------------------------------
    Style("gpt-4o canonical", "gpt-4o", [reply(CANONICAL)]),
    Style("gpt-4o markdown headings", "gpt-4o", [reply(
        "### Approach\n- One warp per row, the row in registers (8 `float4` per lane).\n- Warp shuffles for the "
        "max and the sum.\n\n### CUDA source\n```cuda\n" + KERNEL + "```\n\n### Launch plan\n```json\n" + PLAN_PRETTY
        + "\n```\n\n**kind: custom**\n")]),
    Style("gpt-4.1 plan before source", "gpt-4.1", [reply(
        f"Launch plan first, then the source.\n\n```json\n{PLAN_JSON}\n```\n\n```cuda\n{KERNEL}```\n\nkind: custom")]),
    Style("gpt-4.1 cu and JSON fences", "gpt-4.1", [reply(_answer(cuda="cu", js="JSON"))]),
    Style("gpt-4.1-mini cuda fence with filename", "gpt-4.1-mini", [reply(_answer(cuda="cuda title=\"softmax.cu\""))]),
    Style("gpt-5 explanation after", "gpt-5", [reply(_answer(after=(
        "kind: custom\n\n**Why this is fast**\n1. Each row is read once and written once (`float4`, coalesced).\n"
        "2. No shared memory or `__syncthreads()`: reductions stay in the warp.\n3. `__launch_bounds__(256)` keeps "
        "register use in check.\n\nIf rows were longer than 1024 I would split them across a block.")))]),
    Style("gpt-5 kind in backticks", "gpt-5", [reply(_answer(after="`kind: custom`"))]),
    Style("o3 blocks only", "o3", [reply(f"```cuda\n{KERNEL}```\n```json\n{PLAN_JSON}\n```")]),
    Style("o3 hidden reasoning used the budget", "o3", [
        reply("", finish_reason="length", usage=(3000, 8192)), reply(CANONICAL)],
        note="an empty reply cut off at the limit: asked for the code directly"),
    Style("o4-mini python dict plan", "o4-mini", [reply(_answer(js="python", plan_text=(
        "{'kernels': [{'name': 'softmax_warp_row', 'grid': (512, 1, 1), 'block': (256, 1, 1), 'smem': 0, "
        "'args': [{'in': 0}, {'out': 0}, {'i32': 4096}], 'cooperative': False}], 'workspace': [], 'options': []}"
    ).replace("(512, 1, 1)", "[512, 1, 1]").replace("(256, 1, 1)", "[256, 1, 1]")))]),

    # ---- Anthropic --------------------------------------------------------------------------
    Style("claude prose around", "claude-sonnet-4", [reply(_answer(
        before="I'll write a softmax kernel that assigns one warp to each row. Since each row has exactly 1024 "
               "floats, every lane can hold 8 float4 values in registers, so the row is read from HBM once.",
        after="kind: custom\n\nKey optimizations:\n- Vectorized 16-byte loads and stores\n- Warp-level "
              "reductions with `__shfl_xor_sync`\n- No shared memory needed"))]),
    Style("claude cpp fence with filename", "claude-opus-4", [reply(_answer(cuda="cpp softmax_warp_row.cu"))]),
    Style("claude plan in a source comment", "claude-sonnet-4", [reply(
        f"Here's the kernel; the launch plan is in the comment at the end.\n\n```cuda\n{KERNEL}\n"
        f"/* plan: {PLAN_JSON} */\n```\n\nkind: custom")]),
    Style("claude extern C block", "claude-3-7-sonnet", [reply(_answer(EXTERN_BLOCK))]),
    Style("claude draft then final", "claude-sonnet-4", [reply(
        f"A first, simple version:\n\n```cuda\n{DRAFT}```\n\nThat reads each row three times. A better version, one "
        f"warp per row:\n\n```cuda\n{KERNEL}```\n\n```json\n{PLAN_JSON}\n```\n\nkind: custom")]),
    Style("claude helper block and kernel block", "claude-opus-4", [reply(
        f"First the warp helpers:\n\n```cuda\n{HELPERS}```\n\nThen the kernel:\n\n```cuda\n{WITH_HELPERS}```\n\n"
        f"```json\n{PLAN_JSON}\n```\nkind: custom")]),
    Style("claude jsonc plan", "claude-sonnet-4", [reply(_answer(js="jsonc", plan_text=JSONC))]),

    # ---- Google -----------------------------------------------------------------------------
    Style("gemini c++ fence and jsonc", "gemini-2.5-pro", [reply(_answer(cuda="c++", js="jsonc", plan_text=JSONC))]),
    Style("gemini bold labels and trailing commas", "gemini-2.5-flash", [reply(
        "**CUDA Kernel:**\n\n```cuda\n" + KERNEL + "```\n\n**Launch Plan:**\n\n```json\n"
        + PLAN_PRETTY.replace("1\n", "1,\n").replace("}\n  ]", "},\n  ]") + "\n```\n\n**kind: custom**")]),
    Style("gemini dim3 objects", "gemini-2.5-pro", [reply(_answer(plan_text=_plan(
        grid={"x": 512, "y": 1, "z": 1}, block={"x": 256, "y": 1, "z": 1})))]),
    Style("gemini plan inside the cuda fence", "gemini-2.0-flash", [reply(
        f"```cuda\n{KERNEL}\n```json\n{PLAN_PRETTY}\n```\n```\nkind: custom")],
        note="the json fence opened before the cuda fence was closed"),

    # ---- DeepSeek ---------------------------------------------------------------------------
    Style("deepseek-r1 think with drafts", "deepseek-r1", [reply(THINK_DRAFTS + CANONICAL)]),
    Style("deepseek-r1 template-opened think", "deepseek-r1-distill-qwen-32b", [reply(
        THINK_DRAFTS.removeprefix("<think>\n") + CANONICAL)], note="only </think> in the content"),
    Style("deepseek-r1 reasoning_content field", "deepseek-reasoner", [
        reply(CANONICAL, reasoning=THINK_DRAFTS.removeprefix("<think>\n").removesuffix("</think>\n\n"))]),
    Style("deepseek-r1 reasoning used the budget", "deepseek-reasoner", [
        reply("", finish_reason="length", reasoning="Let me think about the memory layout. " * 400),
        reply(CANONICAL)]),
    Style("deepseek-v3 plan in prose", "deepseek-chat", [reply(
        f"```cuda\n{KERNEL}```\n\nLaunch plan: {PLAN_JSON}\n\nkind: custom")]),

    # ---- Qwen -------------------------------------------------------------------------------
    Style("qwen-coder cpp fence, comments and trailing commas", "qwen2.5-coder-32b", [reply(
        _answer(cuda="cpp", plan_text=JSONC))]),
    Style("qwen-coder single kernel object", "qwen2.5-coder-32b", [reply(_answer(plan_text=json.dumps(LAUNCH)))]),
    Style("qwen3 empty think", "qwen3-32b", [reply("<think>\n\n</think>\n\n" + CANONICAL)]),
    Style("qwen3 think then answer", "qwen3-235b-a22b", [reply(THINK_DRAFTS + CANONICAL)]),

    # ---- served by vLLM / Ollama / others ----------------------------------------------------
    Style("ollama llama uppercase CUDA fence, bare json fence", "llama3.1:70b", [reply(
        f"```CUDA\n{KERNEL}```\n\n```\n{PLAN_JSON}\n```\n\nkind: custom")]),
    Style("ollama bare fences", "codellama:34b", [reply(f"```\n{KERNEL}```\n\n```\n{PLAN_PRETTY}\n```")]),
    Style("vllm javascript fence", "meta-llama/Llama-3.3-70B-Instruct", [reply(_answer(
        js="javascript", plan_text=f"const launchPlan = {PLAN_PRETTY};"))]),
    Style("mistral json5", "codestral-latest", [reply(_answer(js="json5", plan_text=(
        "{kernels: [{name: 'softmax_warp_row', grid: [512, 1, 1], block: [256, 1, 1], smem: 0,\n"
        "  args: [{in: 0}, {out: 0}, {i32: 4096}]}], workspace: [], options: []}")))]),
    Style("phi windows line endings", "phi-4", [reply(CANONICAL.replace("\n", "\r\n"))]),
    Style("tilde fences", "granite-code", [reply(f"~~~cuda\n{KERNEL}~~~\n~~~json\n{PLAN_JSON}\n~~~\nkind: custom")]),
    Style("indented fences in a list", "mixtral-8x22b", [reply(
        "1. The source:\n\n   ```cuda\n" + "".join(f"   {line}\n" for line in KERNEL.splitlines())
        + "   ```\n\n2. The launch plan:\n\n   ```json\n   " + PLAN_JSON + "\n   ```\n\n3. kind: custom")]),
    Style("extra python usage block", "gpt-4o", [reply(CANONICAL + (
        "\nTo check it against PyTorch:\n\n```python\nimport torch\nx = torch.randn(4096, 1024, device='cuda')\n"
        "ref = torch.softmax(x, -1)\n```\n"))]),
    Style("extra host snippet block", "gpt-4.1", [reply(CANONICAL + (
        "\nFor reference, the equivalent launch would be:\n\n```cpp\nsoftmax_warp_row<<<512, 256>>>(x, y, 4096);\n```\n"))]),

    # ---- plan habits --------------------------------------------------------------------------
    Style("synonyms blocks / threads", "gpt-4o-mini", [reply(_answer(plan_text=json.dumps({"kernels": [
        {"name": "softmax_warp_row", "blocks": [512, 1, 1], "threads": [256, 1, 1], "args": ARGS}]})))]),
    Style("synonyms gridDim / blockDim", "claude-3-5-haiku", [reply(_answer(plan_text=json.dumps({"kernels": [
        {"name": "softmax_warp_row", "gridDim": 512, "blockDim": 256, "sharedMem": 0, "args": ARGS}],
        "workspace": []})))]),
    Style("synonyms grid_dim / block_dim / shared_mem", "qwen2.5-coder-7b", [reply(_answer(plan_text=json.dumps(
        {"kernels": [{"kernel_name": "softmax_warp_row", "grid_dim": [512, 1, 1], "block_dim": [256, 1, 1],
                      "shared_mem": 0, "arguments": ARGS}], "workspace": [], "options": []})))]),
    Style("arguments as names and typed objects", "llama-3.1-405b", [reply(_answer(plan_text=_plan(
        args=["in0", "out0", {"type": "int", "value": 4096}])))]),
    Style("a kernels list alone", "deepseek-coder-v2", [reply(_answer(plan_text=json.dumps([LAUNCH])))]),
    Style("workspace with a size key", "gemini-2.5-flash", [reply(_answer(plan_text=json.dumps(
        dict(PLAN, workspace=[{"size": 16}]))))]),
    Style("a description key in the plan", "gpt-4o", [reply(_answer(plan_text=_plan(
        description="one warp per row")))]),

    # ---- slips that take one turn --------------------------------------------------------------
    Style("unknown plan key, then fixed", "llama3.1:8b", [
        reply(_answer(plan_text=json.dumps(dict(PLAN, stream=0)))), reply(CANONICAL)]),
    Style("kernel not extern C, then fixed", "qwen2.5-coder-14b", [
        reply(_answer(_kernel(extern=""))), reply(CANONICAL)]),
    Style("templated kernel, then fixed", "gpt-4o-mini", [
        reply(_answer(TEMPLATED, _plan(name="softmax_warp_row"))), reply(CANONICAL)]),
    Style("host launcher in the source, then removed", "gpt-3.5-turbo", [
        reply(_answer(KERNEL + HOST)), reply(CANONICAL)], note="NVRTC rejects the host code; repaired"),
    Style("answer cut off, then complete", "llama3.2:3b", [
        reply(CANONICAL[:900], finish_reason="length"), reply(CANONICAL)]),
    Style("workspace as text, then fixed", "mistral-small", [
        reply(_answer(plan_text=json.dumps(dict(PLAN, workspace=["64 bytes"])))), reply(CANONICAL)]),

    # ---- what only the compile prelude makes compile -------------------------------------------
    Style("INFINITY", "gpt-4o", [reply(_answer(_kernel(neg_inf="-INFINITY")))], needs_prelude=True),
    Style("FLT_MAX with <cfloat>", "claude-sonnet-4", [reply(_answer(
        "#include <cfloat>\n" + _kernel(neg_inf="-FLT_MAX")))], needs_prelude=True),
    Style("<cmath>, <cstdint> and int64_t", "qwen2.5-coder-32b", [reply(_answer(
        "#include <cmath>\n#include <cstdint>\n" + _kernel(index_type="int64_t")))], needs_prelude=True),
    Style("Visual Studio template includes", "gpt-4o", [reply(_answer(
        '#include "cuda_runtime.h"\n#include "device_launch_parameters.h"\n' + KERNEL))], needs_prelude=True),
    Style("-O3 and fast math in the plan", "gemini-2.5-pro", [reply(_answer(plan_text=json.dumps(
        dict(PLAN, options=["-O3", "--use_fast_math"]))))], needs_prelude=True),
    Style("cooperative_groups include, then removed", "claude-sonnet-4", [
        reply(_answer("#include <cooperative_groups.h>\nnamespace cg = cooperative_groups;\n" + KERNEL)),
        reply(CANONICAL)], note="refused by the compile box with the fix; repaired"),
]
