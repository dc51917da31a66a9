"""The whole model, eager and with a package applied: its forward timed both ways, interleaved
in one process, as the model calls its ops (host overhead included, no L2 flush).

Every dispatched card beats eager as dispatched, yet the model as a whole can still lose:
a forward bound by launch overhead pays for every call of an overridden op, the calls that
miss the guard included, and per-op timings do not see that. `kforge run` ends with this
check and says when the package does not make the model faster.

On a CUDA device the forward is also replayed from a CUDA graph, eager and with the package.
A graph has no host overhead, so its replay shows what the kernels do; a forward whose eager
time is well above its graph's is bound by launch overhead, and there the package's gains
only show when the forward is replayed from a graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from . import timing
from .replay import GraphUnsupported, _first_line, time_graphs
from .modelrun import as_call, model_device, model_state
from .errors import KforgeError

REL_NOISE = 0.01  # differences under 1 % of eager are "level" however steady the timings
MIN_ROUNDS = 3


@dataclass(frozen=True)
class ModelCheck:
    """Forward latency per call in µs, medians over interleaved rounds, with their spread."""

    eager_us: float
    eager_iqr_us: float
    package_us: float
    package_iqr_us: float
    device: str
    calls: int = 0  # forwards per timed sample
    rounds: int = 0  # timed rounds, each entry once per round
    hits: int = -1  # calls the package's kernels served during the check (-1: not counted)
    # The same forward replayed from a CUDA graph (None: not measured; graph_error says why).
    graph_eager_us: float | None = None
    graph_eager_iqr_us: float | None = None
    graph_package_us: float | None = None
    graph_package_iqr_us: float | None = None
    graph_error: str = ""
    # The forward under torch.compile and kforge.compile, default and reduce-overhead, timed in the
    # same interleaved rounds ({} when not measured): name (COMPILED) -> (median µs, iqr µs).
    compiled: dict = dataclasses.field(default_factory=dict)
    compile_hits: tuple = ()  # cards whose kernels ran inside kforge.compile's graphs
    compile_error: str = ""
    # Leave-one-out (check_model's leave_one_out): card id -> (median µs, iqr µs) of kforge.compile
    # without that card, timed in its own interleaved rounds beside "torch.compile" and "kforge.compile",
    # whose times of those rounds are under the same two names here.
    leave_one_out: dict = dataclasses.field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.eager_us / self.package_us if self.package_us > 0 else float("nan")

    @property
    def noise_us(self) -> float:
        """A difference smaller than this is not a difference: half the larger spread, and
        never less than REL_NOISE of eager."""
        return _noise(self.eager_us, self.eager_iqr_us, self.package_iqr_us)

    @property
    def verdict(self) -> str:
        """"faster", "slower" or "level" (the two medians within the noise of each other);
        "unused" when no call of the forward reached the package's kernels."""
        if self.hits == 0:
            return "unused"
        return _compare(self.eager_us, self.package_us, self.noise_us)

    @property
    def graphed(self) -> bool:
        return self.graph_eager_us is not None and self.graph_package_us is not None

    @property
    def graph_speedup(self) -> float | None:
        return self.graph_eager_us / self.graph_package_us if self.graphed and self.graph_package_us > 0 else None

    @property
    def graph_verdict(self) -> str | None:
        """The verdict for the forward replayed from CUDA graphs (same noise rule), or None."""
        if not self.graphed:
            return None
        if self.hits == 0:
            return "unused"
        noise = _noise(self.graph_eager_us, self.graph_eager_iqr_us or 0.0, self.graph_package_iqr_us or 0.0)
        return _compare(self.graph_eager_us, self.graph_package_us, noise)

    @property
    def launch_bound(self) -> bool:
        """The eager forward takes longer than its own replay from a graph by more than the
        noise: host overhead, not the GPU, sets its pace."""
        return self.graphed and self.eager_us - self.graph_eager_us > self.noise_us

    def compile_verdict(self, mode: str = "") -> str | None:
        """kforge.compile against torch.compile (mode "" or "reduce-overhead"), by the same noise
        rule; None when not measured."""
        suffix = f" {mode}" if mode else ""
        ours, theirs = self.compiled.get("kforge.compile" + suffix), self.compiled.get("torch.compile" + suffix)
        if ours is None or theirs is None:
            return None
        return _compare(theirs[0], ours[0], _noise(theirs[0], theirs[1], ours[1]))

    def timings(self) -> dict[str, tuple[float, float]]:
        """Every way the forward was timed: name -> (median µs, iqr µs)."""
        out = {"eager": (self.eager_us, self.eager_iqr_us), "pkg.apply()": (self.package_us, self.package_iqr_us)}
        if self.graphed:
            out["eager, CUDA graph"] = (self.graph_eager_us, self.graph_eager_iqr_us or 0.0)
            out["pkg.apply(), CUDA graph"] = (self.graph_package_us, self.graph_package_iqr_us or 0.0)
        return {**out, **self.compiled}

    @property
    def fastest(self) -> tuple[str, float, str]:
        """(the fastest way, how many times faster than the runner-up, the runner-up): the verdict
        over every timing; a ratio within the noise of the two is "level" in message()."""
        ranked = sorted(self.timings().items(), key=lambda kv: kv[1][0])
        if len(ranked) < 2:
            return ranked[0][0], 1.0, ranked[0][0]
        (best, (b, _)), (second, (t, _)) = ranked[0], ranked[1]
        return best, t / b if b > 0 else float("nan"), second

    def _fastest_message(self) -> str:
        best, ratio, second = self.fastest
        if best == second:
            return ""
        (b, bi), (t, ti) = self.timings()[best], self.timings()[second]
        if abs(t - b) <= _noise(t, bi, ti):
            return f". Fastest: {best} {b:.1f} µs, level with {second} {t:.1f} µs"
        return f". Fastest: {best} {b:.1f} µs, {ratio:.3f}x {second} ({t:.1f} µs), {self.eager_us / b:.3f}x eager"

    def _without(self, card: str) -> str:
        """kforge.compile without `card` against torch.compile, timed in the same rounds."""
        (t, t_iqr), (k, k_iqr) = self.leave_one_out["torch.compile"], self.leave_one_out[card]
        return _compare(t, k, _noise(t, t_iqr, k_iqr))

    def compile_record(self) -> dict | None:
        """The verdict the package records (manifest "model_check", which kforge.compile follows):
        kforge.compile where it beat torch.compile by more than the noise, default or
        reduce-overhead; else, where leaving one card out made it do so, kforge.compile without
        the fastest such card; else plain torch.compile. None when not measured."""
        verdict = self.compile_verdict()
        if verdict is None:
            return None
        (t, t_iqr), (k, k_iqr) = self.compiled["torch.compile"], self.compiled["kforge.compile"]
        record = {"verdict": verdict, "use": "kforge.compile", "torch_compile_us": t, "kforge_compile_us": k,
                  "noise_us": _noise(t, t_iqr, k_iqr), "device": self.device, "compiled_cards": list(self.compile_hits),
                  "drop": []}
        cards = [c for c in self.leave_one_out if c not in ("torch.compile", "kforge.compile")]
        if cards:
            record["leave_one_out"] = [{"card": c, "kforge_compile_us": self.leave_one_out[c][0],
                                        "verdict": self._without(c)} for c in cards]
        optimized = self.optimize_record()
        if optimized:
            record["optimize"] = optimized
        if "faster" in (verdict, self.compile_verdict("reduce-overhead")):
            return record
        helping = [c for c in cards if self._without(c) == "faster"]
        if helping:
            record["drop"] = [min(helping, key=lambda c: self.leave_one_out[c][0])]
        else:
            record["use"] = "torch.compile"
        return record

    def optimize_record(self) -> dict:
        """kforge.optimize against eager, op by op ("ops") and from CUDA graphs ("cuda_graphs"), by
        the same noise rule: "use" is "eager" where it was slower, and kforge.optimize then runs
        the model as it is (the package records it). {} when not measured."""
        out = {}
        for key, name in (("ops", "kforge.optimize"), ("cuda_graphs", "kforge.optimize cuda_graphs")):
            if name in self.compiled:
                o, o_iqr = self.compiled[name]
                verdict = _compare(self.eager_us, o, _noise(self.eager_us, self.eager_iqr_us, o_iqr))
                out[key] = {"verdict": verdict, "use": "eager" if verdict == "slower" else "kforge.optimize",
                            "eager_us": self.eager_us, "optimize_us": o}
        return out

    def _compile_message(self) -> str:
        if self.compile_error:
            return f"; not timed under torch.compile ({self.compile_error})"
        if not self.compiled:
            return ""
        parts = []
        for mode in ("", "reduce-overhead"):
            verdict = self.compile_verdict(mode)
            if verdict is None:
                continue
            suffix = f" {mode}" if mode else ""
            (t, _), (k, _) = self.compiled["torch.compile" + suffix], self.compiled["kforge.compile" + suffix]
            parts.append(f"torch.compile{suffix} {t:.1f} µs, kforge.compile{suffix} {k:.1f} µs: {t / k:.3f}x, {verdict}")
        optimized = self.optimize_record()
        for key, name in (("ops", "kforge.optimize"), ("cuda_graphs", "kforge.optimize cuda_graphs")):
            if key in optimized:
                o = optimized[key]["optimize_us"]
                parts.append(f"{name} {o:.1f} µs: {self.eager_us / o:.3f}x eager" + (
                    ", slower: the package records it, and kforge.optimize runs the model as it is"
                    if optimized[key]["use"] == "eager" else ""))
        line = "; " + "; ".join(parts)
        record = self.compile_record()
        if record is None or record["use"] == "kforge.compile" and not record["drop"]:
            return line
        if record["drop"]:
            return line + (f". kforge.compile is not faster than torch.compile on this model with every card, and is "
                           f"without card {record['drop'][0]}: the package records it, and kforge.compile leaves "
                           "that card out")
        tried = (f"; leaving out one card at a time ({', '.join(c['card'] for c in record['leave_one_out'])}) did not "
                 "make it faster" if record.get("leave_one_out") else "")
        return line + (". kforge.compile is not faster than torch.compile on this model" + tried + ": the package "
                       "records it, and kforge.compile runs plain torch.compile for it. Sites to drop: the cards its "
                       "graphs ran (" + (", ".join(self.compile_hits) or "none") + "); kforge run --leave-one-out N "
                       "measures which of them help")

    def message(self) -> str:
        line = (f"model forward on {self.device}: eager {self.eager_us:.1f} µs (iqr {self.eager_iqr_us:.1f}), "
                f"with the package {self.package_us:.1f} µs (iqr {self.package_iqr_us:.1f}): "
                f"{self.speedup:.3f}x, {self.verdict}")
        if self.graph_speedup is not None and self.verdict != "unused":
            line += (f"; replayed from a CUDA graph: eager {self.graph_eager_us:.1f} µs, with the package "
                     f"{self.graph_package_us:.1f} µs: {self.graph_speedup:.3f}x, {self.graph_verdict}")
        elif self.graph_error:
            line += f"; not replayed from a CUDA graph ({self.graph_error})"
        if self.launch_bound and self.verdict in ("level", "slower") and self.graph_verdict == "faster":
            line += (f". This forward is bound by launch overhead ({self.eager_us:.1f} µs eager against "
                     f"{self.graph_eager_us:.1f} µs from a graph): the kernels' gains show when it is replayed from "
                     "a CUDA graph (torch.cuda.graph; the package works inside one), not when it runs op by op")
        elif self.verdict == "slower" and self.graphed and self.graph_verdict != "faster":
            # Measured: a graph does not recover the loss either.
            line += ("; every dispatched card beats eager on its own, but this model is slower with the package, "
                     "op by op and from a CUDA graph: do not apply the package as it is; search fewer cards "
                     "(--ops, --min-share) and check again")
        elif self.verdict == "slower":
            line += ("; every dispatched card beats eager on its own, but this model is slower with the package. "
                     "A forward bound by launch overhead pays for each call of an overridden op: do not apply the "
                     "package as it is. Either replay the forward from a CUDA graph (torch.cuda.graph; the package "
                     "works inside one), or search fewer cards (--ops, --min-share) and check again")
        elif self.verdict == "level":
            line += "; the package's gains are within the timing noise of this model"
        elif self.verdict == "unused":
            line += ("; no call of this forward reached the package's kernels (other shapes, dtypes or device "
                     "than the capture's): the package does nothing for it")
        return line + self._compile_message() + self._fastest_message()

    def to_json(self) -> dict:
        """The fields, and the verdicts derived from them."""
        return {**dataclasses.asdict(self), "speedup": self.speedup, "verdict": self.verdict,
                "graph_speedup": self.graph_speedup, "graph_verdict": self.graph_verdict,
                "launch_bound": self.launch_bound, "compile_verdict": self.compile_verdict(),
                "compile_graph_verdict": self.compile_verdict("reduce-overhead"), "compile_record": self.compile_record(),
                "fastest": self.fastest}


def _noise(eager_us: float, *iqrs_us: float) -> float:
    return max(max(iqrs_us) / 2, REL_NOISE * eager_us)


def _compare(eager_us: float, package_us: float, noise_us: float) -> str:
    diff = eager_us - package_us
    if abs(diff) <= noise_us:
        return "level"
    return "faster" if diff > 0 else "slower"


# kforge.optimize: the traced graphs with the package's region and op kernels, the rest eager (no Inductor);
# with cuda_graphs, each graph replayed from a CUDA graph.
COMPILED = ("torch.compile", "kforge.compile", "torch.compile reduce-overhead", "kforge.compile reduce-overhead",
            "kforge.optimize", "kforge.optimize cuda_graphs")


def compiled_forwards(model: torch.nn.Module, package, forward_of, *, launcher=None,
                      ran: dict | None = None) -> dict[str, Any]:
    """COMPILED name -> a forward of `model` compiled that way, compiled and warmed up here (three
    calls each: cudagraph trees record on a later call than the first). `forward_of(m)` is the
    forward to time with `m` in place of the model. `ran`, when given, gets per name the ids of
    the package's cards whose kernels that forward's warm-up ran."""
    from .inductor import compile as kforge_compile
    from .optimize import optimize

    makers = {"torch.compile": lambda: torch.compile(model),
              # use_verdict=False: the check measures the package's kernels, whatever an earlier check recorded
              "kforge.compile": lambda: kforge_compile(model, package, launcher=launcher, use_verdict=False),
              "torch.compile reduce-overhead": lambda: torch.compile(model, mode="reduce-overhead"),
              "kforge.compile reduce-overhead": lambda: kforge_compile(model, package, launcher=launcher,
                                                                       mode="reduce-overhead", use_verdict=False),
              "kforge.optimize": lambda: optimize(model, package, launcher=launcher, use_verdict=False),
              "kforge.optimize cuda_graphs": lambda: optimize(model, package, launcher=launcher, cuda_graphs=True,
                                                              use_verdict=False)}
    forwards = {}
    # kforge.optimize first: dynamo keeps its compiled entries per code object, shared by every
    # compiled model in the process. A frame torch.compile retraces past the recompile limit (an
    # expert called with a new token count each time) keeps checking its eight entries' guards on
    # every call, in the models compiled after it too; kforge.optimize has such a frame run
    # natively (optimize.OptimizedModel._count_frame), and so it does for the compiles after it.
    # Compiled first, kforge.optimize is timed as a user who runs only it gets it, and
    # torch.compile no worse than alone.
    for name in sorted(COMPILED, key=lambda n: not n.startswith("kforge.optimize")):
        before = [c.counters.hits for c in package.cards]
        fn = forward_of(makers[name]())
        for _ in range(3):
            fn()
        forwards[name] = fn
        if ran is not None:
            ran[name] = tuple(c.id for c, h in zip(package.cards, before) if c.counters.hits > h)
    return forwards


def _leave_one_out(model, package, compiled: dict, forward_of, cards: Sequence[str], *, launcher, calls: int,
                   rounds: int, device) -> dict:
    """kforge.compile without each card in turn, timed interleaved with torch.compile and
    kforge.compile: {"torch.compile": ..., "kforge.compile": ..., card: ...}, each (median, iqr)."""
    from .inductor import compile as kforge_compile

    forwards = {"torch.compile": compiled["torch.compile"], "kforge.compile": compiled["kforge.compile"]}
    for card in cards:
        fn = forward_of(kforge_compile(model, package, launcher=launcher, drop=[card], use_verdict=False))
        for _ in range(3):
            fn()
        forwards[card] = fn
    measured = timing.time_as_called([(contextlib.nullcontext, fn) for fn in forwards.values()],
                                     calls=calls, rounds=rounds, device=device)
    return {name: (m.median, m.iqr) for name, m in zip(forwards, measured)}


def _dynamo_codes() -> set | None:
    """The code objects dynamo has compiled frames of in this process (a private tracker: None
    on a torch without it, or without the reset_code that forgets one)."""
    if not hasattr(torch._dynamo, "reset_code"):  # what kforge.graph.forget calls
        return None
    try:
        from torch._dynamo.convert_frame import input_codes
        return {ref() for ref in input_codes.seen} - {None}
    except (ImportError, AttributeError):
        return None


@contextlib.contextmanager
def compiles_forgotten(model: torch.nn.Module):
    """Dynamo's compiled entries for the frames the block compiled dropped on the way out (the
    model's forward and any frame first compiled inside; kforge.graph.forget). The check traces
    the model's forward six ways and once per card left out, and dynamo keeps those entries per
    code object for the whole process: left behind, they put the user's own torch.compile or
    kforge.compile of that model past the recompile limit (8 a frame), and it runs eager without
    a word (after the check, KernelBench's problems timed kforge.compile at eager's speed, dynamo's
    "BACKEND_MATCH failure" eight times over). Frames compiled before and elsewhere keep theirs; on a
    torch without dynamo's tracker, torch.compiler.reset() drops every frame's."""
    from .graph import forget

    before = _dynamo_codes()
    try:
        yield
    finally:
        after = _dynamo_codes()
        if before is None or after is None:
            torch.compiler.reset()
        else:
            forward = getattr(type(model).forward, "__code__", None)
            for code in (after - before) | ({forward} if forward is not None else set()):
                forget(code)


def check_model(model: torch.nn.Module, example_inputs: Any, package, *, rounds: int = 10, calls: int | None = None,
                budget_s: float = 10.0, graphs: bool = True, with_compile: bool = False, leave_one_out: int = 0,
                **install_options: Any) -> ModelCheck:
    """Time `model` on `example_inputs` eager and under `package.apply(**install_options)`,
    interleaved: `rounds` rounds of `calls` forwards each (calls=None: about a millisecond of
    forwards per sample), in eval mode under torch.inference_mode, as a deployed forward runs and
    as bench/bench_model.py times it (no_grad still passes every op through autograd's dispatch
    keys, host time a launch-bound forward pays on every call). A slow model
    gets fewer rounds (never fewer than 3) so that the check takes about `budget_s` seconds;
    a model too slow for even that raises KforgeError. The package's kernels are loaded once
    for all rounds (unless install_options names a launcher). On a CUDA device (and with
    `graphs`) the forward is then replayed from CUDA graphs too, eager and with the package;
    a forward a graph cannot hold (one that syncs with the host, say) is reported in
    graph_error, not raised. With `with_compile` (CUDA only), the same rounds also time the forward
    under torch.compile and kforge.compile, default and reduce-overhead (COMPILED), and the check
    says whether kforge.compile beats torch.compile; a model that does not compile is reported in
    compile_error; dynamo's compiled entries are dropped when the check ends (compiles_forgotten). With `leave_one_out` N and kforge.compile not faster, where its graphs ran 1 to N
    cards: kforge.compile without each of them in turn, timed in further interleaved rounds beside
    torch.compile and kforge.compile (ModelCheck.leave_one_out; compile_record() uses it)."""
    args, kwargs = as_call(example_inputs, None)
    dev = model_device(model, args, kwargs)

    def forward():
        return model(*args, **kwargs)

    def synced():
        forward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with_compile = with_compile and dev.type == "cuda"
    with model_state(model, eval_mode=True), torch.inference_mode(), \
            (compiles_forgotten(model) if with_compile else contextlib.nullcontext()):
        synced()  # warm-up
        t0 = time.perf_counter()
        synced()
        one = max(time.perf_counter() - t0, 1e-7)
        if calls is None:
            calls = max(1, min(20, math.ceil(1e-3 / one)))
        # Each round runs every entry (eager, the package, and COMPILED's with_compile), each an
        # untimed call then `calls` timed ones; plus 2 warm-up rounds.
        per_round = (2 + len(COMPILED) * with_compile) * (1 + calls) * one
        if (MIN_ROUNDS + 2) * per_round > 3 * budget_s:
            raise KforgeError(f"one forward takes {one:.3g} s, so the model check would take "
                              f"{(MIN_ROUNDS + 2) * per_round:.3g} s; time the model with and without the "
                              f"package yourself (kforge.modelcheck.check_model with a larger budget_s)")
        rounds = max(MIN_ROUNDS, min(rounds, int(budget_s / per_round) - 2))
        if "launcher" not in install_options and package.kernel_cards():  # eager's and compiled graphs' kernels
            install_options = {**install_options, "launcher": package.launcher()}
        compiled, compile_error, compile_hits = {}, "", ()
        if with_compile:
            ran: dict = {}
            try:
                compiled = compiled_forwards(model, package, lambda m: lambda: m(*args, **kwargs),
                                             launcher=install_options.get("launcher"), ran=ran)
            except Exception as e:  # noqa: BLE001 (a model torch.compile cannot take: said, not raised)
                compile_error = _first_line(e)
            ours = {*ran.get("kforge.compile", ()), *ran.get("kforge.compile reduce-overhead", ())}
            compile_hits = tuple(c.id for c in package.cards if c.id in ours)  # not kforge.optimize's

        def total_hits() -> int:
            return sum(c.counters.hits for c in package.cards)

        in_graphs = [0]  # hits of the compiled forwards' rounds, which are not the eager package's

        @contextlib.contextmanager
        def counted_apart():
            h = total_hits()
            yield
            in_graphs[0] += total_hits() - h

        hits0 = total_hits()
        entries = [(contextlib.nullcontext, forward), (lambda: package.apply(**install_options), forward)]
        measured = timing.time_as_called(entries + [(counted_apart, fn) for fn in compiled.values()],
                                         calls=calls, rounds=rounds, device=dev)
        eager, packaged = measured[:2]
        hits = total_hits() - hits0 - in_graphs[0]
        check = ModelCheck(eager.median, eager.iqr, packaged.median, packaged.iqr, str(dev), calls, rounds, hits,
                           compiled={n: (m.median, m.iqr) for n, m in zip(compiled, measured[2:])},
                           compile_hits=compile_hits, compile_error=compile_error)
        if 0 < len(compile_hits) <= leave_one_out and "faster" not in (check.compile_verdict(),
                                                                          check.compile_verdict("reduce-overhead")):
            check = dataclasses.replace(check, leave_one_out=_leave_one_out(
                model, package, compiled, lambda m: lambda: m(*args, **kwargs), compile_hits,
                launcher=install_options.get("launcher"), calls=calls, rounds=rounds, device=dev))
        if graphs and dev.type == "cuda" and hits:
            try:
                with torch.cuda.device(dev):  # graphed() captures on the current device's streams
                    g_eager, g_package = time_graphs(forward, package, calls=calls, rounds=rounds, device=dev,
                                                     **install_options)
            except Exception as e:  # noqa: BLE001 (a forward a graph cannot hold: said, not raised)
                why = str(e) if isinstance(e, GraphUnsupported) else _first_line(e)
                return dataclasses.replace(check, graph_error=why)
            check = dataclasses.replace(check, graph_eager_us=g_eager.median, graph_eager_iqr_us=g_eager.iqr,
                                        graph_package_us=g_package.median, graph_package_iqr_us=g_package.iqr)
    return check
