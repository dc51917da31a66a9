"""The dashboard in a real headless Chromium: every page loads without console errors,
navigation works, clicking a tree node opens its candidate, and a candidate written to the
log shows up without a reload.

The app reads the runs a user can make, all written by kforge's own writers: one written row
by row (every verdict, repairs, LLM calls, a package), one made by a real `kforge.runner.run`
on a CPU model with fake evaluator, a capture without a search, a run without a GPU
(compile-only) and a run whose LLM proposer never gave a usable kernel.
Set KFORGE_SCREENSHOTS=DIR to write each page of the fixture run there (the README's screenshots
come from a real GPU run instead: open its run directory with `kforge dash` and screenshot it).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

pytest.importorskip("dash")
pytest.importorskip("dash_cytoscape")
pytest.importorskip("selenium", reason="dash[testing] (selenium) is needed for browser tests")
if not (shutil.which("chromium") or shutil.which("google-chrome")) or not shutil.which("chromedriver"):
    pytest.skip("needs Chromium (or Chrome) and chromedriver on PATH", allow_module_level=True)

from conftest_dash import (LLM, import_dash_app, kernel, make_compile_only_run, make_demo_run,  # noqa: E402
                           make_llm_error_run, write_capture_only, write_demo_run)
from dash.testing.application_runners import ThreadedRunner  # noqa: E402
from dash.testing.composite import DashComposite  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402

from fakes import logged
from kforge.store import SQLiteStore  # noqa: E402
from kforge.verdict import EvalResult, Verdict  # noqa: E402

create_app = import_dash_app().create_app

# cytoscape.js keeps its instance on the container element as `_cyreg.cy`.
FIND_CY = """
const root = document.getElementById(arguments[0]);
const el = [root, ...root.querySelectorAll('div')].find(d => d._cyreg && d._cyreg.cy);
return el ? el._cyreg.cy : null;
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dash-browser")
    return write_demo_run(base), make_demo_run(base)


@pytest.fixture(scope="module")
def others(tmp_path_factory):
    """(capture-only run dir, compile-only run, run with proposer errors)."""
    base = tmp_path_factory.mktemp("dash-browser-others")
    return write_capture_only(base), make_compile_only_run(base), make_llm_error_run(base)


@pytest.fixture(scope="module")
def duo(runs, others):
    captured, compile_only, llm_errors = others
    app = create_app([r.run_dir for r in runs] + [captured, compile_only.run_dir, llm_errors.run_dir], ttl_s=0.5)
    with ThreadedRunner() as server, DashComposite(server, browser="Chrome", headless=True, percy_run=False,
                                                   wait_timeout=20) as dc:
        dc.driver.set_window_size(1400, 1000)
        dc.start_server(app)
        yield dc


def open_page(duo, path: str, ready: str) -> None:
    """Navigate (a full load) and wait until `ready` is on the page."""
    duo.driver.get(duo.server_url + path)
    duo.wait_for_element(ready)


def no_console_errors(duo) -> None:
    logs = duo.get_logs()
    assert logs == [], logs


def test_runs_page_lists_every_run(duo, runs):
    written, real = runs
    open_page(duo, "/", "#runs-table")
    duo.wait_for_contains_text("#runs-table", written.run_id)
    duo.wait_for_contains_text("#runs-table", real.run_id)
    duo.wait_for_contains_text("#runs-table", "TinyModel")
    no_console_errors(duo)


def test_navigation_through_a_run(duo, runs):
    written, _ = runs
    open_page(duo, "/", "#runs-table")
    duo.wait_for_contains_text("#runs-table", written.run_id)
    duo.find_element(f'#runs-table a[href*="run={written.run_id}"]').click()
    duo.wait_for_contains_text("#cards-table", "gelu")
    duo.wait_for_contains_text("#cards-events", "rate limited")
    assert "/cards" in duo.driver.current_url
    for page, ready, text in (("failures", "#failures-body", "compile_error"),
                              ("providers", "#providers-table", "llm:demo-coder"),
                              ("package", "#package-table", "dispatched"),
                              ("cards", "#cards-table", "layer_norm")):
        duo.find_element(f"#nav-{page}").click()
        duo.wait_for_contains_text(ready, text)
        assert f"/{page}?run={written.run_id}" in duo.driver.current_url
        if page == "package":  # the run's model check heads the package
            duo.wait_for_contains_text("#package-model-check", "1.122x, faster")
            duo.wait_for_contains_text("#package-table", "compiled graphs")  # beside eager's decision
        no_console_errors(duo)
    duo.find_element(f'#cards-table a[href*="card={written.searched[0]}"]').click()
    duo.wait_for_contains_text("#card-title", "gelu")
    duo.find_element("#nav-runs").click()
    duo.wait_for_contains_text("#runs-table", written.run_id)
    no_console_errors(duo)


def test_pages_of_the_real_run(duo, runs):
    _, real = runs
    for page, ready, text in (("cards", "#cards-table", "gelu"), ("failures", "#failures-body", "too many registers"),
                              ("providers", "#providers-table", "fake"), ("package", "#package-table", "fallback")):
        open_page(duo, f"/{page}?run={real.run_id}", ready)
        duo.wait_for_contains_text(ready, text)
    no_console_errors(duo)


def fits_the_window(duo) -> None:
    """No sideways scroll at 1400 px: neither the page nor any table is wider than its box."""
    wide = duo.driver.execute_script(
        "const els = [document.documentElement, ...document.querySelectorAll('.dash-spreadsheet-container')];"
        "return els.filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.className || e.tagName);")
    assert wide == [], wide


def test_capture_only_run_shows_cards_shares_and_what_to_do_next(duo, others):
    captured, _, _ = others
    open_page(duo, "/", "#runs-table")
    duo.wait_for_contains_text("#runs-table", captured.name)
    duo.wait_for_contains_text("#runs-table", "captured")
    open_page(duo, f"/cards?run={captured.name}", "#cards-table")
    duo.wait_for_contains_text("#next-step", f"kforge search {captured}")
    duo.wait_for_contains_text("#cards-table", "gelu")
    duo.wait_for_contains_text("#cards-table", "view/metadata op")
    duo.wait_for_element("#cards-share .main-svg")
    duo.wait_for_contains_text("#cards-floor-note", "No HBM floor")
    for page, ready, text in (("failures", "#failures-body", "captured only"),
                              ("providers", "#providers-note", "No proposer has run yet"),
                              ("package", "#package-head", "captured only")):
        open_page(duo, f"/{page}?run={captured.name}", ready)
        duo.wait_for_contains_text(ready, text)
    no_console_errors(duo)


def test_compile_only_run_says_nothing_was_timed(duo, others):
    _, run, _ = others
    open_page(duo, f"/cards?run={run.run_id}", "#cards-table")
    duo.wait_for_contains_text("#next-step", "compile-only: nothing timed; run on a GPU")
    duo.wait_for_contains_text("#cards-floor-note", "No HBM floor")
    assert "H200" not in duo.find_element("#cards-head").text
    open_page(duo, f"/package?run={run.run_id}", "#package-head")
    duo.wait_for_contains_text("#package-head", "compile-only: nothing timed")
    assert "--out model.cast" not in duo.find_element("#package-head").text  # the CLI refuses that here
    open_page(duo, f"/card?run={run.run_id}&card={run.searched[0]}", "#card-table")
    duo.wait_for_contains_text("#card-table", "untimed")
    no_console_errors(duo)


def test_proposer_errors_show_on_failures_and_providers(duo, others):
    _, _, run = others
    open_page(duo, f"/failures?run={run.run_id}", "#failures-body")
    duo.wait_for_contains_text("#proposer-errors", "gave no usable answer")
    duo.wait_for_contains_text("#failures-body", "the proposer gave no candidate to evaluate")
    open_page(duo, f"/providers?run={run.run_id}", "#providers-table")
    duo.wait_for_contains_text("#providers-table", LLM)
    duo.wait_for_contains_text("#proposer-errors", "gave no usable answer")
    assert "llm:llm:" not in duo.find_element("#providers-table").text
    no_console_errors(duo)


def test_timeline_and_compare_pages(duo, runs, others):
    written, real = runs
    open_page(duo, f"/timeline?run={written.run_id}", "#timeline-best")
    duo.wait_for_contains_text("#timeline-best", "best speedup per card over time")
    duo.wait_for_contains_text("#timeline-rate", "candidates per minute")
    duo.wait_for_contains_text("#timeline-share", "with winners")
    _, compile_only, _ = others
    open_page(duo, f"/timeline?run={compile_only.run_id}", "#timeline-best")
    duo.wait_for_contains_text("#timeline-best", "nothing timed; run on a GPU")
    open_page(duo, f"/compare?a={written.run_id}&b={real.run_id}", "#compare-table")
    duo.wait_for_contains_text("#compare-kv", written.run_id)
    duo.wait_for_contains_text("#compare-kv", "NVIDIA H200")
    duo.wait_for_contains_text("#compare-table", "gelu")
    fits_the_window(duo)
    no_console_errors(duo)


def test_tables_fit_at_1400_px(duo, runs):
    written, _ = runs
    for page in ("", f"cards?run={written.run_id}", f"card?run={written.run_id}&card={written.searched[0]}",
                 f"providers?run={written.run_id}", f"package?run={written.run_id}"):
        open_page(duo, f"/{page}", ".dash-spreadsheet-container")
        time.sleep(0.5)
        fits_the_window(duo)


def wait_for_tree(duo, at_least: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        n = duo.driver.execute_script(f"const cy = (function(){{{FIND_CY}}})(arguments[0]); "
                                      "return cy ? cy.nodes().length : 0;", "card-tree")
        if n >= at_least:
            return
        time.sleep(0.2)
    raise AssertionError(f"the tree never showed {at_least} nodes")


def click_node(duo, node_id: str) -> None:
    """A real mouse click where cytoscape drew the node."""
    duo.driver.execute_script("document.getElementById('card-tree').scrollIntoView({block: 'center'});")
    x, y = duo.driver.execute_script(
        f"const cy = (function(){{{FIND_CY}}})(arguments[0]); const p = cy.getElementById(arguments[1])"
        ".renderedPosition(); const r = cy.container().getBoundingClientRect(); return [r.left + p.x, r.top + p.y];",
        "card-tree", node_id)
    ActionChains(duo.driver).move_to_location(int(x), int(y)).click().perform()


def test_clicking_a_tree_node_opens_its_candidate(duo, runs):
    written, _ = runs
    open_page(duo, f"/card?run={written.run_id}&card={written.searched[0]}", "#card-tree")
    wait_for_tree(duo, 12)
    duo.wait_for_contains_text("#card-table", "blockDimx")
    newest = max(int(a.text.lstrip("#")) for a in duo.find_elements("#card-table a"))  # newest candidate first
    click_node(duo, f"c{newest}")
    duo.wait_for_text_to_equal("#card-node-title", f"Candidate #{newest}")
    duo.find_element("#card-node-open").click()
    duo.wait_for_contains_text("#cand-title", f"Candidate #{newest}")
    assert f"/candidate?run={written.run_id}&id={newest}" in duo.driver.current_url
    duo.wait_for_contains_text("pre.hl", "__global__")
    no_console_errors(duo)


def test_candidate_page_shows_diff_errors_and_timing(duo, runs):
    written, _ = runs
    log = SQLiteStore(written.run_dir)
    rows = {r.verdict: r.id for r in log.candidates(written.run_id, written.searched[0])}
    repair = logged(log, "SELECT id, repair_of FROM candidates WHERE repair_of IS NOT NULL ORDER BY id LIMIT 1")[0]
    log.close()
    open_page(duo, f"/candidate?run={written.run_id}&id={repair['id']}", "#cand-title")
    duo.wait_for_contains_text(".page", f"Diff against #{repair['repair_of']} (the candidate it repairs)")
    duo.wait_for_contains_text(".page", "- ")
    duo.wait_for_element("#cand-timing .main-svg")  # samples drawn as box plots
    open_page(duo, f"/candidate?run={written.run_id}&id={rows['incorrect']}", "#cand-title")
    duo.wait_for_contains_text(".page", "max abs err")
    duo.wait_for_contains_text(".page", '"expected": 0.21')
    open_page(duo, f"/candidate?run={written.run_id}&id={rows['compile_error']}", "#cand-title")
    duo.wait_for_contains_text(".page", "Compiler log")
    no_console_errors(duo)


def test_pages_without_their_ids_say_what_is_missing(duo):
    for path in ("/card", "/candidate?run=x", "/cards", "/failures?run=nope"):
        open_page(duo, path, ".problem")
    no_console_errors(duo)


def test_a_new_candidate_appears_without_reload(duo, runs):
    _, real = runs
    card = real.searched[0]
    open_page(duo, f"/card?run={real.run_id}&card={card}", "#card-count")
    log = SQLiteStore(real.run_dir)
    before = len(log.candidates(real.run_id, card))
    duo.wait_for_text_to_equal("#card-count", str(before))
    wait_for_tree(duo, before + 1)
    duo.driver.execute_script("window.__notReloaded = true;")
    cid = log.add_candidate(real.run_id, card, kernel("live_kernel", 128, 2),
                            EvalResult(Verdict.VALID, eager_us=10.0, kernel_us=2.0), parent_id=None, iteration=99)
    log.close()
    duo.wait_for_text_to_equal("#card-count", str(before + 1))
    duo.wait_for_contains_text("#card-table", f"#{cid}")
    wait_for_tree(duo, before + 2)
    assert duo.driver.execute_script("return window.__notReloaded === true;")
    no_console_errors(duo)


def test_screenshots(duo, runs, tmp_path):
    """One screenshot per page; into docs/screenshots when KFORGE_SCREENSHOTS says so."""
    written, _ = runs
    out = Path(os.environ.get("KFORGE_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    main = written.searched[0]
    log = SQLiteStore(written.run_dir)
    best = logged(log, "SELECT best_candidate FROM cards WHERE run_id=? AND card_id=?", (written.run_id, main))[0][0]
    repair = logged(log, "SELECT id FROM candidates WHERE repair_of IS NOT NULL ORDER BY id LIMIT 1")[0][0]
    log.close()
    run = written.run_id
    pages = {
        "runs": ("/", "#runs-table", written.run_id),
        "cards": (f"/cards?run={run}", "#cards-table", "gelu"),
        "timeline": (f"/timeline?run={run}", "#timeline-share", "with winners"),
        "card": (f"/card?run={run}&card={main}", "#card-table", "blockDimx"),
        "candidate": (f"/candidate?run={run}&id={best}", "#cand-title", "Candidate"),
        "candidate_repair": (f"/candidate?run={run}&id={repair}", "#cand-title", "Candidate"),
        "failures": (f"/failures?run={run}", "#failures-body", "compile_error"),
        "providers": (f"/providers?run={run}", "#providers-table", "builtin"),
        "package": (f"/package?run={run}", "#package-table", "dispatched"),
    }
    for name, (path, ready, text) in pages.items():
        open_page(duo, path, ready)
        duo.wait_for_contains_text(ready, text)
        if name == "card":
            wait_for_tree(duo, 12)
        time.sleep(0.5)  # let plotly finish drawing
        height = duo.driver.execute_script("return document.body.scrollHeight;")
        duo.driver.set_window_size(1400, min(max(height + 140, 700), 2200))  # the whole page, within reason
        time.sleep(0.3)
        assert duo.driver.save_screenshot(str(out / f"{name}.png"))
        duo.driver.set_window_size(1400, 1000)
    no_console_errors(duo)
