"""Comparing runs in the MLflow UI, checked in a real browser (headless Chromium via Selenium).

A new user's path: a training run and a tiny sweep on the embedded store, `mlflow ui` on it, and
the links the commands printed. The rendered page must show the sweep with its trials nested,
trial names that differ, and the recommended trial found by its tag. Screenshots are saved under
``test-artifacts/mlflow-ui/`` (or ``$RAYSYS_TEST_ARTIFACTS``) for a person to look at.

Needs Debian's ``chromium`` and ``chromium-driver`` (scripts/install.sh installs them where apt
can); skipped, saying so, where they are not installed.
"""

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, free_port

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER), reason="no browser: install Debian's chromium and chromium-driver "
                                      "(apt-get install chromium chromium-driver) to run the MLflow UI test")

SPACE = REPO / "tune_spaces" / "deep_gpcm.yaml"
TINY = ["--preset", "quick", "--set", "data.n_students=120", "--set", "data.data_dir=raysys_data/synthetic_OC_quick",
        "--set", "train.epochs=2", "--set", "train.compile=false", "--set", "train.log_every_steps=2"]
RUN_NAMES = ("return [...document.querySelectorAll(\"div[role=gridcell][col-id='attributes.`Run Name`'] a span\")]"
             ".map(e => e.textContent)")
COLUMNS = "return [...document.querySelectorAll('.ag-header-cell[col-id]')].map(e => e.getAttribute('col-id'))"


def _run(workdir: Path, *cmd: str) -> str:
    proc = subprocess.run([sys.executable, "-m", *cmd], cwd=workdir, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_ADDRESS": "local"})
    print(proc.stdout[-4000:], proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture
def mlflow_ui(workdir):
    """`mlflow ui` on the embedded store, on a free port; yields its base URL."""
    port = free_port()
    log = open(workdir / "mlflow-ui.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri",
                             f"sqlite:///{workdir / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"mlflow ui did not start:\n{(workdir / 'mlflow-ui.log').read_text()[-3000:]}")
            time.sleep(1)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    # This machine's network is closed: without the background-networking flags Chromium keeps
    # trying to reach Google's hosts.
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1900,1000"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def _artifacts() -> Path:
    out = Path(os.environ.get("RAYSYS_TEST_ARTIFACTS", REPO / "test-artifacts")) / "mlflow-ui"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _names(driver) -> list[str]:
    """The runs table's names, read in one script (the grid re-renders rows while it loads)."""
    return driver.execute_script(RUN_NAMES)


def _all_columns(driver) -> set[str]:
    """The grid's column ids. The grid renders only the columns in view: scroll it sideways to see all."""
    seen = set(driver.execute_script(COLUMNS))
    for _ in range(20):
        moved = driver.execute_script(
            "const v = document.querySelector('.ag-body-horizontal-scroll-viewport'); if (!v) return false;"
            "const before = v.scrollLeft; v.scrollLeft = before + 500; v.dispatchEvent(new Event('scroll'));"
            "return v.scrollLeft > before;")
        time.sleep(0.4)
        seen |= set(driver.execute_script(COLUMNS))
        if not moved:
            break
    return seen


def _wait_for(driver, what, timeout: float = 60.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.5).until(lambda d: what(d))


def _link(stdout: str, pattern: str, ui: str) -> str:
    """A link a command printed, pointed at this test's `mlflow ui` (it printed mlflow ui's default port)."""
    m = re.search(pattern + r" (http://127\.0\.0\.1:5000/\S+)", stdout)
    assert m, f"no MLflow link after '{pattern}' in the output"
    return m.group(1).replace("http://127.0.0.1:5000", ui)


# ~1.5 min (a browser, an `mlflow ui`, a run and a sweep); the default suite checks the same runs' form through
# MLflow's client (test_tune_sweep, test_plugin_population's assert_like_a_lone_trial)
@pytest.mark.slow
def test_a_new_user_lands_on_the_sweep_and_finds_the_recommended_trial(workdir, mlflow_ui, browser):
    from mlflow.tracking import MlflowClient

    shots = _artifacts()
    train_out = _run(workdir, "raysys", "train", "deep_gpcm", *TINY, "--workers", "0", "--name", "first")
    sweep_out = _run(workdir, "raysys.tune", "--space", str(SPACE), "--num-samples", "3", "--max-concurrent", "2",
                     *TINY, "--name", "s3")
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raysys-deep_gpcm")
    runs = client.search_runs([exp.experiment_id])
    trials = {r.data.tags["raysys.trial_id"]: r for r in runs if r.data.tags.get("raysys.kind") == "sweep_trial"}
    (recommended,) = [r for r in trials.values() if r.data.tags["raysys.recommended"] == "true"]
    assert len(trials) == 3

    # The sweep's link: this sweep's runs, the trials nested under the sweep until unfolded.
    browser.get(_link(sweep_out, "compare the trials in MLflow:", mlflow_ui))
    _wait_for(browser, lambda d: "s3" in _names(d))
    assert "Model training" in browser.find_element("tag name", "body").text  # not the GenAI traces page
    for button in browser.find_elements("xpath", "//button[@aria-label='Close']"):  # the assistant panel
        if button.is_displayed():
            button.click()
    browser.save_screenshot(str(shots / "1-sweep-link.png"))
    assert _names(browser) == ["s3"]  # nested: only the sweep shows before it is unfolded
    parent_row = browser.find_element("xpath", "//div[@role='gridcell'][.//a/span[normalize-space(text())='s3']]")
    parent_row.find_element("tag name", "button").click()  # the row's expander
    names = _wait_for(browser, lambda d: (lambda n: n if len(n) == 4 else None)(_names(d)))
    browser.save_screenshot(str(shots / "2-sweep-unfolded.png"))
    assert names[0] == "s3"
    shown = names[1:]
    assert len(set(shown)) == 3  # trial names differ
    assert {n.split(" ")[0] for n in shown} == set(trials)  # each starts with its trial id
    assert {n for n in shown} == {r.info.run_name for r in trials.values()}
    columns = _all_columns(browser)
    for column in ("metrics.`objective/quality`", "metrics.`objective/throughput`", "tags.`raysys.recommended`",
                   "tags.`raysys.on_front`", "params.`model.path`"):
        assert column in columns, (column, columns)  # the view's columns: objectives, marks, knobs

    # The recommended trial, found by its tag.
    query = urllib.parse.quote("tags.`raysys.recommended` = 'true'")
    browser.get(f"{mlflow_ui}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning&searchFilter={query}")
    # Shown alone (under its sweep, for context), once the table has loaded the filtered runs.
    _wait_for(browser, lambda d: [n for n in _names(d) if n != "s3"] == [recommended.info.run_name])
    time.sleep(1)  # let the loading overlay fade before the screenshot
    browser.save_screenshot(str(shots / "3-recommended-by-tag.png"))

    # The training run's link opens the run: its description says how to run it again.
    browser.get(_link(train_out, r"\[raysys\] MLflow:", mlflow_ui))
    _wait_for(browser, lambda d: "Run again" in d.find_element("tag name", "body").text)
    body = browser.find_element("tag name", "body").text
    assert "first" in body and "raysys.preset" in body and "synthetic_OC_quick" in body  # name, preset tag, dataset
    browser.save_screenshot(str(shots / "4-training-run.png"))
