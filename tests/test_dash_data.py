"""The dashboard's read-only queries, against a search log written with SQLiteStore."""

from __future__ import annotations

import json
import math
import re
import zipfile

import pytest

pytest.importorskip("dash")
pytest.importorskip("dash_cytoscape")

from conftest_dash import (DEMO_MODEL_CHECK, LLM, import_dash_app, kernel, make_compile_only_run,  # noqa: E402
                           make_demo_run, make_llm_error_run, write_capture_only, write_demo_run)

from fakes import logged
from kforge.store import SQLiteStore  # noqa: E402
from kforge.verdict import EvalResult, Verdict  # noqa: E402

import_dash_app()
from dash_app import figures  # noqa: E402
from dash_app.components import highlight  # noqa: E402
from dash_app.data import Catalog, NotFound  # noqa: E402
from dash_app.rows import failure_kind  # noqa: E402


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_run(tmp_path_factory.mktemp("dash-data"))


@pytest.fixture
def cat(demo):
    return Catalog([demo.run_dir], ttl_s=0)


def by_key(rows, key="verdict"):
    out = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


def test_runs_overview(cat, demo):
    (run,) = cat.runs()
    assert run["id"] == demo.run_id and run["model"] == "TinyModel" and run["status"] == "running"
    assert run["device"] == "NVIDIA H200" and run["arch"] == "sm_90"
    assert (run["cards"], run["searched"], run["done"], run["candidates"]) == (len(demo.card_ids), 3, 2, 15)
    assert run["best"][0][1] == pytest.approx(2.9)
    assert [s for _, s in run["best"]] == sorted((s for _, s in run["best"]), reverse=True)
    assert run["cost_usd"] == pytest.approx(4 * 0.0125 + 0.01)
    assert run["llm_calls"] == 6
    # Amdahl over the three cards that have winners
    shares = {c["card_id"]: (c["share"], c["best_speedup"]) for c in cat.cards(demo.run_id) if c["best_speedup"]}
    saved = sum(s * (1 - 1 / x) for s, x in shares.values())
    assert run["est_speedup"] == pytest.approx(1 / (1 - saved))


def test_cards_ranked_with_progress_cost_and_floor(cat, demo):
    cards = cat.cards(demo.run_id)
    assert [c["card_id"] for c in cards] == demo.card_ids
    assert [c["share"] for c in cards] == sorted((c["share"] for c in cards), reverse=True)
    by_id = {c["card_id"]: c for c in cards}
    main = by_id[demo.searched[0]]
    assert main["status"] == "done" and main["n_candidates"] == 11 and main["n_valid"] == 4
    assert main["iterations"] == 9  # last iteration 8, counted from 0
    assert main["best_speedup"] == pytest.approx(2.9)
    assert main["best_us"] == pytest.approx(main["eager_us"] / 2.9)
    assert main["cost_usd"] == pytest.approx(4 * 0.0125)
    assert main["best_floor_pct"] == pytest.approx(100 * main["floor_us"] / main["best_us"])
    assert main["eager_floor_pct"] < main["best_floor_pct"]
    third = by_id[demo.searched[2]]
    assert third["status"] == "searching" and third["cost_usd"] == pytest.approx(0.01)
    skipped = next(c for c in cards if c["family"] == "vendor")
    assert skipped["status"] == "skipped" and "vendor" in skipped["skip_reason"]
    assert skipped["best_speedup"] is None and skipped["best_floor_pct"] is None and skipped["n_candidates"] == 0
    assert cat.card(demo.run_id, main["card_id"])["module_paths"]


def test_candidates_and_one_candidate(cat, demo):
    cands = cat.candidates(demo.run_id, demo.searched[0])
    assert [c["id"] for c in cands] == sorted(c["id"] for c in cands) and len(cands) == 11
    assert "source" not in cands[0]  # the list stays small; sources come with one candidate
    verdicts = by_key(cands)
    assert set(verdicts) == {v.value for v in Verdict} - {"untimed"}
    compile_err = verdicts["compile_error"][0]
    assert compile_err["summary"] == 'kernel.cu(5): error: identifier "blockDimx" is undefined'
    repair = next(c for c in cands if c["repair_of"] == compile_err["id"])

    full = cat.candidate(demo.run_id, repair["id"])
    assert full["base_id"] == compile_err["id"]  # a repair diffs against what it repairs
    assert "blockDimx" in full["base_source"] and "blockDimx" not in full["source"]
    assert full["plan"]["kernels"][0]["name"] == "gelu_rows"
    assert full["knobs"] == {"threads": 128, "vec": 2}
    assert len(full["evidence"]["kernel_samples_us"]) == 100

    child = cat.candidate(demo.run_id, verdicts["incorrect"][0]["id"])
    assert child["base_id"] == child["parent_id"] is not None
    assert child["evidence"]["worst"] == {"index": [0, 17], "got": 0.52, "expected": 0.21}
    root_child = cat.candidate(demo.run_id, cands[0]["id"])
    assert root_child["base_id"] is None and root_child["base_source"] is None


def test_missing_things_raise_not_found_saying_what_to_do(cat, demo):
    with pytest.raises(NotFound, match="no run 'nope'.*runs page"):
        cat.cards("nope")
    with pytest.raises(NotFound, match="no card"):
        cat.card(demo.run_id, "0000")
    with pytest.raises(NotFound, match="no candidate #99999"):
        cat.candidate(demo.run_id, 99999)


def test_tree_edges_hang_repairs_off_what_they_repair(cat, demo):
    cands = {c["id"]: c for c in cat.candidates(demo.run_id, demo.searched[0])}
    edges = cat.tree_edges(demo.run_id, demo.searched[0])
    assert sorted(e["target"] for e in edges) == sorted(cands)
    for e in edges:
        c = cands[e["target"]]
        if c["repair_of"] is not None:
            assert e == {"source": c["repair_of"], "target": c["id"], "kind": "repair"}
        else:
            assert e == {"source": c["parent_id"], "target": c["id"], "kind": "child"}
    assert sum(e["source"] is None for e in edges) == 2  # two first versions; the repair hangs off its failure
    assert sum(e["kind"] == "repair" for e in edges) == 2


def test_latency_history_tracks_best_correct_latency(cat, demo):
    hist = cat.latency_history(demo.run_id, demo.searched[0])
    bests = [h["best_us"] for h in hist if h["best_us"] is not None]
    assert bests == sorted(bests, reverse=True)
    eager = cat.card(demo.run_id, demo.searched[0])["eager_us"]
    assert bests[0] == pytest.approx(eager / 1.3) and bests[-1] == pytest.approx(eager / 2.9)
    slower = next(h for h in hist if h["verdict"] == "slower")
    assert slower["kernel_us"] > slower["best_us"]  # a slower kernel never lowers the best


def test_failures_grouped_by_verdict_and_normalized_first_line(cat, demo):
    groups = cat.failures(demo.run_id)
    assert sum(g["count"] for g in groups) == 7
    assert [g["count"] for g in groups] == sorted((g["count"] for g in groups), reverse=True)
    kinds = {(g["verdict"], g["kind"]): g for g in groups}
    incorrect = kinds[("incorrect", "max abs err N > atol N at index N")]
    assert incorrect["count"] == 2 and len(incorrect["cards"]) == 1
    compile_err = next(g for g in groups if g["verdict"] == "compile_error")
    assert compile_err["count"] == 2 and set(compile_err["cards"]) == set(demo.searched[:2])
    assert all(v not in {g["verdict"] for g in groups} for v in ("valid", "slower"))


def test_failure_kind_ignores_numbers_and_addresses():
    assert failure_kind("fault at 0x7f00dead (block 12)\ndetails") == "fault at N (block N)"
    assert failure_kind("") == "(no message)"
    assert failure_kind("err 1.5e-3 vs 2") == failure_kind("err 0.2 vs 7")


def test_providers_compared(cat, demo):
    rows = {r["proposer"]: r for r in cat.providers(demo.run_id)}
    assert list(rows) == ["builtin", LLM]
    llm, builtin = rows[LLM], rows["builtin"]
    assert (llm["candidates"], llm["valid"], llm["failed"]) == (5, 3, 2)
    assert llm["failure_rate"] == pytest.approx(0.4)
    assert llm["best_speedup"] == pytest.approx(2.9) and llm["median_speedup"] == pytest.approx(2.4)
    assert llm["cards_won"] == 2 and builtin["cards_won"] == 1
    assert llm["cost_usd"] == pytest.approx(0.06) and llm["llm_calls"] == 6 and llm["failed_calls"] == 1
    assert llm["cost_per_valid"] == pytest.approx(0.02)
    assert builtin["cost_usd"] == 0 and builtin["cost_per_valid"] is None
    assert builtin["candidates"] == 10 and builtin["slower"] == 2


def test_package_rows_and_missing_or_corrupt_package(cat, demo, tmp_path):
    view = cat.package(demo.run_id)  # written by kforge.package.write_package
    assert view["error"] is None and view["path"].endswith("model.cast")
    assert view["header"]["gpu name"] == "NVIDIA H200" and view["header"]["gpu arch"] == "sm_90"
    rows = {r["card_id"]: r for r in view["cards"]}
    won, noisy, untouched = rows[demo.searched[0]], rows[demo.searched[1]], rows[demo.card_ids[-1]]
    assert won["decision"] == "dispatched" and won["kind"] == "custom" and won["candidate"] is not None
    assert won["compile_decision"] == "dispatched" and won["compile_us"] == pytest.approx(won["eager_us"])
    assert won["compile_reason"].startswith("2.90x faster than torch.compile")
    assert untouched["compile_decision"] == "fallback" and untouched["compile_reason"].startswith("not searched")
    assert won["speedup"] == pytest.approx(2.9)
    assert won["dispatched_us"] == pytest.approx(won["kernel_us"] + 2.0)
    assert won["eager_dispatched_us"] == pytest.approx(won["eager_us"])  # no separate eager-as-dispatched timing
    assert re.fullmatch(r"atol=\d\.?\d*e-0\d, rtol=1e-05", won["tolerance"]), won["tolerance"]
    assert noisy["decision"] == "fallback" and "eager as dispatched" in noisy["reason"]  # slower, or within noise
    assert noisy["compile_decision"] == "fallback" and "torch.compile" in noisy["compile_reason"]
    assert noisy["candidate"] is None and noisy["tolerance"] == ""
    assert untouched["reason"].startswith("not searched")
    assert won["summary"] == cat.card(demo.run_id, demo.searched[0])["summary"]

    other = write_demo_run(tmp_path, run_id="no-package")
    cast = other.run_dir / "model.cast"
    moved = cast.rename(tmp_path / "elsewhere.cast.bak")
    assert "no package for this run yet" in Catalog([other.run_dir], ttl_s=0).package("no-package")["error"]
    named = tmp_path / "named" / "model.cast"  # a package given to the dashboard by path
    named.parent.mkdir()
    moved.rename(named)
    assert Catalog([other.run_dir, named], ttl_s=0).package("no-package")["path"] == str(named)
    assert Catalog([other.run_dir, named], ttl_s=0).runs()[0]["id"] == "no-package"  # not read as a log
    cast.write_bytes(b"not a zip")
    assert "cannot read model.cast" in Catalog([other.run_dir], ttl_s=0).package("no-package")["error"]
    with zipfile.ZipFile(cast, "w") as z:
        z.writestr("kernels/x.cu", "")
    assert "manifest.json" in Catalog([other.run_dir], ttl_s=0).package("no-package")["error"]
    assert Catalog([other.run_dir], ttl_s=0).package("no-package")["path"] is None


def test_package_view_carries_the_latest_model_check_of_that_package(tmp_path):
    run = write_demo_run(tmp_path, run_id="checked")
    cast = (run.run_dir / "model.cast").resolve()
    assert Catalog([run.run_dir], ttl_s=0).package("checked")["model_check"] == {"level": "info",
                                                                                "message": DEMO_MODEL_CHECK}
    log = SQLiteStore(run.run_dir)
    log.event("checked", "model-check", f"{cast}: model forward on cuda:0: eager 100.0 µs ... 0.900x, slower",
              level="warning")
    log.event("checked", "model-check", f"{tmp_path / 'other.cast'}: model forward on cuda:0: ... 1.500x, faster")
    log.close()
    check = Catalog([run.run_dir], ttl_s=0).package("checked")["model_check"]
    # The newest check names another package file: the one shown is this package's latest.
    assert check == {"level": "warning", "message": "model forward on cuda:0: eager 100.0 µs ... 0.900x, slower"}


def test_package_of_another_run_is_not_shown(demo, tmp_path):
    other = write_demo_run(tmp_path, run_id="other-run")
    (other.run_dir / "model.cast").unlink()
    stray = demo.run_dir / "model.cast"
    assert "no package for this run" in Catalog([other.run_dir, stray], ttl_s=0).package("other-run")["error"]


def test_discovers_runs_in_subfolders_and_log_files(demo):
    parent = demo.run_dir.parent
    assert [r["id"] for r in Catalog([parent]).runs()] == [demo.run_id]
    assert [r["id"] for r in Catalog([demo.run_dir / "search.sqlite"]).runs()] == [demo.run_id]
    assert Catalog([parent / "does-not-exist"]).runs() == []


def test_ttl_cache_serves_stale_rows_until_it_expires(tmp_path):
    run = write_demo_run(tmp_path, run_id="live")
    cached, fresh = Catalog([run.run_dir], ttl_s=3600), Catalog([run.run_dir], ttl_s=0)
    card = run.searched[2]
    before = len(cached.candidates("live", card))
    assert len(fresh.candidates("live", card)) == before
    log = SQLiteStore(run.run_dir)
    log.add_candidate("live", card, kernel("gelu_rows", 64, 2), EvalResult(Verdict.VALID, eager_us=10, kernel_us=5),
                      parent_id=None, iteration=1)
    log.close()
    assert len(cached.candidates("live", card)) == before
    assert len(fresh.candidates("live", card)) == before + 1


def test_tree_elements_color_failures_by_verdict_and_winners_by_speedup(cat, demo):
    cid = demo.searched[0]
    card, cands = cat.card(demo.run_id, cid), cat.candidates(demo.run_id, cid)
    els = figures.tree_elements(card, cands, cat.tree_edges(demo.run_id, cid))
    nodes = {e["data"]["id"]: e["data"] for e in els if "source" not in e["data"]}
    edges = [e for e in els if "source" in e["data"]]
    assert len(nodes) == 12 and len(edges) == 11 and figures.ROOT in nodes
    assert {e["data"]["source"] for e in edges} <= set(nodes)
    assert sum(e["classes"] == "repair" for e in edges) == 2
    valid = sorted((c for c in cands if c["verdict"] == "valid"), key=lambda c: c["speedup"])
    shades = [nodes[figures.node_id(c["id"])]["color"] for c in valid]
    assert len(set(shades)) == len(shades)  # each speedup its own shade of green
    darkness = [sum(int(x) for x in s.removeprefix("rgb(").rstrip(")").split(",")) for s in shades]
    assert darkness == sorted(darkness, reverse=True)  # faster is darker
    hang = next(c for c in cands if c["verdict"] == "hang")
    assert nodes[figures.node_id(hang["id"])]["color"] == "#283593"
    assert nodes[figures.node_id(valid[-1]["id"])]["label"].endswith("2.90×")


def test_latency_figure_has_best_line_eager_and_floor(cat, demo):
    cid = demo.searched[0]
    fig = figures.latency_figure(cat.card(demo.run_id, cid), cat.latency_history(demo.run_id, cid))
    card = cat.card(demo.run_id, cid)
    names = [t.name for t in fig.data]
    assert names[:3] == ["valid", "slower", "best so far"]
    assert names[3].startswith("eager") and names[4].startswith("HBM floor")
    assert list(fig.data[3].y) == [card["eager_us"]] * 2 and list(fig.data[4].y) == [card["floor_us"]] * 2
    assert fig.layout.yaxis.type == "log"
    assert not any(math.isnan(y) for y in fig.data[2].y)


def test_highlight_keeps_text_and_adds_classes():
    source = kernel("k", 256, 1).source
    pre = highlight(source, "cuda")
    spans = pre.children.children
    text = "".join(s if isinstance(s, str) else s.children for s in spans)
    assert text.rstrip("\n") == source.rstrip("\n")
    assert {"k", "kt"} & {s.className for s in spans if not isinstance(s, str)}  # keywords / types styled


def test_pretty_json_keeps_deep_values_on_one_line():
    from dash_app.components import pretty_json

    plan = kernel("k", 256, 1).plan.to_json()
    text = pretty_json(plan)
    assert json.loads(text) == plan
    assert '      "args": [{"in": 0}, {"out": 0}, {"i32": 2048}]' in text.splitlines()
    assert pretty_json({}) == "{}" and pretty_json([1, [2]], inline_from=1) == "[\n  1,\n  [2]\n]"


def test_unreadable_log_is_listed_with_its_error(tmp_path):
    bad = tmp_path / "bad" / "search.sqlite"
    bad.parent.mkdir()
    bad.write_bytes(b"this is not sqlite" * 100)
    cat = Catalog([bad], ttl_s=0)
    assert cat.runs() == []
    (log,) = cat.unreadable()
    assert log["log"] == str(bad) and "not an SQLite file" in log["error"]
    with pytest.raises(NotFound, match="not an SQLite file.*move it away"):
        cat._read(bad, "SELECT id FROM runs")


# ---- runs written by the real code: a reader must read what the writers write ----------------

def test_providers_show_a_real_llm_runs_cost_under_its_proposer(tmp_path):
    run = make_llm_error_run(tmp_path)
    log = SQLiteStore(run.run_dir)
    (calls, cost, failed), = logged(log, "SELECT COUNT(*), SUM(cost_usd), SUM(status != 'ok') FROM llm_calls "
                                      "WHERE run_id=?", (run.run_id,))
    log.close()
    assert calls and cost > 0 and 0 < failed < calls  # one row per attempt: the HTTP 500s failed, the rest answered
    rows = {r["proposer"]: r for r in Catalog([run.run_dir], ttl_s=0).providers(run.run_id)}
    assert list(rows) == [LLM]  # not a phantom llm:llm:<model> row beside a $0 one
    assert rows[LLM]["cost_usd"] == pytest.approx(cost) and rows[LLM]["llm_calls"] == calls
    assert rows[LLM]["failed_calls"] == failed and rows[LLM]["candidates"] == 0


def test_proposer_errors_are_grouped_with_their_cards(tmp_path):
    run = make_llm_error_run(tmp_path)
    cat = Catalog([run.run_dir], ttl_s=0)
    groups = cat.proposer_errors(run.run_id)
    assert sum(g["count"] for g in groups) >= len(run.searched or cat.cards(run.run_id)[:1])
    useless = next(g for g in groups if "gave no usable answer" in g["example"])
    assert len(useless["cards"]) > 1  # one group over every card: card ids are normalized away
    assert any("500" in g["example"] or "overloaded" in g["example"] for g in groups)
    assert cat.failures(run.run_id) == []  # no candidate was ever evaluated


def test_package_tolerances_of_a_real_run(tmp_path):
    run = make_demo_run(tmp_path)
    rows = Catalog([run.run_dir], ttl_s=0).package(run.run_id)["cards"]
    with_winner = [r for r in rows if r["reason"].startswith("captured on cpu")]  # a winner, not dispatchable here
    assert with_winner and all(re.fullmatch(r"atol=\S+, rtol=1e-05(; atol=\S+, rtol=\S+)*", r["tolerance"])
                               for r in with_winner), [r["tolerance"] for r in with_winner]


def test_tolerance_text_takes_the_loosest_per_output_over_input_sets():
    from dash_app.rows import tolerance_text

    sets = {"seed1": [{"atol": 1e-6, "rtol": 1e-5, "how": "."}, {"atol": 0.0, "rtol": 0.0, "how": "exact"}],
            "seed2": [{"atol": 3e-6, "rtol": 1e-5, "how": "."}, {"atol": 0.0, "rtol": 0.0, "how": "exact"}]}
    assert tolerance_text(sets) == "atol=3e-06, rtol=1e-05; atol=0, rtol=0"
    assert tolerance_text(None) == "" and tolerance_text({"seed1": "junk"}) == ""


def test_capture_only_dir_is_a_run_with_its_cards_and_what_to_do_next(tmp_path):
    run_dir = write_capture_only(tmp_path)
    cat = Catalog([tmp_path], ttl_s=0)
    (run,) = cat.runs()
    assert run["id"] == run_dir.name and run["status"] == "captured" and run["kind"] == "captured"
    assert f"kforge search {run_dir}" in run["next"]
    cards = cat.cards(run["id"])
    assert len(cards) == run["cards"] > 3 and cards[0]["share"] >= cards[-1]["share"]
    assert {c["status"] for c in cards} == {"pending", "skipped"} and all(c["floor_us"] is None for c in cards)
    assert cat.card(run["id"], cards[0]["card_id"])["module_paths"]
    assert cat.failures(run["id"]) == [] and cat.providers(run["id"]) == []
    assert "captured only" in cat.package(run["id"])["error"]
    assert not (run_dir / "search.sqlite").exists()  # the dashboard never writes into a run dir


def test_compile_only_run_has_no_floor_and_says_to_run_on_a_gpu(tmp_path):
    run = make_compile_only_run(tmp_path)
    cat = Catalog([run.run_dir], ttl_s=0)
    info = cat.run(run.run_id)
    assert info["kind"] == "compile-only" and "nothing timed; run on a GPU" in info["next"]
    assert all(c["floor_us"] is None and c["best_floor_pct"] is None for c in cat.cards(run.run_id))
    assert "untimed" not in {g["verdict"] for g in cat.failures(run.run_id)}  # compiled fine: not a failure
    assert "nothing timed" in cat.package(run.run_id)["error"]


def test_run_plots_best_speedup_over_time_rate_and_share_before_after(cat, demo, tmp_path):
    run, cards, timeline = cat.run(demo.run_id), cat.cards(demo.run_id), cat.timeline(demo.run_id)
    assert len(timeline) == run["candidates"] and [t["created"] for t in timeline] == sorted(t["created"]
                                                                                              for t in timeline)
    best = figures.best_over_time_figure(run, cards, timeline, "unused")
    assert len(best.data) == 3  # the three cards with a valid kernel
    for trace in best.data:
        assert list(trace.y) == sorted(trace.y) and list(trace.x) == sorted(trace.x)
    assert max(max(t.y) for t in best.data) == pytest.approx(2.9)
    rate = figures.rate_figure(run, timeline, "unused")
    assert sum(sum(t.y) for t in rate.data) == len(timeline)
    share = figures.share_before_after_figure(cards)
    before, after = (sum(t.x[i] for t in share.data) for i in (0, 1))
    saved = sum(c["share"] * (1 - 1 / c["best_speedup"]) for c in cards if c["best_speedup"])
    assert before - after == pytest.approx(100 * saved) and 1 / (1 - saved) == pytest.approx(run["est_speedup"])
    assert before == pytest.approx(100 * sum(c["share"] for c in cards if c["top_calls"] != 0))
    assert before < 100 * sum(c["share"] for c in cards)  # nested cards (inside another card's calls) left out

    compile_only = make_compile_only_run(tmp_path)
    other = Catalog([compile_only.run_dir], ttl_s=0)
    info = other.run(compile_only.run_id)
    empty = figures.best_over_time_figure(info, other.cards(compile_only.run_id), other.timeline(compile_only.run_id),
                                          info["next"])
    assert not empty.data and "nothing timed; run on a GPU" in empty.layout.annotations[0].text


def test_compare_matches_cards_of_two_runs_by_op_and_arguments(demo, tmp_path):
    compile_only = make_compile_only_run(tmp_path)
    cat = Catalog([demo.run_dir, compile_only.run_dir], ttl_s=0)
    rows = cat.compare(demo.run_id, compile_only.run_id)
    gelu = next(r for r in rows if r["summary"].startswith("gelu"))
    assert gelu["card_a"] == demo.searched[0] and gelu["card_b"] is not None
    assert gelu["best_speedup_a"] == pytest.approx(2.9) and gelu["best_speedup_b"] is None
    assert gelu["status_b"] == "done" and gelu["share_b"] is not None
    assert [max(r["share_a"] or 0, r["share_b"] or 0) for r in rows] == sorted(
        (max(r["share_a"] or 0, r["share_b"] or 0) for r in rows), reverse=True)
