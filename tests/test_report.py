"""autopar.report: the HTML strategy report, rendered in headless Chromium.

The page draws everything with its own JavaScript, so these tests load it in a real browser
(``--dump-dom``) and count what was drawn: graph nodes and edges, table rows, the memory chart,
the communication breakdown; ``#sort=<column>`` checks the table's sort. No browser is a
failure, not a skip: install Debian's ``chromium`` (.ci/run does).
"""
import dataclasses
import shutil
import subprocess
from collections import defaultdict
from html.parser import HTMLParser

import pytest

import autopar as ap
import models as m
from autopar import report

pytestmark = pytest.mark.browser


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no headless browser on PATH (chromium, chromium-browser, google-chrome): the "
                "report tests need one. Install Debian's chromium: `apt-get install -y "
                "--no-install-recommends chromium` (.ci/run does this).")


class _Dom(HTMLParser):
    """Elements as (tag, attrs), every <tr> as (attrs, cell texts, cell titles), and all text,
    from a dumped DOM."""

    def __init__(self, text):
        super().__init__()
        self.elements, self.rows, self.text, self._row, self._cell = [], [], [], None, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.elements.append((tag, a))
        if tag == "tr":
            self._row = (a, [], [])
            self.rows.append(self._row)
        elif tag == "td" and self._row is not None:
            self._cell = []
            self._row[2].append(a.get("title"))

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self._row[1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)

    def having(self, cls, tag=None):
        return [a for t, a in self.elements
                if cls in (a.get("class") or "").split() and (tag is None or t == tag)]

    def table(self, cls):
        return [(a, cells) for a, cells, _ in self.rows if a.get("class") == cls]


def _dump(strategy, tmp_path, fragment="", name="report.html") -> _Dom:
    path = tmp_path / name
    report.save(strategy, path)
    out = subprocess.run(
        [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
         "--enable-logging=stderr", "--v=0", "--dump-dom", path.as_uri() + fragment],
        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "</html>" in out.stdout, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "CONSOLE" in line]
    assert not errors, "the page's script logged errors:\n" + "\n".join(errors)
    return _Dom(out.stdout)


@pytest.fixture(scope="module")
def auto():
    return ap.plan(m.gpt_sgd_step, m.gpt_params(layers=2), m.gpt_batch(batch=8),
                   config=ap.ParallelConfig(parallel_mode="auto_parallel", device_num=4,
                                            mesh_shape=(2, 2), max_device_memory="64MB"))


@pytest.fixture(scope="module")
def pipe():
    return ap.plan(m.gpt_sgd_step, m.gpt_params(layers=4), m.gpt_batch(batch=8),
                   config=ap.ParallelConfig(parallel_mode="data_parallel", device_num=4,
                                            pipeline_stages=2, micro_batches=4,
                                            max_device_memory="64MB"))


def _edges(s) -> int:
    known = {i.name for i in s.inputs} | {o.name for o in s.ops}
    return sum(len({x for x in o.operands if x in known}) for o in s.ops)


def test_report_draws_graph_table_memory_and_comm(auto, tmp_path):
    s = auto
    dom = _dump(s, tmp_path)
    ops = dom.having("op")
    assert len(ops) == len(s.ops) and {a["data-name"] for a in ops} == {o.name for o in s.ops}
    assert len(dom.having("arg")) == len(s.inputs)
    assert len(dom.having("edge", "path")) == _edges(s) > len(s.ops) // 2
    assert len({a["fill"] for a in ops}) == len({str(o.out_layouts[0]) for o in s.ops}) > 1
    # the table: one row per operator, in graph order, cells as Strategy.table() writes them
    rows = dom.table("op-row")
    assert [a["data-name"] for a, _ in rows] == [o.name for o in s.ops]
    name, prim, shape, layout = rows[5][1][:4]
    assert (name, prim, shape) == (s.ops[5].name, s.ops[5].prim, "[1,8,32]")
    op = s.ops[5]
    assert layout == (", ".join(str(l) for l in op.in_layouts) + " -> "
                      + ", ".join(str(l) for l in op.out_layouts))
    # escaped text survives as text: sources of lambdas read "(sgd.<locals>.<lambda>)"
    assert any("<lambda>" in cells[-1] for _, cells in rows)
    # the memory timeline: a step line with a point per step, the cap and the peak
    line = dom.having("mem-line", "path")
    assert len(line) == 1 and line[0]["d"].count("V") == len(s.memory_timeline) - 1
    assert len(dom.having("mem-cap")) == 1 and len(dom.having("mem-peak")) == 1
    # communication: one row and one bar per (collective, axes), seconds times count
    want = defaultdict(float)
    for c in s.collectives:
        want[(c.kind, "(" + ",".join(c.axes) + ")")] += c.seconds * c.count * 1e6
    comm = dom.table("comm-row")
    assert len(comm) == len(want) == len(dom.having("comm-bar")) > 1
    got = {(cells[0], cells[1]): float(cells[4]) for _, cells in comm}
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 0.01 for k in want)
    assert [float(c[4]) for _, c in comm] == sorted((float(c[4]) for _, c in comm), reverse=True)


def test_report_sorts_from_url_hash(auto, tmp_path):
    s = auto
    rows = _dump(s, tmp_path, "#sort=memory").table("op-row")
    mem = [int(a["data-memory"]) for a, _ in rows]
    assert len(mem) == len(s.ops) and mem == sorted(mem, reverse=True)
    assert mem[0] == max(o.out_bytes for o in s.ops)
    rows = _dump(s, tmp_path, "#sort=compute").table("op-row")
    assert [float(a["data-compute"]) for a, _ in rows] == \
        sorted((round(o.compute_time * 1e6, 4) for o in s.ops), reverse=True)
    rows = _dump(s, tmp_path, "#sort=prim:asc").table("op-row")
    prims = [a["data-prim"] for a, _ in rows]
    assert list(dict.fromkeys(prims)) == sorted({o.prim for o in s.ops})   # ascending groups
    assert [a["data-name"] for a, _ in rows if a["data-prim"] == "add"][:3] == \
        [o.name for o in s.ops if o.prim == "add"][:3]                   # add.2 before add.10


def test_report_pipeline_draws_stage_bars(pipe, tmp_path):
    s = pipe
    assert len(s.stages) == 2 and not s.memory_timeline
    dom = _dump(s, tmp_path)
    assert len(dom.having("op")) == len(dom.table("op-row")) == len(s.ops) > 1000
    assert len(dom.having("edge", "path")) == _edges(s)
    assert len(dom.having("stage-line", "div")) == 2
    assert len(dom.having("stage-bar", "rect")) == 2 and len(dom.having("mem-cap")) == 1
    assert not dom.having("mem-line")
    assert {cells[4] for _, cells in dom.table("op-row")} == {"0", "1"}
    assert {"send", "recv"} <= {cells[0] for _, cells in dom.table("comm-row")}


def test_report_escapes_text(auto, tmp_path):
    nasty = '</script><script>document.title="pwned"</script><b>&amp; <lambda>'
    ops = (dataclasses.replace(auto.ops[0], source=nasty),) + auto.ops[1:]
    s = dataclasses.replace(auto, ops=ops, peak_op=nasty)
    page = report.render(s)
    assert page.count("<script") == 2 and nasty not in page
    dom = _dump(s, tmp_path)
    assert sum(t == "script" for t, _ in dom.elements) == 2
    assert len(dom.table("op-row")) == len(s.ops)          # the data parsed, the script ran
    first = next(r for r in dom.rows if r[0].get("data-name") == s.ops[0].name)
    assert first[2][-1] == nasty                          # the source cell's title, as text
    assert nasty in "".join(dom.text)                     # the header's peak operator, as text
