"""The compile box against hostile candidates: no host file reaches NVRTC, no option names
a path, and no secret reaches the search log, the dashboard, a prompt or a package.

Each attack here used to work: NVRTC opened `#include "/proc/self/environ"` and echoed the
environment, API key included, into the compile log, which went to the log, the dashboard
and the next repair prompt."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch

import kforge
from kforge import compiler, sourcebox
from kforge.candidate import LaunchPlan
from kforge.errors import CompileError, PlanError
from kforge.redact import scrub
from kforge.verdict import EvalResult, Verdict

KEY = "sk-kforgeTEST0123456789abcdefSECRET"
GOOD = 'extern "C" __global__ void k(float* y, int n) { int i = threadIdx.x; if (i < n) y[i] = INFINITY; }\n'

HOSTILE_SOURCES = {
    "absolute quoted": '#include "/proc/self/environ"\n',
    "absolute angled": "#include </etc/passwd>\n",
    "relative": '#include "../../../../etc/shadow"\n',
    "digraph": '%:include "/etc/passwd"\n',
    "spliced": '#inc\\\nlude "/etc/passwd"\n',
    "spliced crlf": '#inc\\\r\nlude "/etc/passwd"\r\n',
    "spliced with blanks": '#inc\\  \nlude "/etc/passwd"\n',
    "after a comment": '/* hi */ #include "/etc/passwd"\n',
    "behind a string that looks like a comment": 'const char* s = "/*";\n#include "/etc/passwd"\n// */\n',
    "after a raw string": 'const char* s = R"x(\n)x";\n#include "/etc/passwd"\n',
    "macro": '#define F "/etc/passwd"\n#include F\n',
    "include_next": "#include_next <cuda_fp16.h>\n",
    "import": '#import "/etc/passwd"\n',
    "embed": '#embed "/etc/passwd"\n',
    "line": '#line 1 "/etc/passwd"\n',
    "probe": '#if __has_include("/etc/passwd")\n#endif\n',
    "pasted probe": "#define P(a, b) a##b\n",
    "pragma dependency": '#pragma GCC dependency "/etc/passwd"\n',
    "_Pragma": '_Pragma("GCC dependency \\"/etc/passwd\\"")\n',
    "trigraph": '??=include "/etc/passwd"\n',
    "toolkit header": "#include <cuda_runtime_api.h>\n#include <nvrtc.h>\n",
}


@pytest.mark.parametrize("attack", list(HOSTILE_SOURCES))
def test_host_file_includes_and_preprocessor_tricks_are_refused_before_nvrtc(attack):
    with pytest.raises(CompileError) as e:
        compiler.compile(HOSTILE_SOURCES[attack] + GOOD, arch="sm_90", use_cache=False)
    assert "kforge refused to compile this source" in e.value.log
    assert "root:" not in str(e.value)  # nothing of /etc/passwd


@pytest.mark.parametrize("options", [["--pre-include=/etc/hostname"], ["-I/root"], ["-I", "/root"],
                                     ["--include-path=/etc"], ["-include", "/etc/passwd"], ["--dlink-time-opt"]])
def test_plan_options_that_name_paths_are_refused_by_the_plan_and_by_the_compiler(options):
    plan = {"kernels": [{"name": "k", "grid": [1], "block": [32], "args": [{"out": 0}, {"i32": 1}]}],
            "options": options}
    with pytest.raises(PlanError, match="not allowed"):
        LaunchPlan.from_json(plan)
    with pytest.raises(CompileError, match="not allowed"):
        compiler.compile(GOOD, arch="sm_90", options=options, use_cache=False)


def test_everyday_cuda_compiles_with_the_prelude_and_harmless_includes_dropped_with_a_note():
    src = ("#include <cmath>\n#include <cstdint>\n#include <cfloat>\n#include \"cuda_fp16.h\"\n"
           "#pragma unroll\n"
           'extern "C" __global__ void k(float* y, int64_t n) {\n'
           "  long long i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;\n"
           "  if (i < n) y[i] = fminf(FLT_MAX, -INFINITY) + (isnan(NAN) ? 1.f : 0.f) + (float)(uint8_t)3;\n"
           "}\n")
    k = compiler.compile(src, arch="sm_90", options=["-O3", "--use_fast_math", "-DX=1"], use_cache=False)
    assert k.cubin[:4] == b"\x7fELF"
    assert "dropped #include <cmath>" in k.log and "dropped NVRTC option '-O3'" in k.log


def test_compiler_messages_keep_the_candidates_own_line_numbers():
    src = "#include <cmath>\n\n\n" + 'extern "C" __global__ void k(float* y) {\n  y[0] = undefined_name;\n}\n'
    with pytest.raises(CompileError) as e:
        compiler.compile(src, arch="sm_90", use_cache=False)
    assert "(5)" in e.value.log and "undefined_name" in e.value.log  # line 5 of the candidate, not of the prelude


def test_a_source_that_is_not_utf8_is_a_compile_error_not_a_crash():
    with pytest.raises(CompileError):
        compiler.compile("\udcff\n" + GOOD, arch="sm_90", use_cache=False)


def test_directive_looking_text_inside_comments_and_strings_is_not_a_directive():
    src = '// #include "/etc/passwd"\n/*\n#include "/etc/passwd"\n*/\nauto s = "#include \\"/etc/passwd\\"";\n'
    assert sourcebox.prepare(src).notes == []


def test_scrub_masks_the_key_secret_looking_variables_and_key_shapes_and_caps_size(monkeypatch):
    monkeypatch.setenv("KFORGE_LLM_API_KEY", KEY)
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-abcdefgh12345")
    monkeypatch.setenv("HOME_DIR_NAME", "/not/a/secret")
    text = f"a {KEY} b tok-abcdefgh12345 c sk-otherlooking0123456789 d /not/a/secret"
    out = scrub(text)
    assert KEY not in out and "tok-abcdefgh12345" not in out and "sk-otherlooking" not in out
    assert "/not/a/secret" in out
    assert len(scrub("x" * 10**6)) < 70_000


def test_verdict_texts_are_scrubbed_at_the_source(monkeypatch):
    monkeypatch.setenv("KFORGE_LLM_API_KEY", KEY)
    r = EvalResult(Verdict.COMPILE_ERROR, f"failed: {KEY}", compile_log=f"KFORGE_LLM_API_KEY={KEY}\n" * 3)
    assert KEY not in r.message and KEY not in r.compile_log


# ---- end to end: a hostile model through `kforge.run` on the CPU ---------------------------


def _hostile_replies():
    """Kernels that try to read the environment and host files, a plan that pre-includes one,
    and a 'good' kernel that echoes the key in its source and note."""
    plan = {"kernels": [{"name": "softmax_rows_block", "grid": [8], "block": [64],
                         "args": [{"in": 0}, {"out": 0}, {"i32": 8}, {"i32": 64}]}]}
    body = json.dumps(plan)
    cuda = ('extern "C" __global__ void softmax_rows_block(const float* x, float* y, int rows, int cols) '
            "{ if (threadIdx.x == 0 && blockIdx.x < rows) y[blockIdx.x * cols] = x[0]; }\n")
    pre = dict(plan)
    pre["options"] = ["--pre-include=/proc/self/environ"]
    yield f'```cuda\n#include "/proc/self/environ"\n{cuda}```\n```json\n{body}\n```'
    yield f'```cuda\n#include "/etc/passwd"\n{cuda}```\n```json\n{body}\n```'
    yield f"```cuda\n{cuda}```\n```json\n{json.dumps(pre)}\n```"
    yield f"kind: custom\nThe key is {KEY}.\n```cuda\n// {KEY}\n{cuda}```\n```json\n{body}\n```"


def test_a_hostile_model_never_gets_the_key_into_log_prompts_dashboard_or_package(tmp_path, monkeypatch):
    from llm_server import ScriptedLLMServer, reply

    monkeypatch.setenv("KFORGE_LLM_API_KEY", KEY)
    replies = list(_hostile_replies())

    def responder(body):
        responder.n += 1
        return reply(replies[responder.n % len(replies)])

    responder.n = -1
    model = torch.nn.Softmax(dim=-1)
    x = torch.randn(8, 64)
    with ScriptedLLMServer(api_key=KEY, models={"coder"}, responder=responder) as server:
        result = kforge.run(model, (x,), out=tmp_path / "m.cast", proposer="llm", iterations=4,
                            run_dir=tmp_path / "run", progress=False, ops=["softmax"],
                            proposer_options={"model": "coder", "base_url": server.base_url,
                                              "prices": {"coder": (0.0, 0.0)}})
        requests = [json.dumps(r.body) for r in server.requests]
    assert responder.n >= 3, "the hostile replies were not all asked for"
    log_path = Path(result.run_dir) / "search.sqlite"
    conn = sqlite3.connect(log_path)
    refused = conn.execute("SELECT COUNT(*) FROM candidates WHERE compile_log LIKE '%kforge refused%' "
                           "OR message LIKE '%not allowed%'").fetchone()[0]
    conn.close()
    assert refused >= 1
    everything = b"".join(p.read_bytes() for p in Path(result.run_dir).rglob("*") if p.is_file())
    assert KEY.encode() not in everything
    assert b"root:x:0:0" not in everything
    for body in requests[1:]:  # the first prompt is ours; every later one carries feedback
        assert KEY not in body and "root:x:0:0" not in body
    from kforge.dash_app.data import Catalog

    cat = Catalog([result.run_dir], ttl_s=0)
    shown = []
    for run in cat.runs():
        rid = run["id"]
        shown += [run, cat.run_config(rid), cat.failures(rid), cat.events(rid), cat.providers(rid)]
        for card in cat.cards(rid):
            for cand in cat.candidates(rid, card["card_id"]):
                shown.append(cat.candidate(rid, cand["id"]))
    dumped = json.dumps(shown, default=str)
    assert len(shown) > 5 and "kforge refused" in dumped
    assert KEY not in dumped and "root:x:0:0" not in dumped
