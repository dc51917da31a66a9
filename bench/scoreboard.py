"""The two tables docs/benchmarks.md opens with, from the result files under bench/results/:
KernelBench fast_p per level against eager and against torch.compile (bench/kernelbench.py),
and the example models eager / torch.compile (default and reduce-overhead) / the package /
kforge.optimize (op by op and from CUDA graphs) / kforge.compile (bench/bench_model.py --compile). Every row names its file,
and the list under each table its date, device, torch, commit and command.

    python bench/scoreboard.py                              # print the tables
    python bench/scoreboard.py --write docs/benchmarks.md   # replace the block between the markers

Per level the longest problem list among its KernelBench files is the level's list; each
problem's row comes from the newest file (within that list) that measured it, so the shards of
a run (--shard k/n) and a later run of some of its problems (--problems) join it, and problems
no file measured count as not run (not fast). Per example model (the file name without its
ab_/model_ prefix, round tag and device: ab_resnet50_bf16_s8_h200 -> resnet50_bf16) the newest
file that timed torch.compile is taken, else the newest; a run with a row whose timings spread over more
than NOISY of their median (a busy shared machine) only where no quieter run of the model is there, marked.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from kernelbench import summarize

RESULTS = Path(__file__).parent / "results"
BEGIN = "<!-- scoreboard: written by bench/scoreboard.py (edit that, not this block) -->"
END = "<!-- /scoreboard -->"
MODEL_COLUMNS = (("eager", "eager"), ("torch.compile", "torch.compile"),
                 ("torch.compile reduce-overhead", "torch.compile, reduce-overhead"), ("kforge", "package (`apply`)"),
                 ("kforge.optimize", "`kforge.optimize`"), ("kforge.optimize cuda_graphs", "`kforge.optimize`, CUDA graphs"),
                 ("kforge.compile", "`kforge.compile`"),
                 ("kforge.compile reduce-overhead", "`kforge.compile`, reduce-overhead"))


def _load(paths) -> list[tuple[Path, dict]]:
    out = []
    for p in paths:
        try:
            out.append((p, json.loads(p.read_text())))
        except (OSError, ValueError) as e:
            print(f"skipping {p}: {e}", file=sys.stderr)
    return out


def kernelbench_level(results: Path, level: int) -> tuple[list[tuple[Path, dict]], dict] | None:
    """The level's files and the summary over its list: the longest problem list of the level's
    files (the newest of equals), each problem's row from the newest file within that list, with
    that file's device, proposer, regions and size limit, that measured it (shards of a run, or a
    later run of some of its problems, fill in the rest)."""
    found = sorted(_load(results.glob(f"kernelbench_l{level}*.json")), key=lambda f: f[1].get("date", ""))
    if not found:
        return None
    ref = max(reversed(found), key=lambda f: len(f[1].get("problem_list") or []))[1]
    listed = ref.get("problem_list") or []
    same = ("device", "proposer", "regions", "max_bytes")  # what makes two files' rows comparable
    within = [f for f in found if f[1].get("problem_list") and set(f[1]["problem_list"]) <= set(listed)
              and all(f[1].get(k) == ref.get(k) for k in same)] or found[-1:]
    rows: dict[str, dict] = {}
    source: dict[str, tuple[Path, dict]] = {}
    for f in within:  # oldest first: a newer measurement of a problem replaces an older one
        for r in f[1]["problems"]:
            if r["problem"] not in rows or not str(r.get("error") or "").startswith("not run"):
                rows[r["problem"]], source[r["problem"]] = r, f
    for name in listed:
        rows.setdefault(name, {"problem": name, "error": "not run: no file measured it"})
    files = [f for f in within if any(src is f for src in source.values())]
    return files, summarize(list(rows.values()))


def _model_key(path: Path) -> str:
    stem = re.sub(r"^(ab|model)_", "", path.stem)
    stem = re.sub(r"_h\d+$", "", stem)  # the device
    return re.sub(r"_s\d+[a-z]?$", "", stem)  # the measurement round


def example_models(results: Path) -> dict[str, tuple[Path, dict]]:
    by_key: dict[str, list[tuple[Path, dict]]] = {}
    for p, d in _load(sorted(results.glob("ab_*.json")) + sorted(results.glob("model_*.json"))):
        if isinstance(d.get("model_us"), dict) and "eager" in d["model_us"]:
            by_key.setdefault(_model_key(p), []).append((p, d))
    return {k: max(v, key=lambda f: ("torch.compile" in f[1]["model_us"], not noisy(f[1]), f[1].get("date", "")))
            for k, v in sorted(by_key.items())}


NOISY = 0.10  # a model run with a row whose interquartile range is above this share of its median is noise


def noisy(data: dict) -> float | None:
    """The largest share of its median a row's IQR takes, where it is above NOISY (a shared machine
    busy during the run: ratios in it cannot be judged), else None."""
    shares = [m["iqr_us"] / m["median_us"] for m in data["model_us"].values()
              if isinstance(m, dict) and m.get("iqr_us") is not None and m.get("median_us")]
    return max(shares) if shares and max(shares) > NOISY else None


def _commit(path: Path, data: dict) -> str:
    if data.get("commit"):
        changed = data.get("uncommitted_files")
        return f"{data['commit']} with {changed} tracked files changed since it" if changed else data["commit"]
    try:
        added = subprocess.run(["git", "log", "--diff-filter=A", "-1", "--format=%h", "--", path.name],
                               capture_output=True, text=True, timeout=10, cwd=path.parent, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        added = ""
    return f"{added} (the commit that added the file)" if added else "not recorded"


def _provenance(label: str, path: Path, data: dict) -> str:
    command = f"`{data['command']}`" if data.get("command") else "command not recorded"
    return (f"- {label} (`{path.name}`): {data.get('date', '?')}, {data.get('device', '?')}, torch "
            f"{data.get('torch', '?')}, commit {_commit(path, data)}; {command}")


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _x(x: float | None) -> str:
    return f"{x:.2f}×" if x else "—"


def kernelbench_table(results: Path) -> str:
    head = ("| level | problems | correct | with a dispatched kernel | fast_0 / fast_1 / fast_1.5 / fast_2 vs eager "
            "| fast_0 / fast_1 / fast_1.5 / fast_2 vs torch.compile | faster beyond noise vs eager / torch.compile "
            "| geomean × eager | geomean × torch.compile | search | files |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines, notes = [head], []
    for level in (1, 2, 3):
        found = kernelbench_level(results, level)
        if found is None:
            lines.append(f"| {level} | not measured yet | | | | | | | | | |")
            continue
        files, s = found
        fp = {b: " / ".join(_pct(v) for v in s[f"vs_{b}"].values()) for b in ("eager", "compile")}
        lines.append(f"| {level} | {s['problems']} | {s['correct']} | {s['with_dispatched_kernel']} | {fp['eager']} "
                     f"| {fp['compile']} | {_pct(s['beyond_noise']['eager'])} / {_pct(s['beyond_noise']['compile'])} "
                     f"| {_x(s['geomean_speedup_vs_eager'])} | {_x(s['geomean_speedup_vs_compile'])} "
                     f"| {s['search_wall_s']:.0f} s, {s['candidates']} candidates | "
                     + ", ".join(f"`{p.name}`" for p, _ in files) + " |")
        notes += [_provenance(f"level {level}", p, d) for p, d in files]
    return "\n".join(lines + [""] + notes)


def models_table(results: Path) -> str:
    head = ("| model | " + " | ".join(name for _, name in MODEL_COLUMNS) + " | file |\n"
            + "| --- " * (len(MODEL_COLUMNS) + 2) + "|")
    lines, notes = [head], []
    for key, (path, d) in example_models(results).items():
        us = d["model_us"]
        eager = us["eager"]["median_us"]
        cells = []
        for col, _ in MODEL_COLUMNS:
            t = us.get(col, {}).get("median_us")
            cells.append("—" if t is None else f"{t:.0f}" if col == "eager" else f"{t:.0f} ({eager / t:.2f}×)")
        noise = noisy(d)
        mark = f" (noisy: an IQR of {100 * noise:.0f} % of its median)" if noise else ""
        lines.append(f"| {key} | " + " | ".join(cells) + f" | `{path.name}`{mark} |")
        notes.append(_provenance(key, path, d))
    return "\n".join(lines + [""] + notes)


def render(results: Path) -> str:
    return "\n".join([
        BEGIN,
        "## KernelBench: fast_p per level",
        "",
        "fast_p is the share of a level's problems whose output is correct (KernelBench's tolerance, "
        "on its inputs and on a fresh set) and whose fastest correct kforge variant (`pkg.apply()`, "
        "`kforge.optimize`, `kforge.compile`) beats the baseline by more than p×, all timed in one "
        "process, interleaved. Problems that failed or that the time budget did not reach count as "
        "not fast. Geometric means are over the problems timed. fast_1 counts any speedup over 1, as "
        "KernelBench does; \"faster beyond noise\" counts only those whose margin exceeds the larger "
        "interquartile range of the two timings.",
        "",
        kernelbench_table(results),
        "",
        "## Models: µs per forward (median) and × eager in the same run",
        "",
        "The four example models (`examples/`), and as `unseen_*` models kforge was never tuned on "
        "(`bench/unseen_models.py`: timm and transformers classes from their configs, random weights).",
        "",
        models_table(results),
        END,
    ])


def write_into(doc: Path, block: str) -> None:
    """Replace the scoreboard block in `doc`, or put it after the page's title."""
    text = doc.read_text()
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{block}\n{rest}"
    doc.write_text(text)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the directory of result JSON files")
    ap.add_argument("--write", type=Path, help="a Markdown page whose scoreboard block is replaced")
    args = ap.parse_args(argv)
    block = render(args.results)
    if args.write:
        write_into(args.write, block)
    else:
        print(block)


if __name__ == "__main__":
    main()
