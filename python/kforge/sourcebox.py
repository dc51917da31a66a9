"""The compile box: what a candidate's CUDA source and NVRTC options may contain.

Candidate sources come from proposers, an LLM among them, and are hostile input. NVRTC
opens any file a `#include` names, absolute paths included, and echoes the offending line
of a file it cannot parse into its log, which goes into the search log, the dashboard and
the next prompt. So before NVRTC sees a source, this module reads its preprocessor
directives the way the preprocessor will (after line splices, outside comments and string
literals, numbers with digit separators read whole, digraphs included) and allows only:

- `#include <cuda_fp16.h>`, `<cuda_bf16.h>` and `<cuda_fp8.h>` (the quoted form of these
  names too); NVRTC's include path holds nothing else of ours;
- harmless host headers models write out of habit (`<cmath>`, `<cstdint>`, `<cfloat>`,
  `<cuda_runtime.h>`, ...), which are dropped with a note: the prelude below and NVRTC's
  built-ins provide what kernels use from them;
- the conditional and macro directives, `#error`/`#warning`, and `#pragma` for loop
  unrolling, `once` and diagnostics.

Anything else is refused with a message that says what to do: other includes, `#include`
of a macro, `#include_next`, `#import`, `#embed`, `#line`, other pragmas, `_Pragma` with
anything but unroll, `__has_include` probing, token pasting in directives (it could spell
`__has_include`), trigraphs, raw string literals and universal character names outside
literals (two places where a reading could differ from NVRTC's; kernels need neither).
NVRTC options come from an allow-list (optimization and math flags, `-D` macros that do not
name `__has_include` or `_Pragma`, ptxas' register report); paths (`-I`, `--pre-include`,
...) are never accepted.

The prelude defines INFINITY, NAN, FLT_MAX/MIN, DBL_MAX/MIN and the fixed-width integer
types, which NVRTC lacks without host headers. It is followed by `#line 1` so compiler
messages keep the candidate's own line numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Reading a source costs the box seconds per MiB and NVRTC more: a cap keeps a 100 MB reply
# or package entry from holding the search. Real kernels are tens of KiB.
MAX_SOURCE = 1 << 20
ALLOWED_HEADERS = frozenset({"cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h"})
# Dropped with a note: NVRTC's built-ins and the prelude cover what device code uses of them.
HARMLESS_HEADERS = frozenset({
    "cmath", "math.h", "cfloat", "float.h", "cstdint", "stdint.h", "climits", "limits.h", "cstddef", "stddef.h",
    "cstdio", "stdio.h", "cstdlib", "stdlib.h", "cassert", "assert.h", "cuda.h", "cuda_runtime.h",
    "cuda_runtime_api.h", "device_launch_parameters.h", "device_functions.h", "math_constants.h",
    "cuda/std/cstdint", "cuda/std/climits", "cuda/std/cfloat", "cuda/std/cmath", "cuda/std/limits",
    "cuda/std/type_traits", "cuda/std/cstddef", "type_traits", "limits", "algorithm", "utility",
})
_DIRECTIVES = frozenset({"define", "undef", "if", "ifdef", "ifndef", "elif", "elifdef", "elifndef", "else", "endif",
                         "error", "warning", "pragma", "include", ""})
_PRAGMAS = frozenset({"unroll", "nounroll", "once", "nv_diag_suppress", "nv_diag_default", "nv_diag_warning",
                      "nv_diag_error", "diag_suppress", "diag_default", "diag_warning"})
_PROBES = re.compile(r"\b(__has_include|__has_include_next)\b")
_PRAGMA_OP = re.compile(r"\b_Pragma\b")
_PRAGMA_OK = re.compile(r'_Pragma\s*\(\s*"\s*(unroll|nounroll)\b[^"\\]*"\s*\)')
# An include line as the code view shows it (comments blanked, so `#include <cuda_fp16.h> // half`
# passes); the name between the delimiters is then read from the original text, which the
# view blanks inside "...", and must be one of the names above exactly.
_INCLUDE = re.compile(r'^\s*(?:#|%:)\s*include\s*(<[^>]*>|"[^"]*")\s*$')

PRELUDE = """\
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
#ifndef FLT_MAX
#define FLT_MAX 3.402823466e+38F
#endif
#ifndef FLT_MIN
#define FLT_MIN 1.175494351e-38F
#endif
#ifndef FLT_EPSILON
#define FLT_EPSILON 1.192092896e-07F
#endif
#ifndef DBL_MAX
#define DBL_MAX 1.7976931348623158e+308
#endif
#ifndef DBL_MIN
#define DBL_MIN 2.2250738585072014e-308
#endif
#ifndef INT_MAX
#define INT_MAX 2147483647
#endif
#ifndef INT_MIN
#define INT_MIN (-2147483647 - 1)
#endif
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
"""

# NVRTC flags a candidate's plan may ask for: code generation and math, never a path.
_OPTION_OK = re.compile(
    r"^(?:-default-device|--use_fast_math|-use_fast_math|--extra-device-vectorization|-extra-device-vectorization"
    r"|-lineinfo|--generate-line-info|--ptxas-options=-v|-Xptxas=-v|--restrict|-restrict|--std=c\+\+(?:14|17|20)|-std=c\+\+(?:14|17|20)"
    r"|--(?:ftz|prec-div|prec-sqrt|fmad)=(?:true|false)|-(?:ftz|prec-div|prec-sqrt|fmad)=(?:true|false)"
    r"|--maxrregcount=\d{1,3}|-maxrregcount=\d{1,3}|-D[A-Za-z_]\w*(?:=[A-Za-z0-9_.+-]{0,64})?)$")
# Flags models add out of habit that NVRTC rejects or kforge sets itself: dropped with a note.
_OPTION_DROPPED = re.compile(r"^(?:-O[0-3s]?|--O[0-3]|-Xptxas=?-O[0-3]|--gpu-architecture=\S+|-arch=?\S+"
                             r"|--relocatable-device-code=false|-rdc=false|-w|--disable-warnings)$")


class SourceRefused(ValueError):
    """A source or option the compile box does not allow; the message says what to change."""


@dataclass(frozen=True)
class Prepared:
    source: str  # what NVRTC compiles: the prelude, then the candidate (harmless includes dropped)
    options: list[str]
    notes: list[str]  # what was dropped, to tell the proposer


def check_options(options: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(options to pass, notes about dropped ones); raises SourceRefused for any other flag."""
    kept, notes = [], []
    for o in options:
        if not isinstance(o, str):
            raise SourceRefused(f"NVRTC option {o!r} is not a string")
        if _OPTION_OK.fullmatch(o) and (_PROBES.search(o) or _PRAGMA_OP.search(o)):
            # -DH=__has_include would let `#if H("/etc/passwd")` probe the host past the source check.
            raise SourceRefused(f"NVRTC option {o[:80]!r} is not allowed: a -D macro may not name __has_include "
                                "or _Pragma")
        if _OPTION_OK.fullmatch(o):
            kept.append(o)
        elif _OPTION_DROPPED.fullmatch(o):
            notes.append(f"dropped NVRTC option {o!r}: NVRTC optimizes fully by default and kforge sets the arch")
        else:
            raise SourceRefused(
                f"NVRTC option {o[:80]!r} is not allowed: a plan may ask only for code-generation and math flags "
                "(--use_fast_math, --ftz=, --prec-div=, --prec-sqrt=, --fmad=, --maxrregcount=, -lineinfo, "
                "--std=c++17, -DNAME[=value]); include paths and extra files are never accepted")
    return kept, notes


# Tokens the preprocessor reads whole, so a quote inside them starts no literal: an
# identifier, and a pp-number, which takes letters, `.`, exponent signs and C++14 digit
# separators (`1'000`, `0x1'F`: the `'` there is no character literal).
_IDENTIFIER = re.compile(r"(?:[A-Za-z_]|[^\x00-\x7f])(?:\w|[^\x00-\x7f])*")
_PP_NUMBER = re.compile(r"\.?[0-9](?:[eEpP][+-]|'[A-Za-z0-9_]|[A-Za-z0-9_.]|[^\x00-\x7f])*")
# Raw string literals are refused, not read: where one ends depends on whether line splices
# are undone inside it (the standard says yes, NVRTC does not), and kernels have no use for them.
_RAW_PREFIXES = frozenset({"R", "uR", "UR", "LR", "u8R"})


def _code_view(source: str) -> str:
    """The source with comments and the contents of string and character literals blanked,
    same length and newlines kept, so directives and identifiers are seen where the
    preprocessor sees them. Line splices are already removed by the caller."""
    out: list[str] = []
    i, n = 0, len(source)
    while i < n:
        c, two = source[i], source[i:i + 2]
        token = _IDENTIFIER.match(source, i) or _PP_NUMBER.match(source, i)
        if token:
            if token.group() in _RAW_PREFIXES and source.startswith('"', token.end()):
                raise SourceRefused("raw string literals (R\"(...)\") are not allowed in kforge kernels; "
                                    "use an ordinary string literal")
            out.append(token.group())
            i = token.end()
            continue
        elif two == "//":
            j = source.find("\n", i)
            j = n if j < 0 else j
        elif two == "/*":
            j = source.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and source[j] not in (c, "\n"):
                j += 2 if source[j] == "\\" else 1
            j = min(n, j + 1 if j < n and source[j] == c else j)
        else:
            out.append(c)
            i += 1
            continue
        # A comment is one space to the preprocessor: blanked whole. A literal keeps its quotes.
        lo, hi = (i, j) if two in ("//", "/*") else (i + 1, j - 1 if j - i > 1 and source[j - 1] == c else j)
        out.append(source[i:lo] + "".join(ch if ch == "\n" else " " for ch in source[lo:hi]) + source[hi:j])
        i = j
    return "".join(out)


def prepare(source: str, options: list[str] | tuple[str, ...] = ()) -> Prepared:
    """Check a candidate's source and options; raise SourceRefused with the line and the fix."""
    if len(source) > MAX_SOURCE:
        raise SourceRefused(f"the source is {len(source)} characters; kforge compiles at most {MAX_SOURCE} "
                            "(kernels are far smaller): send only the kernels the plan launches")
    if "\0" in source:
        raise SourceRefused("the source contains a NUL byte; send plain CUDA C++ text")
    try:
        source.encode("utf-8")
    except UnicodeEncodeError:
        raise SourceRefused("the source is not valid UTF-8 text; send plain CUDA C++ text") from None
    if "??=" in source or "??/" in source:
        raise SourceRefused("trigraphs (??= ??/) are not allowed; write # and \\ directly")
    opts, notes = check_options(options)
    # Compilers take CR LF and a backslash followed by blanks as line ends and splices too:
    # normalize first, so what is checked is what NVRTC reads.
    source = re.sub(r"\\[ \t\f\v]+(?=\n)", "\\\\", source.replace("\r\n", "\n").replace("\r", "\n"))
    # Phase 2 of translation: a backslash-newline joins lines. Each logical line keeps its
    # physical lines, so what NVRTC compiles has the candidate's own line numbers.
    logical: list[tuple[int, list[str]]] = []
    block: list[str] = []
    for lineno, line in enumerate(source.split("\n"), 1):
        block.append(line)
        if not line.endswith("\\"):
            logical.append((lineno - len(block) + 1, block))
            block = []
    if block:
        logical.append((len(source.split("\n")) - len(block) + 1, block))
    texts = ["".join(b[:-1] for b in blk[:-1]) + blk[-1] if len(blk) > 1 else blk[0] for _, blk in logical]
    joined = "\n".join(texts)
    code = _code_view(joined)
    view = code.split("\n")
    if re.search(r"\\[uU]", code):
        # NVRTC reads `\u0069nclude` or `_Pr\u0061gma` its own way; identifiers are plain ASCII.
        raise SourceRefused("universal character names (\\u...) are allowed only inside string literals; "
                            "write identifiers in plain letters")
    probe = _PROBES.search(code)
    if probe:
        raise SourceRefused(f"{probe.group(1)} is not allowed: only <cuda_fp16.h>, <cuda_bf16.h> and <cuda_fp8.h> "
                            "can be included, so there is nothing to probe for")
    for m in _PRAGMA_OP.finditer(code):
        if not _PRAGMA_OK.match(joined, m.start()):
            raise SourceRefused('_Pragma is allowed only as _Pragma("unroll") or _Pragma("nounroll")')

    kept: list[str] = []
    for (lineno, blk), text, seen in zip(logical, texts, view):
        d = re.match(r"^\s*(?:#|%:)\s*([A-Za-z_]\w*)?(.*)$", seen)
        if not d:
            kept.extend(blk)
            continue
        name, rest = d.group(1) or d.group(2).strip()[:20], d.group(2)
        where = f"line {lineno}"
        if name not in _DIRECTIVES:
            raise SourceRefused(f"{where}: #{name} is not allowed in a kforge kernel; use only #include of "
                                "<cuda_fp16.h>/<cuda_bf16.h>/<cuda_fp8.h>, #define, #if/#ifdef/#endif and "
                                "#pragma unroll")
        if "##" in rest or "%:%:" in rest:
            raise SourceRefused(f"{where}: token pasting (##) is not allowed in kforge kernels; write the names out")
        if name == "pragma":
            word = rest.split()[0] if rest.split() else ""
            word = word.split("(")[0]
            if word not in _PRAGMAS:
                raise SourceRefused(f"{where}: #pragma {word} is not allowed; kforge kernels may use "
                                    "#pragma unroll / nounroll / once / nv_diag_suppress")
        if name != "include":
            kept.extend(blk)
            continue
        inc = _INCLUDE.match(seen)
        h = text[inc.start(1) + 1:inc.end(1) - 1] if inc else None
        if h in ALLOWED_HEADERS:
            kept.extend([f"#include <{h}>"] + [""] * (len(blk) - 1))
        elif h in HARMLESS_HEADERS:
            notes.append(f"dropped #include <{h}> (line {lineno}): host headers are not available under NVRTC; "
                         "INFINITY, NAN, FLT_MAX, int64_t and the like are predefined, and math functions are "
                         "built in")
            kept.extend([""] * len(blk))
        else:
            shown = text.strip()[:80]
            raise SourceRefused(f"{where}: {shown} is not allowed: a kforge kernel may include only "
                                "<cuda_fp16.h>, <cuda_bf16.h> and <cuda_fp8.h>; write everything else in the source")
    body = "\n".join(kept)
    return Prepared(PRELUDE + "#line 1\n" + body, opts, notes)
