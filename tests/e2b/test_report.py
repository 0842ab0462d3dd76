"""`clade bench --report`: a real benchmark run's report, checked as a reader would use it.

Runs `clade bench restore` and `clade bench fork` (native test guest, this host's KVM)
with --report, then: the page opens with the summary (each headline figure of report.json
with its value, its same-run baseline and its target), its date is a UTC date and time,
every plot the HTML references exists and is a whole SVG (with its PNG), every figure of
report.json appears in the page with its value, the samples behind each distribution are
all there, and Debian's chromium renders the page with every image loaded and the summary
first (screenshot kept in $CLADE_ARTIFACTS). `clade bench compare` of two runs prints a
ratio for every figure both have and draws both on the same axes.

Needs: CLADE (the clade binary), chromium + chromium-driver, selenium in the venv.
"""

import json
import os
import re
import subprocess
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from html.parser import HTMLParser
from pathlib import Path

import pytest

CLADE = os.environ.get("CLADE", "target/debug/clade")
ARTIFACTS = Path(os.environ.get("CLADE_ARTIFACTS", "target/report-screenshots"))


class Page(HTMLParser):
    """What the checks need from index.html: links, images, the figures table (rows of two
    cells) and the summary (rows of seven: scenario, figure, value, baseline, against it,
    target, result)."""

    def __init__(self):
        super().__init__()
        self.srcs, self.hrefs, self.rows, self.summary = [], [], [], []
        self._cell, self._row, self._in_td = None, None, False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.srcs.append(a["src"])
        elif tag == "a" and "href" in a:
            self.hrefs.append(a["href"])
        elif tag == "tr":
            self._row = []
        elif tag == "td":
            self._in_td, self._cell = True, ""

    def handle_endtag(self, tag):
        if tag == "td":
            self._row.append(self._cell)
            self._in_td = False
        elif tag == "tr" and self._row is not None:
            if len(self._row) == 2:
                self.rows.append(tuple(self._row))
            elif len(self._row) == 7:
                self.summary.append(tuple(self._row))
            self._row = None

    def handle_data(self, data):
        if self._in_td:
            self._cell += data


def scalars(v, path=""):
    """Every scalar leaf of a JSON value by dotted path (as the report's table lists them)."""
    join = lambda k: f"{path}.{k}" if path else str(k)  # noqa: E731
    if isinstance(v, dict):
        for k, x in v.items():
            yield from scalars(x, join(k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from scalars(x, join(i))
    else:
        yield path, v


def same(shown, value):
    if value is None:
        return shown == "null"
    if isinstance(value, bool):
        return shown == ("true" if value else "false")
    if isinstance(value, (int, float)):
        return float(shown) == float(value)
    return shown == value


def bench(report, *args):
    out = subprocess.run([CLADE, "bench", "--report", str(report), *args],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert str(report / "index.html") in out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("reports")
    runs = {
        "restore": bench(d / "restore", "restore", "-n", "30", "--baseline-n", "10"),
        "restore-b": bench(d / "restore-b", "restore", "-n", "30", "--baseline-n", "10"),
        "fork": bench(d / "fork", "fork", "-n", "4"),
    }
    return d, runs


@pytest.mark.parametrize("name", ["restore", "fork"])
def test_every_plot_and_figure_is_in_the_page(reports, name):
    d, runs = reports
    r = d / name
    html = (r / "index.html").read_text()
    page = Page()
    page.feed(html)
    assert page.srcs, "no plots"
    for src in page.srcs:
        svg = r / src
        assert svg.is_file(), src
        assert ET.parse(svg).getroot().tag.endswith("svg"), src
        png = svg.with_suffix(".png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert png.name in page.hrefs
    report = json.loads((r / "report.json").read_text())
    [section] = report["sections"]
    assert section["scenario"] == name
    # The text printed is the text in the report.
    assert section["text"].strip() in runs[name]
    shown = dict(page.rows)
    leaves = list(scalars(section["figures"]))
    assert len(leaves) > 10
    for path, value in leaves:
        assert path in shown, f"{path} not in the page"
        assert same(shown[path], value), f"{path}: page {shown[path]!r}, JSON {value!r}"
    plots = {p["name"]: p for p in section["plots"]}
    figures = section["figures"]
    if name == "restore":
        dist = plots["restore"]["series"]
        assert [len(s["us"]) for s in dist[:2]] == [30, 10]
        assert dist[1]["baseline"] and not dist[0]["baseline"]
        assert {"restore-restore-cdf.svg", "restore-restore-hist.svg",
                "restore-steps.svg", "restore-host-noise-cdf.svg"} <= set(page.srcs)
        # The samples are the ones the figures were computed from.
        us = sorted(dist[0]["us"])
        assert abs(us[14] - figures["p50_us"]) <= 0.06
        assert plots["steps"]["bars"][0][1], "no restore steps"
    else:
        children = plots["children"]["series"][0]["us"]
        assert len(children) == 4
        assert max(children) >= figures["child_p99_us"] >= min(children) - 1
        assert {"fork-children.svg", "fork-pause.svg"} <= set(page.srcs)
    # The summary comes first: before the machine, the contents and the section.
    summary = html.index('<section id="summary">')
    assert summary < html.index('<table id="machine">') < html.index(f'<section id="{name}">')
    # Each headline figure of the section is a row of it, with its value, its same-run
    # baseline and its target; the result column says met, missed or no target.
    headlines = section["headlines"]
    assert headlines and len(page.summary) == len(headlines)
    one = lambda v, unit: "-" if v is None else f"{v:.1f} {unit}"  # noqa: E731
    for row, h in zip(page.summary, headlines):
        scenario, figure, value, baseline, _, target, result = row
        assert (scenario, figure, value) == (name, h["figure"], one(h["value"], h["unit"]))
        b = h["baseline"]
        assert baseline == (f"{b['label']}: {one(b['value'], h['unit'])}" if b
                            else "none measured")
        assert (target == "none set") == (h["target"] is None)
        assert result in ("\u2713 met", "\u2717 missed", "no target", "not measured")
    first = headlines[0]
    if name == "restore":
        assert first["figure"].startswith("uffd restore")
        assert abs(first["value"] - figures["p50_us"]) <= 0.06
        assert first["baseline"]["label"] == "copy restore"
        assert abs(first["baseline"]["value"] - figures["baseline_p50_us"]) <= 0.06
    else:
        # The JSON's figures are whole microseconds.
        assert abs(first["value"] - figures["child_p50_us"]) <= 1
        assert abs(first["baseline"]["value"] - figures["baseline_child_p50_us"]) <= 1
    # Its date: a UTC date and time in the page, RFC 3339 beside the seconds in the JSON.
    made = datetime.fromtimestamp(report["created_s"], timezone.utc)
    assert report["created_rfc3339"] == made.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert made.strftime("%Y-%m-%d %H:%M:%S UTC") in html
    assert "seconds since 1970" not in html
    # Machine facts are in the page.
    assert report["machine"]["cpus"] >= 1


def test_compare_prints_every_common_figure(reports, tmp_path):
    d, _ = reports
    out = subprocess.run([CLADE, "bench", "compare", str(d / "restore"), str(d / "restore-b"),
                          "--out", str(tmp_path / "cmp"), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ratios = {r["figure"]: r for r in json.loads(out.stdout)}
    a = json.loads((d / "restore" / "report.json").read_text())["sections"][0]["figures"]
    b = json.loads((d / "restore-b" / "report.json").read_text())["sections"][0]["figures"]
    p50 = ratios["restore.p50_us"]
    assert (p50["a"], p50["b"]) == (a["p50_us"], b["p50_us"])
    numeric = [p for p, v in scalars(a) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert set(f"restore.{p}" for p in numeric) <= set(ratios)
    cdf = (tmp_path / "cmp" / "restore-restore-cdf.svg").read_text()
    assert "A: uffd restore" in cdf and "B: uffd restore" in cdf
    # Comparing with something that is not a report is a clear error.
    bad = subprocess.run([CLADE, "bench", "compare", str(d / "restore"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "report.json" in bad.stderr


def test_the_report_renders_in_chromium(reports):
    from selenium import webdriver

    d, _ = reports
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,2400",
              "--allow-file-access-from-files"):
        opts.add_argument(a)
    service = webdriver.ChromeService(executable_path="/usr/bin/chromedriver")
    drv = webdriver.Chrome(options=opts, service=service)
    try:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for name in ("restore", "fork"):
            drv.get((d / name / "index.html").as_uri())
            assert drv.title == "clade bench report"
            broken = drv.execute_script(
                "return Array.from(document.images)"
                ".filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src);")
            n = drv.execute_script("return document.images.length;")
            assert n > 0 and broken == [], broken
            # What a reader sees first: the summary's heading and its rows.
            first = drv.execute_script(
                "return document.querySelector('h2').textContent;")
            rows = drv.execute_script(
                "return document.querySelectorAll('#summary table.summary tr').length;")
            assert first == "Summary" and rows >= 2, (first, rows)
            made = drv.execute_script(
                "return document.querySelector('#machine time').textContent;")
            assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", made), made
            drv.save_screenshot(str(ARTIFACTS / f"report-{name}.png"))
    finally:
        drv.quit()
