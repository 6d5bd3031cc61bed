"""HTML report of a Strategy: one self-contained page to read a plan in a browser.

In: an ``autopar.Strategy`` (from ``autopar.plan`` / ``compile``, or ``Strategy.load``).
Out: ``render(strategy)`` returns one HTML document, inline CSS and JavaScript, no network:
a header (mode, search, mesh, estimated step time, peak memory against the cap, one line per
pipeline stage); the operator graph as SVG (layered layout computed here: longest-path layers
in graph order, barycentre order inside a layer; nodes coloured by output layout or by stage);
a sortable per-operator table (``report.html#sort=memory`` sorts on load, descending for
numbers; ``#sort=name:asc``); the per-device memory timeline against the cap (per-stage bars
for a pipeline); the communication seconds by collective kind and mesh axes, table and bars.
The data is embedded as JSON; the page's script draws everything from it.
``save(strategy, path)`` writes the page.
"""

from __future__ import annotations

import html
import json
from collections import Counter, defaultdict

from autopar.graph import type_str
from autopar.strategies.strategy import format_bytes, short_source

_DX, _DY, _PAD = 26, 14, 14  # graph layout: px between layers, between nodes of a layer, margin
_ARC = 80  # px that an edge skipping layers may dip below its ends, at most


def render(strategy) -> str:
    """The report of ``strategy`` as one HTML document (a str)."""
    s = strategy
    data = {
        "graph": _graph(s),
        "ops": [_op_row(o) for o in s.ops],
        "timeline": [[str(n), int(b)] for n, b in s.memory_timeline],
        "cap": s.memory_limit,
        "peak": s.peak_memory,
        "peakOp": s.peak_op,
        "stages": [
            {
                "index": st.index,
                "devices": list(st.devices),
                "seconds": st.seconds,
                "memory": st.memory,
            }
            for st in s.stages
        ],
        "comm": _comm(s),
    }
    blob = json.dumps(data, separators=(",", ":"))
    blob = blob.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return (
        _PAGE.replace(
            "__TITLE__",
            html.escape(f"autopar strategy: {s.mode}, mesh {'x'.join(map(str, s.mesh_shape))}"),
        )
        .replace("__HEADER__", _header(s))
        .replace("__DATA__", blob)
    )


def save(strategy, path) -> None:
    """Write ``render(strategy)`` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(strategy))


def _header(s) -> str:
    e = html.escape
    b = lambda x: f"<b>{e(x)}</b>"
    mesh = ", ".join(f"{n}={k}" for n, k in zip(s.axis_names, s.mesh_shape))
    cap = "no cap" if s.memory_limit is None else f"cap {format_bytes(s.memory_limit)}"
    lines = [
        f"mode {b(s.mode)}, search {b(s.search)}, mesh {b(f'({mesh})')}",
        f"estimated step {b(f'{s.step_time * 1e6:.1f} us')} = compute "
        f"{s.compute_time * 1e6:.1f} us"
        + (" (measured)" if s.measured_compute is not None else "")
        + f" + communication {s.comm_time * 1e6:.1f} us"
        + (f" + per call {s.overhead_time * 1e6:.1f} us" if s.overhead_time else ""),
        f"peak memory {b(format_bytes(s.peak_memory))} per device at {e(s.peak_op or '-')} ({cap})",
    ]
    if s.topology:
        lines.append(f"priced on {e(s.topology)}")
    if s.stages:
        lines.append(
            f"pipeline: {len(s.stages)} stages, {s.micro_batches} micro-batches, {e(s.scheduler)}"
        )
    out = "".join(f'<div class="hl">{x}</div>' for x in lines)
    if s.alternatives:  # why this plan: what auto_parallel compared
        us = lambda x: f"{x * 1e6:.1f}"
        chosen = ' class="chosen"'
        rows = "".join(
            f"<tr{chosen if a.chosen else ''}><td>{'&rarr; ' if a.chosen else ''}"
            f"{e(a.label)}</td><td>{us(a.seconds)}</td><td>{us(a.compute)}</td>"
            f"<td>{us(a.comm)}</td><td>{us(a.overhead)}</td>"
            f"<td>{format_bytes(a.peak_memory)}{'' if a.fits else ' (over the cap)'}</td></tr>"
            for a in s.alternatives
        )
        out += (
            '<div class="alternatives"><b>plans compared</b> (estimated us)<table>'
            "<tr><th>plan</th><th>step</th><th>compute</th><th>communication</th>"
            f"<th>per call</th><th>peak memory</th></tr>{rows}</table></div>"
        )
    for st in s.stages:
        vs = (
            ""
            if s.memory_limit is None
            else f" of {format_bytes(s.memory_limit)} ({100 * st.memory / s.memory_limit:.1f}%)"
        )
        out += (
            f'<div class="stage-line">stage {st.index}: devices {e(str(list(st.devices)))}, '
            f"{st.seconds * 1e6:.1f} us per micro-batch, peak {format_bytes(st.memory)}{vs}</div>"
        )
    return out


def _op_row(o) -> dict:
    return {
        "name": o.name,
        "prim": o.prim,
        "shape": " ".join(type_str(x, "") for x in o.out_shapes),
        "layout": ", ".join(map(str, o.in_layouts)) + " -> " + ", ".join(map(str, o.out_layouts)),
        "stage": o.stage,
        "compute": round(o.compute_time * 1e6, 4),
        "comm": round(o.comm_time * 1e6, 4),
        "memory": o.out_bytes,
        "source": short_source(o.source),
        "full": o.source,
    }


def _graph(s) -> dict:
    """Nodes (arguments first, then operators) with x/y pixel coordinates, and edges."""
    nin, ops = len(s.inputs), s.ops
    names = [i.name for i in s.inputs] + [o.name for o in ops]
    index = {n: k for k, n in enumerate(names[:nin])}
    index.update({o.name: nin + j for j, o in enumerate(ops)})  # an operator wins a name clash
    n = len(names)
    preds: list[list[int]] = [[] for _ in range(n)]  # node index -> its operands' indices
    succs: list[list[int]] = [[] for _ in range(n)]
    for j, o in enumerate(ops):
        for src in dict.fromkeys(x for x in o.operands if x in index):
            preds[nin + j].append(index[src])
            succs[index[src]].append(nin + j)
    layer, fixed = [0] * n, [k < nin for k in range(n)]  # fixed: computed from arguments only
    for j in range(nin, n):  # longest path over operators
        layer[j] = 1 + max((layer[p] for p in preds[j] if p < j), default=0)
        fixed[j] = all(fixed[p] for p in preds[j])
    for k in reversed(range(n)):  # arguments and what only they feed: just before first use
        if fixed[k] and succs[k]:
            layer[k] = min(layer[c] for c in succs[k]) - 1
    layers = defaultdict(list)
    for k in range(n):
        layers[layer[k]].append(k)
    pos = [0.0] * n
    for col in layers.values():
        for slot, k in enumerate(col):
            pos[k] = float(slot)
    for _ in range(2):  # barycentre sweeps: a node near the mean slot of its neighbours
        for L in sorted(layers):
            key = {
                k: sum(pos[p] for p in preds[k]) / len(preds[k])
                if preds[k]
                else sum(pos[c] for c in succs[k]) / len(succs[k])
                if succs[k]
                else pos[k]
                for k in layers[L]
            }
            layers[L].sort(key=key.__getitem__)
            for slot, k in enumerate(layers[L]):
                pos[k] = float(slot)
    outs = [str(o.out_layouts[0]) if o.out_layouts else "(none)" for o in ops]
    legend = [t for t, _ in Counter(outs).most_common()]
    stage_of = [min((ops[c - nin].stage for c in succs[k]), default=0) for k in range(nin)]
    nodes = [
        {
            "name": i.name,
            "kind": "arg",
            "title": f"{i.name} (argument)\n{type_str(i.shape, i.dtype)} {i.layout}",
            "lay": -1,
            "stage": stage_of[k],
        }
        for k, i in enumerate(s.inputs)
    ]
    nodes += [
        {
            "name": o.name,
            "kind": "op",
            "lay": legend.index(t),
            "stage": o.stage,
            "title": f"{o.name} ({o.prim})\n{_op_row(o)['layout']}\n{o.source}",
        }
        for o, t in zip(ops, outs)
    ]
    for k, d in enumerate(nodes):
        d["x"], d["y"] = _PAD + layer[k] * _DX, _PAD + pos[k] * _DY
    return {
        "nodes": nodes,
        "edges": [[p, c] for c in range(n) for p in preds[c]],
        "legend": legend,
        "width": 2 * _PAD + max(layers, default=0) * _DX,
        "height": 2 * _PAD + (max(map(len, layers.values()), default=1) - 1) * _DY + _ARC,
        "dx": _DX,
        "arc": _ARC,
    }


def _comm(s) -> dict:
    """Bytes and seconds (times count) summed per (kind, axes), per kind and per axes."""
    agg: dict[str, defaultdict[tuple[str, ...], list[float]]] = {
        "pairs": defaultdict(lambda: [0, 0, 0.0]),
        "kind": defaultdict(lambda: [0, 0, 0.0]),
        "axes": defaultdict(lambda: [0, 0, 0.0]),
    }
    for c in s.collectives:
        axes = "(" + ",".join(c.axes) + ")"
        for table, key in (("pairs", (c.kind, axes)), ("kind", (c.kind,)), ("axes", (axes,))):
            row = agg[table][key]
            row[0] += c.count
            row[1] += c.bytes * c.count
            row[2] += c.seconds * c.count
    return {
        t: sorted(([*k, *v] for k, v in rows.items()), key=lambda r: -r[-1])
        for t, rows in agg.items()
    }


_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 6px}h2{font-size:15px;margin:22px 0 6px}
.hl{margin:2px 0}.stage-line{margin:1px 0 1px 18px;color:#444}
.alternatives{margin:6px 0}.alternatives table{border-collapse:collapse}
.alternatives td,.alternatives th{padding:1px 8px;text-align:right}
.alternatives td:first-child,.alternatives th:first-child{text-align:left}
.alternatives tr.chosen{font-weight:bold}
.box{background:#fff;border:1px solid #ccc;overflow:auto}
#graph-box{max-height:520px}#table-box{max-height:480px}
table{border-collapse:collapse;font-size:12px}
th,td{padding:2px 8px;border-bottom:1px solid #eee;text-align:left;white-space:nowrap}
th{position:sticky;top:0;background:#eef;cursor:pointer;user-select:none}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.hit td{background:#ffd}
.legend span{display:inline-block;margin:2px 10px 2px 0}
.legend i{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px;border:1px solid #0004}
.edge{stroke:#8884;fill:none}.op,.arg{stroke:#333;stroke-width:.6;cursor:pointer}
svg text{font-size:11px;fill:#333}.controls{margin:4px 0}
</style></head><body>
<h1>autopar strategy report</h1>
__HEADER__
<h2>Operator graph</h2>
<div class="controls">colour by <label><input type="radio" name="colour" value="layout" checked> output layout</label>
<label id="by-stage"><input type="radio" name="colour" value="stage"> stage</label>
&nbsp; zoom <input id="zoom" type="range" min="0.2" max="2" step="0.1" value="1">
&nbsp; <small>squares: arguments, circles: operators; hover for details, click to find the row</small></div>
<div class="legend" id="legend"></div>
<div class="box" id="graph-box"><svg id="graph" xmlns="http://www.w3.org/2000/svg"></svg></div>
<h2>Operators</h2><small>click a header to sort</small>
<div class="box" id="table-box"><table id="ops"><thead><tr></tr></thead><tbody></tbody></table></div>
<h2 id="mem-title">Memory per device</h2><div class="box"><svg id="memory" xmlns="http://www.w3.org/2000/svg"></svg></div>
<h2>Communication by collective and mesh axes</h2>
<div id="comm-sum"></div>
<table id="comm"><thead><tr><th>collective</th><th>axes</th><th>count</th><th>bytes</th><th>seconds (us)</th><th>share</th></tr></thead><tbody></tbody></table>
<svg id="comm-chart" xmlns="http://www.w3.org/2000/svg"></svg>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent), NS = "http://www.w3.org/2000/svg";
function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function h(tag, text, parent, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  if (parent) parent.appendChild(e);
  return e;
}
function fmtB(n) {
  const u = ["B", "KB", "MB", "GB"]; let i = 0;
  while (n >= 1024 && i < 3) { n /= 1024; i++; }
  return i ? n.toFixed(1) + " " + u[i] : n + " B";
}
const colour = i => i < 0 ? "#ddd" : `hsl(${(i * 137.508 + 210) % 360},${i % 2 ? 55 : 70}%,${i % 3 ? 62 : 48}%)`;

// ---------------------------------------------------------------- graph
const G = D.graph, gs = document.getElementById("graph"), shapes = [];
function zoom(z) {
  gs.setAttribute("width", G.width * z); gs.setAttribute("height", G.height * z);
}
gs.setAttribute("viewBox", `0 0 ${G.width} ${G.height}`); zoom(1);
const eg = el("g", {}, gs), ng = el("g", {}, gs);
for (const [a, b] of G.edges) {
  const p = G.nodes[a], q = G.nodes[b], m = (p.x + q.x) / 2, dx = q.x - p.x;
  const low = Math.max(p.y, q.y) + Math.min(G.arc, dx / 12);   // long edges arc below the nodes
  el("path", {class: "edge", d: dx > 1.5 * G.dx ? `M${p.x},${p.y}C${p.x + G.dx},${low} ${q.x - G.dx},${low} ${q.x},${q.y}`
                                                : `M${p.x},${p.y}C${m},${p.y} ${m},${q.y} ${q.x},${q.y}`}, eg);
}
for (const n of G.nodes) {
  const e = n.kind === "op" ? el("circle", {class: "op", cx: n.x, cy: n.y, r: 5}, ng)
                            : el("rect", {class: "arg", x: n.x - 4.5, y: n.y - 4.5, width: 9, height: 9}, ng);
  e.setAttribute("data-name", n.name);
  el("title", {}, e, n.title);
  e.addEventListener("click", () => showRow(n.name));
  shapes.push(e);
}
function recolour(by) {
  const lg = document.getElementById("legend"); lg.textContent = "";
  G.nodes.forEach((n, i) => shapes[i].setAttribute("fill", colour(by === "stage" ? n.stage : n.lay)));
  const keys = by === "stage" ? D.stages.map(s => ["stage " + s.index, s.index]) : G.legend.map((t, i) => [t, i]);
  for (const [t, i] of keys) { const s = h("span", undefined, lg); h("i", undefined, s).style.background = colour(i); s.append(t); }
}
if (!D.stages.length) document.getElementById("by-stage").style.display = "none";
document.querySelectorAll("input[name=colour]").forEach(r => r.addEventListener("change", () => recolour(r.value)));
document.getElementById("zoom").addEventListener("input", e => zoom(+e.target.value));
recolour("layout");

// ---------------------------------------------------------------- operator table
const COLS = [["name", "name"], ["prim", "primitive"], ["shape", "output shape"], ["layout", "inputs -> output layout"],
  ["stage", "stage"], ["compute", "compute us"], ["comm", "comm us"], ["memory", "memory"], ["source", "source"]];
const TEXT = new Intl.Collator("en", {numeric: true});   // "add.2" before "add.10"
const NUM = new Set(["stage", "compute", "comm", "memory"]), tbody = document.querySelector("#ops tbody");
const rows = D.ops.map(o => {
  const tr = h("tr", undefined, undefined, "op-row");
  tr.id = "row-" + o.name;
  for (const [k] of COLS) {
    const v = k === "memory" ? fmtB(o.memory) : k === "comm" && !o.comm ? "" : String(o[k]);
    const td = h("td", v, tr, NUM.has(k) ? "num" : "");
    if (k === "source") td.title = o.full;
    tr.dataset[k] = o[k];
  }
  return [o, tr];
});
let sorted = {key: null, desc: false};
function sortBy(key, desc) {
  const num = NUM.has(key);
  if (desc === undefined) desc = sorted.key === key ? !sorted.desc : num;
  rows.sort((a, b) => { const x = a[0][key], y = b[0][key];
    const c = num ? x - y : TEXT.compare(String(x), String(y)); return desc ? -c : c; });
  sorted = {key, desc};
  for (const [, tr] of rows) tbody.appendChild(tr);
  document.querySelectorAll("#ops th").forEach(th => th.textContent = th.dataset.label + (th.dataset.key === key ? (desc ? " \u25bc" : " \u25b2") : ""));
}
const hr = document.querySelector("#ops thead tr");
for (const [k, label] of COLS) {
  const th = h("th", label, hr); th.dataset.key = k; th.dataset.label = label;
  th.addEventListener("click", () => sortBy(k));
}
for (const [, tr] of rows) tbody.appendChild(tr);
function showRow(name) {
  document.querySelectorAll("tr.hit").forEach(t => t.classList.remove("hit"));
  const tr = document.getElementById("row-" + name); if (!tr) return;
  tr.classList.add("hit"); tr.scrollIntoView({block: "center"});
}
function fromHash() {
  const m = /sort=(\w+)(?::(asc|desc))?/.exec(location.hash);
  if (m && COLS.some(c => c[0] === m[1])) sortBy(m[1], m[2] ? m[2] === "desc" : NUM.has(m[1]));
}
window.addEventListener("hashchange", fromHash); fromHash();

// ---------------------------------------------------------------- memory
const ms = document.getElementById("memory"), W = 1100, L = 70, T = 16;
function axisY(max, H) {
  for (let i = 0; i <= 4; i++) { const y = T + H - H * i / 4;
    el("line", {x1: L, x2: W - 10, y1: y, y2: y, stroke: "#eee"}, ms);
    el("text", {x: L - 4, y: y + 4, "text-anchor": "end"}, ms, fmtB(Math.round(max * i / 4))); }
}
if (D.timeline.length) {
  const H = 240, tl = D.timeline, n = tl.length, pk = Math.max(...tl.map(t => t[1]), 1);
  const capIn = D.cap && D.cap <= 3 * pk, max = capIn ? Math.max(D.cap, pk) * 1.08 : pk * 1.12;
  ms.setAttribute("width", W); ms.setAttribute("height", H + 50); axisY(max, H);
  const X = i => L + (W - L - 10) * i / Math.max(n - 1, 1), Y = b => T + H - H * b / max;
  let d = `M${X(0)},${Y(tl[0][1])}`;
  for (let i = 1; i < n; i++) d += `H${X(i)}V${Y(tl[i][1])}`;
  el("path", {class: "mem-line", d, fill: "none", stroke: "#2a6fdb", "stroke-width": 1.5}, ms);
  if (D.cap) {
    const y = capIn ? Y(D.cap) : T;
    el("line", {class: "mem-cap", x1: L, x2: W - 10, y1: y, y2: y, stroke: "#d22", "stroke-dasharray": capIn ? "" : "5 4"}, ms);
    el("text", {x: W - 12, y: y - 4, "text-anchor": "end", fill: "#d22"}, ms,
       "cap " + fmtB(D.cap) + (capIn ? "" : ` (above the chart: ${(D.cap / pk).toFixed(0)}x the peak)`));
  }
  const ip = tl.findIndex(t => t[1] === pk);
  el("circle", {class: "mem-peak", cx: X(ip), cy: Y(pk), r: 4, fill: "#d22"}, ms);
  el("text", {x: X(ip) + (ip > n / 2 ? -6 : 6), y: Y(pk) - 6, "text-anchor": ip > n / 2 ? "end" : "start"}, ms,
     `peak ${fmtB(pk)} at ${tl[ip][0]}`);
  el("text", {x: L, y: T + H + 16}, ms, "execution order \u2192 (" + n + " steps; hover for the step)");
  const guide = el("line", {y1: T, y2: T + H, stroke: "#999", visibility: "hidden"}, ms);
  const info = el("text", {x: W - 12, y: T + H + 32, "text-anchor": "end"}, ms, "");
  ms.addEventListener("mousemove", e => {
    const r = ms.getBoundingClientRect(), i = Math.round((e.clientX - r.left - L) / (W - L - 10) * (n - 1));
    if (i < 0 || i >= n) return;
    guide.setAttribute("x1", X(i)); guide.setAttribute("x2", X(i)); guide.setAttribute("visibility", "visible");
    info.textContent = `#${i} ${tl[i][0]}: ${fmtB(tl[i][1])} live`;
  });
} else if (D.stages.length) {
  document.getElementById("mem-title").textContent = "Memory per device, per pipeline stage";
  const bh = 22, H = D.stages.length * (bh + 10), pk = Math.max(...D.stages.map(s => s.memory), 1);
  const capIn = D.cap && D.cap <= 3 * pk, max = (capIn ? Math.max(D.cap, pk) : pk) * 1.05;
  const X = b => L + (W - L - 220) * b / max;
  ms.setAttribute("width", W); ms.setAttribute("height", H + 38);
  D.stages.forEach((s, i) => { const y = T + i * (bh + 10);
    el("text", {x: L - 6, y: y + 15, "text-anchor": "end"}, ms, "stage " + s.index);
    el("rect", {class: "stage-bar", x: L, y, width: X(s.memory) - L, height: bh, fill: colour(s.index)}, ms);
    el("text", {x: X(s.memory) + 6, y: y + 15}, ms, fmtB(s.memory) + (D.cap ? ` (${(100 * s.memory / D.cap).toFixed(1)}% of cap)` : ""));
  });
  if (D.cap) { const x = capIn ? X(D.cap) : W - 12;
    el("line", {class: "mem-cap", x1: x, x2: x, y1: T - 6, y2: T + H, stroke: "#d22", "stroke-dasharray": capIn ? "" : "5 4"}, ms);
    el("text", {x, y: T + H + 14, "text-anchor": "end", fill: "#d22"}, ms,
       "cap " + fmtB(D.cap) + (capIn ? "" : ` (off the chart: ${(D.cap / pk).toFixed(0)}x the largest stage)`)); }
} else { h("p", "no memory timeline recorded", ms.parentNode); }

// ---------------------------------------------------------------- communication
const C = D.comm, cb = document.querySelector("#comm tbody"), total = C.pairs.reduce((a, r) => a + r[4], 0);
const sum = document.getElementById("comm-sum");
for (const [t, i] of [["kind", "by collective"], ["axes", "by mesh axes"]])
  h("div", i + ": " + (C[t].map(r => `${r[0]} ${(r[3] * 1e6).toFixed(1)} us (${fmtB(r[2])})`).join(", ") || "none"), sum);
for (const [kind, axes, count, bytes, sec] of C.pairs) {
  const tr = h("tr", undefined, cb, "comm-row");
  for (const [v, c] of [[kind], [axes], [count, "num"], [fmtB(bytes), "num"], [(sec * 1e6).toFixed(2), "num"],
                        [(100 * sec / (total || 1)).toFixed(1) + "%", "num"]]) h("td", String(v), tr, c);
}
const cs = document.getElementById("comm-chart"), bw = 600, lw = 230, mx = Math.max(...C.pairs.map(r => r[4]), 1e-30);
cs.setAttribute("width", lw + bw + 120); cs.setAttribute("height", C.pairs.length * 20 + 10);
C.pairs.forEach(([kind, axes, , , sec], i) => {
  const y = 5 + i * 20;
  el("text", {x: lw - 6, y: y + 13, "text-anchor": "end"}, cs, `${kind} over ${axes}`);
  el("rect", {class: "comm-bar", x: lw, y, height: 15, width: Math.max(1, bw * sec / mx), fill: colour(i)}, cs);
  el("text", {x: lw + bw * sec / mx + 6, y: y + 13}, cs, (sec * 1e6).toFixed(1) + " us");
});
</script></body></html>
"""
