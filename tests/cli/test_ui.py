"""The MLflow UI, started the way `make ui` starts it, opened in a real headless Chromium
(Debian's package, driven by Playwright): the run page and the compare view show the runs'
quality/* and speed/* values. Screenshots are kept under test-artifacts/."""

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from quantbench.core.processes import free_port, stop_group

pytestmark = pytest.mark.slow  # the MLflow UI and a browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("QUANTBENCH_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"CI needs a browser for the UI test: {CHROMIUM} is missing (.ci/run installs Debian's chromium)")
    pytest.skip("no Chromium here: `apt-get install chromium` to run the MLflow UI browser test", allow_module_level=True)


@pytest.fixture
def ui(scored_runs, tmp_path):
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": scored_runs["tracking_uri"]}
    log = open(tmp_path / "ui.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "quantbench", "ui", "--port", str(port)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the MLflow UI did not start:\n{(tmp_path / 'ui.log').read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield url
    finally:
        stop_group(proc, 20)
        log.close()


def scroll_until_visible(page, grid, text: str) -> None:
    """The compare view's metric table is a virtualized grid (`grid`, its element): only rows near its
    scroll position exist, so the grid is scrolled from the top until `text` shows."""
    for step in range(80):
        found = page.get_by_text(text, exact=True)
        if found.count() and found.first.is_visible():
            return
        grid.evaluate("(g, top) => { g.scrollTop = top; g.dispatchEvent(new Event('scroll')); }", step * 120)
        page.wait_for_timeout(100)
    raise AssertionError(f"{text} never appeared in the compare view's metrics")


def test_ui_binds_loopback_and_shows_the_runs_metrics(ui, scored_runs, tmp_path):
    import psutil

    listening = {c.laddr for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == int(ui.rsplit(":", 1)[1])}
    assert {addr.ip for addr in listening} == {"127.0.0.1"}, listening  # loopback only, as `make ui` promises

    from mlflow.tracking import MlflowClient
    from playwright.sync_api import expect, sync_playwright

    client = MlflowClient(scored_runs["tracking_uri"])
    experiment = client.get_experiment_by_name(scored_runs["experiment"]).experiment_id
    run = client.get_run(scored_runs["gptq"])
    kld = run.data.metrics["quality/kld_mean"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1400})
        page.goto(f"{ui}/#/experiments/{experiment}/runs/{run.info.run_id}", wait_until="domcontentloaded")
        # the run's name as the reviewer sees it, and its metrics with values
        expect(page.get_by_text(run.info.run_name).first).to_be_visible(timeout=60_000)
        for name in ("quality/kld_mean", "speed/decode_tok_s", "speedup/decode_tok_s"):
            expect(page.get_by_text(name, exact=True).first).to_be_visible(timeout=30_000)
        body = page.inner_text("body")
        assert f"{kld:.4g}"[:5] in body or str(round(kld, 4)) in body, "the KLD value is not on the run page"
        # the verdict is the run's description, rendered as a table on its page (release/verdict.py)
        expect(page.get_by_text("Verdict", exact=True).first).to_be_visible(timeout=30_000)
        for figure in ("KLD vs base, mean", "top-1 agreement", "size", "decode speed ×"):
            expect(page.get_by_role("cell", name=figure, exact=True).first).to_be_visible(timeout=30_000)
        assert "verdict.html" in {a.path for a in client.list_artifacts(run.info.run_id)}
        page.screenshot(path=str(ARTIFACTS / "mlflow-ui-run.png"), full_page=True)

        # the experiment's runs list (MLflow 3 opens its GenAI view unless asked for model training)
        page.goto(f"{ui}/#/experiments/{experiment}/runs?workflowType=machine_learning", wait_until="domcontentloaded")
        names = {run_id: client.get_run(run_id).info.run_name for run_id in (scored_runs["gptq"], scored_runs["fp8"])}
        for name in names.values():
            expect(page.get_by_text(name, exact=True).first).to_be_visible(timeout=60_000)
        page.screenshot(path=str(ARTIFACTS / "mlflow-ui-experiment.png"), full_page=True)

        # the compare view: metric names line up across runs, one value per run
        ids = ",".join(f'"{run_id}"' for run_id in names)
        page.goto(f'{ui}/#/compare-runs?runs=[{ids}]&experiments=["{experiment}"]', wait_until="domcontentloaded")
        for name in names.values():
            expect(page.get_by_text(name, exact=True).first).to_be_visible(timeout=60_000)
        # the grid lists the metrics by name and renders rows as it scrolls: the first name is there at once
        first = min(set(run.data.metrics) | set(client.get_run(scored_runs["fp8"]).data.metrics))
        expect(page.get_by_text(first, exact=True).first).to_be_visible(timeout=30_000)
        grid = page.get_by_text(first, exact=True).first.evaluate_handle("e => e.closest('.ReactVirtualized__Grid')")
        for key in ("model/compression_ratio", "quality/kld_mean", "speed/decode_tok_s"):  # the first row scrolls away
            scroll_until_visible(page, grid, key)
        page.get_by_text("speed/decode_tok_s", exact=True).first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "mlflow-ui-compare.png"))
        browser.close()
    assert (ARTIFACTS / "mlflow-ui-run.png").stat().st_size > 10_000
