"""Attacks on the compile box that got a host file into NVRTC's log, each one a place where
the box read the source differently from the preprocessor. The file here stands for
/proc/self/environ: its first line is echoed by NVRTC when it is included, so a leak shows
as its marker in the compile log."""

from __future__ import annotations

import pytest

from kforge import compiler, sourcebox
from kforge.errors import CompileError

GOOD = 'extern "C" __global__ void k(float* y, int n) { int i = threadIdx.x; if (i < n) y[i] = INFINITY; }\n'
MARKER = "KFORGE_MARKER_host_file_line"


@pytest.fixture
def host_file(tmp_path):
    path = tmp_path / "host_file.txt"
    path.write_text(MARKER + "\n")
    return str(path)


def _attacks(f: str) -> dict[str, tuple[str, list[str]]]:
    inc = f'#include "{f}"\n'
    return {
        # `1'0` is one pp-number (a C++14 digit separator), so `'/*'` is a character literal;
        # read as the literal `'0 + '`, the `/*` after it opened a comment that hid the include.
        "digit separator": ("int x = 1'0 + '/*';\n" + inc + "// */\n", []),
        "hex digit separator": ("int x = 0x1'F + '/*';\n" + inc + "// */\n", []),
        # `8R`, `1.R` are pp-numbers and `LLR` an identifier: the `"(` after them is an ordinary
        # string, not a raw string running to `)"` over the include.
        "pp-number before R": ('const char* s = 8R"(";\n' + inc + '//)";\n', []),
        "dotted pp-number before R": ('auto s = 1.R"(";\n' + inc + '//)";\n', []),
        "identifier ending in R": ('const char* s = LLR"(";\n' + inc + '//)";\n', []),
        # Where a raw string ends depends on whether splices are undone inside it (the standard
        # says yes, NVRTC's front end does not): the box refuses raw strings rather than guess.
        "splice inside a raw string": ('auto s = R"()\\\n" /*\n)";\n' + inc + "// */\n", []),
        # A -D macro spelling __has_include probes the host past the source check.
        "-D macro naming __has_include": (f'#if H("{f}")\n#error the file exists\n#endif\n', ["-DH=__has_include"]),
        "-D macro naming _Pragma": ('P("unroll")\n', ["-DP=_Pragma"]),
        # Not a directive name: passed as the null directive.
        "universal character name in a directive": (f'#\\u0069nclude "{f}"\n', []),
        "line marker": (f'# 1 "{f}"\n', []),
        "universal character name in a probe": (f'#if __has_incl\\u0075de("{f}")\n#endif\n', []),
    }


@pytest.mark.parametrize("attack", list(_attacks("f")))
def test_the_box_reads_the_source_as_the_preprocessor_does(attack, host_file):
    source, options = _attacks(host_file)[attack]
    with pytest.raises(CompileError) as e:
        compiler.compile(source + GOOD, arch="sm_90", options=options, use_cache=False)
    assert "kforge refused to compile this source" in e.value.log
    assert MARKER not in e.value.log and "the file exists" not in e.value.log


@pytest.mark.parametrize("source", ["int x = 1'000'000;\n", "float f = 1.5e+3f, g = 0x1p-3f;\n",
                                    "#include <cuda_fp16.h> // for __half\n", '#include "cuda_bf16.h"  /* bf16 */\n',
                                    "const char c = '\\'';\n"])
def test_everyday_spellings_still_compile(source):
    assert compiler.compile(source + GOOD, arch="sm_90", use_cache=False).cubin[:4] == b"\x7fELF"


def test_a_refused_raw_string_says_what_to_write_instead():
    with pytest.raises(sourcebox.SourceRefused, match="ordinary string literal"):
        sourcebox.prepare('auto s = R"(x)";\n')


def test_a_key_spelled_with_json_escapes_in_the_plan_is_scrubbed_from_the_candidate(monkeypatch):
    """The raw reply is scrubbed before parsing, but the plan's JSON decoder turns `\\u002d`
    back into `-`: kforge itself rebuilt the key, so kforge must scrub what it decoded."""
    import json

    from kforge.proposers.llm.parse import parse_reply
    from kforge.proposers.llm.client import scrub
    from llm_cards import plan, softmax_card, source

    key = "sk-kforgeTEST0123456789abcdefSECRET"
    monkeypatch.setenv("KFORGE_LLM_API_KEY", key)
    p = plan("softmax_v3_warp")
    p["options"] = ["-DK=" + key]
    body = json.dumps(p).replace(key, key.replace("-", "\\u002d"))
    reply = scrub(f"```cuda\n{source('softmax_v3_warp')}\n```\n```json\n{body}\n```\n")
    candidate = parse_reply(reply, softmax_card(), "llm:m")
    assert key not in candidate.plan.dumps() and key not in json.dumps(candidate.to_json())


def test_a_source_over_the_size_cap_is_refused_before_it_is_read():
    import time

    t0 = time.monotonic()
    with pytest.raises(sourcebox.SourceRefused, match="at most"):
        sourcebox.prepare(GOOD + "// " + "x" * sourcebox.MAX_SOURCE + "\n")
    assert time.monotonic() - t0 < 0.5


@pytest.mark.parametrize("option", ["-DX=1\n", "--use_fast_math\n", "-O3\n"])
def test_an_option_must_match_the_allow_list_whole(option):
    with pytest.raises(sourcebox.SourceRefused, match="not allowed"):
        sourcebox.check_options([option])


# ---- a compile is bounded in time and memory -------------------------------------------------


def _bomb_candidate(body: str):
    from kforge.candidate import Candidate, LaunchPlan

    plan = {"kernels": [{"name": "relu_k", "grid": [1], "block": [32], "args": [{"in": 0}, {"out": 0}]}]}
    src = body + 'extern "C" __global__ void relu_k(const float* x, float* y) { y[0] = x[0]; }\n'
    return Candidate(src, LaunchPlan.from_json(plan))


def test_a_macro_bomb_is_stopped_at_the_compile_timeout_and_the_next_candidate_compiles():
    """2^24 statements from 1 KB of #defines: NVRTC would expand them for hours, and cannot
    be stopped in-process. Without a GPU the search compiles in a child it can kill."""
    import time

    from evalkit import relu_card
    from kforge.evaluate import CompileOnlyEvaluator
    from kforge.verdict import Verdict

    defines = "#define A0 y[0] += x[0];\n" + "".join(f"#define A{i} A{i - 1} A{i - 1}\n" for i in range(1, 25))
    ev = CompileOnlyEvaluator("sm_90", timeout_s=5)
    try:
        t0 = time.monotonic()
        r = ev.evaluate(relu_card(), _bomb_candidate(defines + "__device__ void bomb(const float* x, float* y) { A24 }\n"))
        assert r.verdict is Verdict.COMPILE_ERROR and "did not finish within 5 s" in r.message
        assert time.monotonic() - t0 < 90  # starting the compiler process included, on a loaded machine
        assert ev.evaluate(relu_card(), _bomb_candidate("")).verdict is Verdict.UNTIMED
    finally:
        ev.close()


def test_a_template_bomb_is_stopped_at_the_memory_limit():
    """Each level doubles a type's name: at 2^26 NVRTC's log alone is gigabytes."""
    from evalkit import relu_card
    from kforge.evaluate import CompileOnlyEvaluator
    from kforge.verdict import Verdict

    bomb = ("template<class A, class B> struct P {};\n"
            "template<class T, int N> struct D { typedef typename D<P<T, T>, N - 1>::type type; };\n"
            "template<class T> struct D<T, 0> { typedef T type; };\n"
            "typedef D<int, 30>::type X; X* bad = 1;\n")
    ev = CompileOnlyEvaluator("sm_90", timeout_s=120, memory_bytes=1 << 30)
    try:
        r = ev.evaluate(relu_card(), _bomb_candidate(bomb))
        assert r.verdict is Verdict.COMPILE_ERROR
        assert "memory" in r.message
    finally:
        ev.close()


# ---- the dashboard over a log written before texts were scrubbed -----------------------------


def test_the_dashboard_scrubs_what_it_reads_from_an_old_log(tmp_path, monkeypatch):
    """Logs written before scrubbing (the /proc/self/environ runs) hold the key in compile
    logs and messages; the dashboard shows them, so it scrubs what it reads too."""
    import json
    import sqlite3

    from conftest_dash import write_demo_run
    from kforge.dash_app.data import Catalog

    key = "sk-kforgeOLDLOG0123456789abcdefSECRET"
    demo = write_demo_run(tmp_path)
    conn = sqlite3.connect(demo.run_dir / "search.sqlite")
    with conn:
        conn.execute("UPDATE candidates SET compile_log = ?, message = ?, note = ?",
                     (f"KFORGE_LLM_API_KEY={key}\n", f"failed near {key}", key))
        conn.execute("UPDATE events SET message = ?", (f"echo {key}",))
    conn.close()
    monkeypatch.setenv("KFORGE_LLM_API_KEY", key)
    cat = Catalog([demo.run_dir], ttl_s=0)
    shown = [cat.runs(), cat.failures(demo.run_id), cat.events(demo.run_id)]
    for card in cat.cards(demo.run_id):
        for cand in cat.candidates(demo.run_id, card["card_id"]):
            shown.append(cat.candidate(demo.run_id, cand["id"]))
    dumped = json.dumps(shown, default=str)
    assert "failed near" in dumped and key not in dumped


# ---- secrets the scrubber did not know -------------------------------------------------------


def test_passwords_connection_strings_and_aws_keys_are_scrubbed(monkeypatch):
    from kforge.redact import scrub

    monkeypatch.setenv("MYSQL_PWD", "hunter2hunter2")
    monkeypatch.setenv("SMTP_PASS", "mailpass-123456")
    monkeypatch.setenv("GCP_CREDS", "gcp-creds-value-1")
    monkeypatch.setenv("SENTRY_DSN", "https://abcdef0123@o1.ingest.sentry.io/1")
    text = ("hunter2hunter2 mailpass-123456 gcp-creds-value-1 https://abcdef0123@o1.ingest.sentry.io/1 "
            "postgres://admin:s3cretpw@db.internal/prod AKIAIOSFODNN7EXAMPLE")
    out = scrub(text)
    for secret in ["hunter2hunter2", "mailpass-123456", "gcp-creds-value-1", "abcdef0123", "s3cretpw",
                   "AKIAIOSFODNN7EXAMPLE"]:
        assert secret not in out, secret
    assert "db.internal/prod" in out  # only the credential of a URL is masked
