"""The `specdec_trace` extension on a tiny model, and the playground page (`specdec serve` at /) in a real
headless Chromium (Debian's chromium + chromium-driver, driven by Selenium; nothing is downloaded): with the API
key on, the page loads without console errors, an answer streams with tokens coloured by origin, the counters
and the chart update, compare mode shows two identical answers, the tooltip explains a token, and a full queue
shows the 429 message.

Set SPECDEC_PLAYGROUND_PNG=docs/playground.png to refresh the README's screenshot."""

import json
import os
import shutil
import threading

import httpx
import pytest
import torch

import specdec
from specdec.drafters.base import Drafter
from specdec.drafters.chain import ChainDrafter
from specdec.engine.scheduler import Scheduler
from specdec.sampling import SamplingParams
from specdec.sequence import Draft, Sequence
from specdec.server.app import ServerConfig, create_app
from specdec.server.serve import ServerThread
from specdec.trace import step_trace

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
KEY = "play-key"
PROMPT = "List the numbers from 1 to 30, separated by commas."

try:
    import selenium  # noqa: F401

    SELENIUM = True
except ImportError:
    SELENIUM = False


class _Fixed(Drafter):
    """Always drafts `tokens` (none: an empty draft)."""

    def __init__(self, name: str, tokens: list[int]):
        self.name, self.tokens = name, tokens

    def propose(self, seq, max_tokens, min_path_prob=0.0) -> Draft:
        return Draft(self.tokens[:max_tokens])


def test_chain_drafts_name_the_member_that_drafted_them():
    seq = Sequence([1, 2, 3], 3, 0, SamplingParams())
    for mode in ("first", "gain"):
        chain = ChainDrafter([_Fixed("empty", []), _Fixed("fixed", [4, 5])], mode)
        assert chain.propose(seq, 8).source == "fixed"


def test_step_trace_of_a_tree_rejects_the_children_where_the_path_ends():
    """Nodes 0 and 1 are siblings, node 2 continues node 0; the target takes node 0, then a token of its own."""
    draft = Draft([5, 6, 7], parents=[-1, -1, 0])
    logits = torch.zeros(2, 10)
    logits[0, 5], logits[1, 9] = 4.0, 2.0
    first, own = step_trace(3, [5, 9], logits, [4.0, 2.0], draft, [0], "tree", ["a", "b"])
    assert (first.origin, first.drafter, first.pos, first.step) == ("draft", "tree", 1, 3)
    assert (own.origin, own.rejected, own.drafted, own.pos) == ("correction", [7], 3, 2)
    assert own.p == pytest.approx(float(logits[1].softmax(-1)[9]))
    bonus = step_trace(1, [5, 7, 8], torch.zeros(3, 10), [0.0] * 3, draft, [0, 2], "tree", ["a"] * 3)[-1]
    assert (bonus.origin, bonus.rejected) == ("bonus", [])
    assert step_trace(0, [8], torch.zeros(1, 10), [0.0], None, [], None, [""])[0].origin == "target"


def _events(url: str, body: dict) -> list[dict]:
    """The data objects of one streamed completion."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_trace_extension_only_when_asked_and_consistent_with_the_stats(tiny_dir):
    """Synthetic drafts (accepted at 0.8 per position, forced) give accepted drafts, corrections and bonus tokens."""
    llm = specdec.LLM(
        str(tiny_dir("llama")),
        spec_type="synthetic",
        dtype="fp32",
        context=64,
        parallel=1,
        adaptive=False,
        progress=False,
    )
    llm.engine.stop_ids = set()  # a random model: no early end
    srv = ServerThread(create_app(llm, Scheduler(llm.engine, 1), ServerConfig("m", SamplingParams(max_tokens=16))))
    try:
        body = {"prompt": "t5 t6 t7 t8", "max_tokens": 40, "stream": True}
        plain, traced = _events(srv.url, body), _events(srv.url, {**body, "specdec_trace": True})
        whole = httpx.post(
            srv.url + "/v1/completions", json={**body, "stream": False, "specdec_trace": True}, timeout=120
        ).json()
    finally:
        srv.close()
    assert not any("specdec_trace" in e for e in plain)
    _check_trace([t for e in traced for t in e.get("specdec_trace", [])], traced[-1])
    _check_trace(whole["specdec_trace"], whole)
    assert "".join(t["text"] for t in whole["specdec_trace"]) == whole["choices"][0]["text"]  # pieces, in context


def _check_trace(trace: list[dict], final: dict) -> None:
    """A trace agrees with the answer's stats and holds every kind of origin."""
    spec = final["speculative"]
    assert len(trace) == final["timings"]["predicted_n"] == 40
    assert sum(t["origin"] == "draft" for t in trace) == spec["accepted"]
    assert sum(t["drafted"] for t in trace) == spec["drafted"]
    assert {t["origin"] for t in trace} == {"target", "draft", "correction", "bonus"}
    assert {t["drafter"] for t in trace if t["origin"] == "draft"} == {"synthetic"}
    assert trace[0]["step"] == 0 and trace[0]["origin"] == "target"
    for t in trace:
        assert 0 <= t["p"] <= 1 and t["gap"] >= 0 and (t["origin"] == "correction") == bool(t["rejected"])


def test_per_request_drafter_options(tiny_dir):
    """`speculative.options`: model-free drafters' numeric options per request (own drafter instance, output
    unchanged); a draft model's or a text option, an option of another type and a bad value are 400s."""
    llm = specdec.LLM(
        str(tiny_dir("llama")),
        spec_type="ngram-simple",
        dtype="fp32",
        context=64,
        parallel=1,
        adaptive=False,
        progress=False,
    )
    llm.engine.stop_ids = set()
    srv = ServerThread(create_app(llm, Scheduler(llm.engine, 1), ServerConfig("m", SamplingParams(max_tokens=16))))

    def post(spec):  # its answer repeats: drafts accepted
        body = {"prompt": "t8 " * 10 + "t4", "max_tokens": 24, "speculative": spec}
        return httpx.post(srv.url + "/v1/completions", timeout=60, json=body)

    try:
        plain, loose = post(False), post({"options": {"ngram_n": 1, "ngram_m": 3}})
        assert loose.status_code == 200 and loose.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert loose.json()["speculative"]["drafted"] > 0 and loose.json()["speculative"]["accepted"] > 0, loose.json()
        assert llm.drafter_for("ngram-simple", None, {"ngram_n": 1, "ngram_m": 3}).n == 1
        assert llm.drafter_for("ngram-simple").n == 3  # the server's own drafter is untouched
        for m in range(1, 41):  # a bounded number of per-request drafters is kept
            llm.drafter_for("ngram-simple", None, {"ngram_m": m})
        assert sum(1 for key in llm._drafters if key[2]) == specdec.api.OPTION_DRAFTERS
        for spec, needle in (
            ({"type": "draft", "options": {"draft_p_min": 0.5}}, "only for model-free"),
            ({"options": {"suffix_factor": 2}}, "not a per-request option of ngram-simple"),
            ({"type": "suffix", "options": {"ngram_n": 2}}, "not a per-request option of suffix"),
            ({"options": {"ngram_n": 0}}, "ngram_n must be >= 1"),
        ):
            r = post(spec)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], (spec, r.text)
    finally:
        srv.close()


@pytest.fixture(scope="module")
def server(smollm_dir):
    """SmolLM2-135M (fp32) behind an API key, one slot and no queue (so a second request gets 429)."""
    llm = specdec.LLM(
        str(smollm_dir),
        spec_type="ngram-simple,suffix",
        dtype="fp32",
        context=512,
        parallel=1,
        adaptive=False,
        progress=False,
    )  # fixed draft lengths: an adaptive one may draft nothing
    scheduler = Scheduler(llm.engine, 1, max_queue=0)
    srv = ServerThread(create_app(llm, scheduler, ServerConfig("smollm2-135m", SamplingParams(max_tokens=48), (KEY,))))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def _errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _send(driver, wait, prompt: str) -> None:
    """Type a prompt, send it and wait until the answer is done (Send enabled again)."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "prompt").send_keys(prompt)
    driver.find_element(By.ID, "send").click()
    wait.until(lambda d: not d.find_element(By.ID, "send").is_enabled())
    wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())


@pytest.mark.real
@pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="needs Chromium and chromedriver (apt-get install chromium "
    "chromium-driver; scripts/test.sh does where apt is available)",
)
@pytest.mark.skipif(not SELENIUM, reason="needs selenium (pip install selenium)")
def test_playground_streams_colours_compares_and_reports_busy(server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d, wait = browser, WebDriverWait(browser, 60)
    d.get(server.url + "/")
    d.execute_script("localStorage.setItem('specdec.key', arguments[0])", KEY)
    _errors(d)  # the first load had no key (401): only what follows counts
    d.refresh()
    wait.until(lambda d: "smollm2-135m" in d.find_element(By.ID, "model").text)
    options = [o.get_attribute("value") for o in d.find_elements(By.CSS_SELECTOR, "#drafter option")]
    assert {"server", "none", "suffix", "ngram-simple"} <= set(options)
    assert d.find_element(By.ID, "key").get_attribute("value") == KEY

    _send(d, wait, PROMPT)
    assert not d.find_element(By.ID, "error").is_displayed()
    tokens = d.find_elements(By.CSS_SELECTOR, "#messages .answer .tok")
    assert len(tokens) > 10 and d.find_elements(By.CSS_SELECTOR, ".tok.draft")  # accepted drafts are coloured
    for stat in ("stat-tps", "stat-acc", "stat-mal", "stat-dps"):
        assert d.find_element(By.ID, stat).text not in ("", "-"), stat
    assert d.execute_script(
        "const c = document.getElementById('chart'); return c.getContext('2d')"
        ".getImageData(30, 0, c.width - 30, c.height - 17).data.some((v, i) => i % 4 == 3 && v)"
    )

    d.find_element(By.ID, "compare").click()
    _send(d, wait, "Write them again, in the same way.")
    answers = d.find_elements(By.CSS_SELECTOR, ".compare .answer")
    assert len(answers) == 2 and all(a.find_elements(By.CSS_SELECTOR, ".tok") for a in answers)
    assert all("tok/s" in a.find_element(By.CSS_SELECTOR, ".speed").text for a in answers)
    assert d.find_element(By.CSS_SELECTOR, ".compare .verdict").text == "identical"  # greedy: lossless
    assert answers[1].find_elements(By.CSS_SELECTOR, ".tok.draft")  # speculation on: drafts accepted

    ActionChains(d).move_to_element(d.find_elements(By.CSS_SELECTOR, ".tok.draft")[-1]).perform()
    tip = d.find_element(By.ID, "tooltip")
    assert tip.is_displayed() and "step" in tip.text and "target p" in tip.text
    assert _errors(d) == []
    d.save_screenshot(os.environ.get("SPECDEC_PLAYGROUND_PNG") or str(tmp_path / "playground.png"))

    _drafter_options(d, wait)
    _busy_message(d, wait, server.url)


def _drafter_options(d, wait) -> None:
    """The picker's per-request options: a changed one goes out as `speculative.options` and the answer comes."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(d.find_element(By.ID, "drafter")).select_by_value("ngram-simple")
    box = d.find_element(By.CSS_SELECTOR, '.drafter-option[data-name="ngram_n"]')
    box.clear()
    box.send_keys("1")
    assert d.execute_script("return speculative(true)") == {"type": "ngram-simple", "options": {"ngram_n": 1}}
    _send(d, wait, "Once more, shorter.")
    assert not d.find_element(By.ID, "error").is_displayed()
    assert d.find_elements(By.CSS_SELECTOR, ".compare .verdict")[-1].text == "identical"
    assert d.find_elements(By.CSS_SELECTOR, ".compare .answer")[-1].find_elements(By.CSS_SELECTOR, ".tok.draft")


def _busy_message(d, wait, url: str) -> None:
    """While another request holds the only slot, the page says the server is busy."""
    from selenium.webdriver.common.by import By

    started, release = threading.Event(), threading.Event()

    def hold():
        body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 400, "stream": True}
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
        ) as r:
            for _ in r.iter_lines():
                started.set()
                if release.is_set():
                    break

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert started.wait(60)
        d.find_element(By.ID, "compare").click()  # compare off: one request
        d.find_element(By.ID, "prompt").send_keys("Hello")
        d.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "error").is_displayed())
        assert "busy (429)" in d.find_element(By.ID, "error").text
    finally:
        release.set()
        holder.join(60)
