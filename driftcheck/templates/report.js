// The report's page: the entry table, the drift chart and the module map, all from the JSON
// blocks. Text from the report (module names above all) only ever reaches the page through
// textContent, never innerHTML, and the charts' tooltips are this page's own for that reason.
// Only PAGE table rows are in the DOM at a time and the chart draws at most max_points points
// (the worst of each bin of the visible range, redrawn on zoom), so huge reports stay responsive.
(function () {
  "use strict";
  var PAGE = 500;
  var data = JSON.parse(document.getElementById("entries-data").textContent);
  var table = document.getElementById("entries-table");
  var tbody = table.tBodies[0];
  var heads = Array.prototype.slice.call(table.tHead.rows[0].cells);
  var kinds = heads.map(function (th) { return th.getAttribute("data-kind"); });
  var ids = data.columns;
  var col = {};
  ids.forEach(function (id, i) { col[id] = i; });
  var ASCENDING_FIRST = { i: 1, step: 1, call: 1, cosine: 1 };
  var ROOT = "(model)";

  function num(v) {
    if (v === null || v === undefined || v === "") return NaN;
    if (v === "inf") return Infinity;
    if (v === "-inf") return -Infinity;
    return typeof v === "number" ? v : Number(v);
  }
  function fmt(v) {
    if (v === null || v === undefined) return "\u2014";
    if (typeof v === "string") return v;
    if (Number.isInteger(v)) return String(v);
    if (v === 0) return "0";
    var a = Math.abs(v);
    if (a >= 1e4 || a < 1e-3) return v.toExponential(2).replace(/\.?0+e/, "e");
    return String(Number(v.toPrecision(3)));
  }
  function label(m) { return m === "" || m === "." || m === null || m === undefined ? ROOT : m; }
  // A dotted path as text nodes with <wbr> after each dot or underscore: it wraps there, never mid-word.
  function pathInto(el, text) {
    var parts = text.split(/(?<=[._\/])/);
    for (var k = 0; k < parts.length; k++) {
      if (k) el.appendChild(document.createElement("wbr"));
      el.appendChild(document.createTextNode(parts[k]));
    }
  }

  // The table travels columnar (report/page_data.py): per column an array, or the one value every
  // row shares; text as indices into data.strings; "i" is the row's position. One array per row
  // again, in data.columns' order.
  var TEXT = { phase: 1, module: 1, slot: 1, status: 1, rule: 1 };
  var rows = [];
  for (var k = 0; k < data.n; k++) rows.push({ r: new Array(ids.length), hay: "" });
  ids.forEach(function (id, c) {
    var v = data.data[id], many = Array.isArray(v);
    for (var k = 0; k < data.n; k++) {
      var x = id === "i" ? k : many ? v[k] : v;
      rows[k].r[c] = TEXT[id] ? data.strings[x] : x;
    }
  });
  rows.forEach(function (o) {
    var r = o.r;
    o.hay = [label(r[col.module]), r[col.slot], r[col.phase], r[col.status], r[col.rule],
      "step " + r[col.step]].join(" ").toLowerCase();
  });
  // cell: an exact (module, step, phase) from the map; hit: the row a chart click asked for
  var state = { by: col.i, dir: 1, text: "", status: "", phase: "", cell: null, hit: null, shown: PAGE };
  var view = rows;

  function compare(a, b) {
    var x = a.r[state.by], y = b.r[state.by], d;
    if (kinds[state.by] === "num") {
      x = num(x); y = num(y);
      var xn = isNaN(x), yn = isNaN(y);
      if (xn || yn) d = xn === yn ? 0 : (xn ? 1 : -1) * state.dir; // missing values go last
      else d = x < y ? -1 : x > y ? 1 : 0;
    } else {
      d = String(x).localeCompare(String(y));
    }
    return d * state.dir || a.r[col.i] - b.r[col.i];
  }

  function update() {
    var text = state.text, cell = state.cell;
    view = rows.filter(function (o) {
      var r = o.r;
      return (!state.status || r[col.status] === state.status) &&
        (!state.phase || r[col.phase] === state.phase) &&
        (!cell || (r[col.module] === cell.module && r[col.step] === cell.step && r[col.phase] === cell.phase)) &&
        (!text || o.hay.indexOf(text) !== -1);
    });
    view.sort(compare);
    draw();
  }

  function draw() {
    var frag = document.createDocumentFragment();
    var n = Math.min(state.shown, view.length);
    for (var k = 0; k < n; k++) {
      var r = view[k].r;
      var tr = document.createElement("tr");
      tr.className = "row-" + r[col.status] + (r[col.i] === state.hit ? " hit" : "");
      tr.setAttribute("data-i", r[col.i]);
      for (var c = 0; c < ids.length; c++) {
        var td = document.createElement("td");
        td.className = "c-" + ids[c] + (kinds[c] === "num" ? " num" : "") + (heads[c].classList.contains("extra") ? " extra" : "");
        if (ids[c] === "status") {
          var span = document.createElement("span");
          span.className = "st st-" + r[c];
          span.textContent = r[c];
          td.appendChild(span);
        } else if (ids[c] === "module") {
          pathInto(td, label(r[c]));
        } else {
          // Cosine lives next to 1: three digits would hide every difference.
          td.textContent = ids[c] === "cosine" && typeof r[c] === "number" ? String(Number(r[c].toPrecision(6)))
            : kinds[c] === "num" ? fmt(r[c]) : r[c];
        }
        tr.appendChild(td);
      }
      frag.appendChild(tr);
    }
    tbody.textContent = "";
    tbody.appendChild(frag);
    document.getElementById("table-count").textContent =
      (view.length === rows.length ? rows.length + " entries" : view.length + " of " + rows.length + " entries match") +
      (n < view.length ? ", showing the first " + n : "");
    var more = document.getElementById("show-more");
    more.hidden = n >= view.length;
    more.textContent = "show " + Math.min(PAGE, view.length - n) + " more";
    heads.forEach(function (th, i) {
      if (i === state.by) th.setAttribute("aria-sort", state.dir > 0 ? "ascending" : "descending");
      else th.removeAttribute("aria-sort");
    });
  }

  function sortBy(i) {
    if (state.by === i) state.dir = -state.dir;
    else { state.by = i; state.dir = kinds[i] === "num" && !ASCENDING_FIRST[ids[i]] ? -1 : 1; }
    state.shown = PAGE;
    update();
  }

  function setCell(cell) {
    state.cell = cell;
    var chip = document.getElementById("cell-filter");
    chip.hidden = !cell;
    document.getElementById("cell-filter-text").textContent =
      cell ? label(cell.module) + " \u00b7 step " + cell.step + " \u00b7 " + cell.phase : "";
  }

  // The table row of entry i, shown and highlighted: filters cleared, execution order, enough
  // pages drawn to hold it.
  function reveal(i) {
    state.text = ""; state.status = ""; state.phase = ""; setCell(null);
    document.getElementById("filter").value = "";
    document.getElementById("status-filter").value = "";
    document.getElementById("phase-filter").value = "";
    state.by = col.i; state.dir = 1; state.hit = i;
    state.shown = Math.max(PAGE, Math.ceil((i + 1) / PAGE) * PAGE);
    update();
    var tr = tbody.querySelector('tr[data-i="' + i + '"]');
    if (tr) tr.scrollIntoView({ block: "center" });
  }

  function showCell(cell) {
    state.text = ""; state.status = ""; state.phase = ""; state.hit = null;
    document.getElementById("filter").value = "";
    document.getElementById("status-filter").value = "";
    document.getElementById("phase-filter").value = "";
    setCell(cell);
    state.by = col.ratio; state.dir = -1; state.shown = PAGE;
    update();
    document.getElementById("entries").scrollIntoView({ block: "start" });
  }

  heads.forEach(function (th, i) {
    th.addEventListener("click", function () { sortBy(i); });
    th.addEventListener("keydown", function (ev) {
      if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); sortBy(i); }
    });
  });
  var timer = null;
  document.getElementById("filter").addEventListener("input", function (ev) {
    clearTimeout(timer);
    var value = ev.target.value.trim().toLowerCase();
    timer = setTimeout(function () { state.text = value; state.shown = PAGE; update(); }, 80);
  });
  document.getElementById("status-filter").addEventListener("change", function (ev) {
    state.status = ev.target.value; state.shown = PAGE; update();
  });
  document.getElementById("phase-filter").addEventListener("change", function (ev) {
    state.phase = ev.target.value; state.shown = PAGE; update();
  });
  document.getElementById("show-more").addEventListener("click", function () {
    state.shown += PAGE; draw();
  });
  document.getElementById("all-columns").addEventListener("change", function (ev) {
    table.classList.toggle("folded", !ev.target.checked);
  });
  document.getElementById("cell-filter-clear").addEventListener("click", function () {
    setCell(null); state.shown = PAGE; update();
  });
  update();

  // -- tooltip -------------------------------------------------------------------------------
  var tip = document.getElementById("tooltip");
  function showTip(ev, lines) {
    tip.textContent = "";
    lines.forEach(function (pair) {
      var row = document.createElement("div");
      var k = document.createElement("span");
      k.className = "k"; k.textContent = pair[0];
      var v = document.createElement("span");
      v.className = "v"; v.textContent = pair[1];
      row.appendChild(k); row.appendChild(v);
      tip.appendChild(row);
    });
    tip.hidden = false;
    var e = ev && ev.event ? ev.event : null;
    var x = e ? e.clientX : 0, y = e ? e.clientY : 0;
    var w = tip.offsetWidth, h = tip.offsetHeight;
    tip.style.left = Math.max(4, Math.min(x + 14, window.innerWidth - w - 8)) + "px";
    tip.style.top = Math.max(4, y + 14 + h > window.innerHeight ? y - h - 10 : y + 14) + "px";
  }
  function hideTip() { tip.hidden = true; }

  if (!window.Plotly) return; // the table works without the charts
  var CONFIG = { displaylogo: false, responsive: true, scrollZoom: false,
    modeBarButtonsToRemove: ["select2d", "lasso2d", "toImage"] };

  // -- drift chart ---------------------------------------------------------------------------
  var chartEl = document.getElementById("ratio-chart");
  var judged = rows.filter(function (o) { return o.r[col.ratio] !== null; }).map(function (o) { return o.r; });
  if (chartEl && judged.length) {
    var finite = judged.map(function (r) { return num(r[col.ratio]); }).filter(function (v) { return isFinite(v) && v > 0; });
    var limits = rows.map(function (o) { return num(o.r[col.limit]); }).filter(function (v) { return isFinite(v); });
    var top = Math.max.apply(null, finite.concat(limits).concat([1])) * 3;
    var bottom = Math.max(Math.min.apply(null, finite.concat(limits.length ? [Math.min.apply(null, limits)] : [1])) / 3, 1e-4);
    var yOf = function (r) {
      var v = num(r[col.ratio]);
      return !isFinite(v) ? top : Math.max(v, bottom);
    };
    var isBad = function (r) { return !isFinite(num(r[col.ratio])); };

    var pick = function (lo, hi) {
      // the worst of each bin of [lo, hi], NaN/Inf and the first divergence always
      var inside = judged.filter(function (r) { return r[col.i] >= lo && r[col.i] <= hi; });
      var max = data.max_points;
      if (inside.length <= max) return inside;
      var size = (hi - lo + 1) / max, best = {}, keep = [];
      inside.forEach(function (r) {
        var b = Math.floor((r[col.i] - lo) / size);
        if (!(b in best) || yOf(r) > yOf(best[b])) best[b] = r;
        if (isBad(r) || r[col.i] === data.first) keep.push(r);
      });
      var chosen = Object.keys(best).map(function (b) { return best[b]; }).concat(keep);
      chosen.sort(function (a, b) { return a[col.i] - b[col.i]; });
      return chosen.filter(function (r, k) { return k === 0 || chosen[k - 1] !== r; });
    };

    var traces = function (sel) {
      var out = [{ x: rows.map(function (o) { return o.r[col.i]; }), y: rows.map(function (o) { return num(o.r[col.limit]); }),
        mode: "lines", line: { shape: "hvh", color: "#D55E00", width: 1.2 }, name: "limit", hoverinfo: "skip" }];
      Object.keys(data.colors).forEach(function (phase) {
        var pts = sel.filter(function (r) { return r[col.phase] === phase && !isBad(r); });
        if (!pts.length) return;
        out.push({ x: pts.map(function (r) { return r[col.i]; }), y: pts.map(yOf), customdata: pts.map(function (r) { return r[col.i]; }),
          mode: "markers", type: "scatter", name: phase, hoverinfo: "none",
          marker: { color: data.colors[phase], size: 6, opacity: 0.85 } });
      });
      var bad = sel.filter(isBad);
      if (bad.length) {
        out.push({ x: bad.map(function (r) { return r[col.i]; }), y: bad.map(yOf), customdata: bad.map(function (r) { return r[col.i]; }),
          mode: "markers", type: "scatter", name: "NaN/Inf", hoverinfo: "none",
          marker: { color: "#8b0000", size: 9, symbol: "x" } });
      }
      return out;
    };

    // Step bands, shaded every other step, and their labels: a few dozen at most (each shape is
    // drawn on every redraw); a long run is labelled every k-th step.
    var shapes = [], annotations = [];
    var STEP_MARKS = 24, every = Math.ceil(data.steps.length / STEP_MARKS);
    if (data.steps.length > 1) {
      data.steps.forEach(function (st, k) {
        if (k % every) return;
        var last = data.steps[Math.min(k + every - 1, data.steps.length - 1)];
        if ((k / every) % 2) shapes.push({ type: "rect", xref: "x", yref: "paper", x0: st[1] - 0.5, x1: last[2] + 0.5,
          y0: 0, y1: 1, fillcolor: "#f2f2f2", line: { width: 0 }, layer: "below" });
        annotations.push({ x: (st[1] + last[2]) / 2, y: 1, xref: "x", yref: "paper", yanchor: "bottom", showarrow: false,
          text: every > 1 ? "steps " + st[0] + "\u2013" + last[0] : "step " + st[0], font: { size: 10, color: "#666" } });
      });
    }
    if (data.first !== null) {
      shapes.push({ type: "line", xref: "x", yref: "paper", x0: data.first, x1: data.first, y0: 0, y1: 1,
        line: { color: "#c0392b", dash: "dash", width: 1 } });
    }
    var n = rows.length;
    var layout = {
      height: 340, margin: { l: 60, r: 20, t: 24, b: 44 }, hovermode: "closest", dragmode: "zoom",
      xaxis: { title: { text: "execution order (step \u2192 phase \u2192 call)" }, range: [-0.5, n - 0.5], zeroline: false },
      yaxis: { title: { text: "ratio (error / floor)" }, type: "log", range: [Math.log10(bottom / 1.6), Math.log10(top * 1.5)] },
      legend: { orientation: "h", y: -0.22 }, shapes: shapes, annotations: annotations,
      plot_bgcolor: "#fff", paper_bgcolor: "#fff", font: { family: "system-ui, sans-serif", size: 11 }
    };
    Plotly.newPlot(chartEl, traces(pick(0, n - 1)), layout, CONFIG);
    var byI = {};
    rows.forEach(function (o) { byI[o.r[col.i]] = o.r; });
    chartEl.on("plotly_hover", function (ev) {
      var p = ev.points && ev.points[0];
      if (!p || p.customdata === undefined) return;
      var r = byI[p.customdata];
      var lines = [["module", label(r[col.module])], ["phase", r[col.phase]], ["step", String(r[col.step])],
        ["slot", r[col.slot]], ["ratio", fmt(r[col.ratio])], ["floor", fmt(r[col.floor])], ["limit", fmt(r[col.limit])],
        ["status", r[col.status]]];
      if (r[col.local] !== null) lines.splice(5, 0, ["local ratio", fmt(r[col.local])]);
      showTip(ev, lines);
    });
    chartEl.on("plotly_unhover", hideTip);
    chartEl.on("plotly_click", function (ev) {
      var p = ev.points && ev.points[0];
      if (p && p.customdata !== undefined) { hideTip(); reveal(p.customdata); }
    });
    var redrawing = false;
    chartEl.on("plotly_relayout", function (ev) {
      if (redrawing) return;
      var lo = 0, hi = n - 1;
      if (ev["xaxis.range[0]"] !== undefined) { lo = Math.floor(ev["xaxis.range[0]"]); hi = Math.ceil(ev["xaxis.range[1]"]); }
      else if (ev["xaxis.range"]) { lo = Math.floor(ev["xaxis.range"][0]); hi = Math.ceil(ev["xaxis.range"][1]); }
      else if (!ev["xaxis.autorange"]) return;
      redrawing = true;
      Plotly.react(chartEl, traces(pick(lo, hi)), chartEl.layout, CONFIG).then(function () { redrawing = false; });
    });
  }

  // -- module map ----------------------------------------------------------------------------
  var mapEl = document.getElementById("module-map");
  var map = JSON.parse(document.getElementById("map-data").textContent);
  if (mapEl && map.worst.length) {
    // Each cell names its worst entry by its table index: its ratio, slot and status are read
    // from that row; its row and column are that entry's module and (step, phase).
    var mods = map.modules.map(function (s) { return data.strings[s]; });
    var cols = map.cols.map(function (c) { return [c[0], data.strings[c[1]]]; });
    var R = mods.length, C = cols.length;
    var rowOf = new Map(), colOf = new Map();
    mods.forEach(function (m, a) { rowOf.set(m, a); });
    cols.forEach(function (c, b) { colOf.set(c[0] + " " + c[1], b); });
    var z = [], info = [];
    for (var a = 0; a < R; a++) { z.push(new Array(C).fill(null)); info.push(new Array(C).fill(null)); }
    map.worst.forEach(function (w, k) {
      var r = rows[w].r, score = num(map.score[k]);
      var c = { row: rowOf.get(r[col.module]), col: colOf.get(r[col.step] + " " + r[col.phase]), r: r,
        n: Array.isArray(map.count) ? map.count[k] : map.count };
      // log10(ratio / limit), clipped to [-2, 2]: 0 is the limit
      z[c.row][c.col] = isFinite(score) ? Math.max(-2, Math.min(2, Math.log10(Math.max(score, 1e-2)))) : 2;
      info[c.row][c.col] = c;
    });
    var shortPhase = { forward: "fwd", backward: "bwd", grads: "grads", optimizer: "optim", params: "params", loss: "loss" };
    var xt = cols.map(function (c) { return (data.steps.length > 1 ? "s" + c[0] + " " : "") + (shortPhase[c[1]] || c[1]); });
    var showNames = R <= 80;
    // Plotly reads tick labels as its own markup: escape them, so a name is only ever text.
    var esc = function (t) { return t.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;"); };
    var mapLayout = {
      height: Math.max(220, Math.min(900, 40 + 15 * R)), margin: { l: showNames ? 220 : 40, r: 20, t: 10, b: 40 },
      // at most ~30 column labels: a long run has thousands of columns
      xaxis: { tickvals: xt.map(function (_, k) { return k; }).filter(function (k) { return k % Math.ceil(C / 30) === 0; }),
        ticktext: xt.filter(function (_, k) { return k % Math.ceil(C / 30) === 0; }), side: "bottom", fixedrange: false },
      yaxis: { tickvals: showNames ? map.modules.map(function (_, k) { return k; }) : [],
        ticktext: showNames ? mods.map(function (m) { m = label(m); return esc(m.length > 36 ? "\u2026" + m.slice(-35) : m); }) : [],
        autorange: "reversed", showticklabels: showNames },
      plot_bgcolor: "#fff", paper_bgcolor: "#fff", font: { family: "system-ui, sans-serif", size: 10.5 }
    };
    Plotly.newPlot(mapEl, [{
      type: "heatmap", z: z, zmin: -2, zmax: 2, hoverinfo: "none", xgap: 1, ygap: showNames ? 1 : 0,
      colorscale: [[0, "#1a7f37"], [0.35, "#9fd4a8"], [0.5, "#f5e663"], [0.6, "#f08c5a"], [1, "#8b0000"]],
      colorbar: { title: { text: "ratio / limit", side: "right" }, tickvals: [-2, -1, 0, 1, 2], ticktext: ["0.01", "0.1", "1", "10", "\u2265100"], thickness: 12 }
    }], mapLayout, CONFIG);
    mapEl.on("plotly_hover", function (ev) {
      var p = ev.points && ev.points[0];
      if (!p) return;
      var c = info[p.y] && info[p.y][p.x];
      if (!c) { hideTip(); return; }
      var r = c.r;
      showTip(ev, [["module", label(mods[c.row])], ["step", String(cols[c.col][0])], ["phase", cols[c.col][1]],
        ["worst ratio", fmt(r[col.ratio])], ["worst slot", r[col.slot]], ["entries", String(c.n)], ["status", r[col.status]]]);
    });
    mapEl.on("plotly_unhover", hideTip);
    mapEl.on("plotly_click", function (ev) {
      var p = ev.points && ev.points[0];
      var c = p && info[p.y] && info[p.y][p.x];
      if (!c) return;
      hideTip();
      showCell({ module: mods[c.row], step: cols[c.col][0], phase: cols[c.col][1] });
    });
  }
})();
