// The entry table: rows come from the JSON block and are built with textContent only (never
// innerHTML), so module names are always text. Sort by clicking a header, filter by text,
// status and phase; only PAGE rows are in the DOM at a time so huge reports stay responsive.
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

  var rows = data.rows.map(function (r) {
    r[col.rule] = data.rules[r[col.rule]];
    return { r: r, hay: [r[col.module], r[col.slot], r[col.phase], r[col.status], r[col.rule], "step " + r[col.step]]
      .join(" ").toLowerCase() };
  });
  var state = { by: col.i, dir: 1, text: "", status: "", phase: "", shown: PAGE };
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
    var text = state.text;
    view = rows.filter(function (o) {
      return (!state.status || o.r[col.status] === state.status) &&
        (!state.phase || o.r[col.phase] === state.phase) &&
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
      tr.className = "row-" + r[col.status];
      for (var c = 0; c < ids.length; c++) {
        var td = document.createElement("td");
        td.className = "c-" + ids[c] + (kinds[c] === "num" ? " num" : "");
        if (ids[c] === "status") {
          var span = document.createElement("span");
          span.className = "st st-" + r[c];
          span.textContent = r[c];
          td.appendChild(span);
        } else if (ids[c] === "module") {
          td.textContent = r[c] === "" ? "(model)" : r[c];
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
  update();
})();
