// ftrun report: draws the run from the page's ftrun-data element (inlined by
// ftrun.status.run_report; plain DOM and SVG, no library, no network).
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("ftrun-data").textContent);
  var root = document.getElementById("report");
  var NS = "http://www.w3.org/2000/svg";
  var STATE_COLOURS = {starting: "#9ecae1", training: "#31a354", healing: "#c994c7", away: "#fd8d3c",
                       hung: "#de2d26", spare: "#e5f5e0", gone: "#bdbdbd", done: "#3182bd"};
  var CAUSES = [["productive", "committed steps", "#31a354"], ["startup", "start-up", "#9ecae1"],
                ["failures", "failures", "#fd8d3c"], ["hangs", "hangs", "#de2d26"],
                ["checkpoints", "checkpoints", "#6a51a3"], ["waiting", "waiting", "#fdd835"],
                ["output", "output waits", "#a1887f"], ["end", "the run's end", "#8c96a8"]];
  var run = D.run, nodes = D.nodes;
  var t0 = run.started, t1 = Math.max(run.ended || t0 + 1, t0 + 1);
  var notBack = run.ended ? "never back" : "not back yet";  // a failure whose replica has not stepped again

  function el(tag, attrs, parent, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function sv(tag, attrs, parent, text) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function secs(s) {
    if (s === null || s === undefined) return "-";
    if (s < 10) return s.toFixed(2) + " s";
    if (s < 600) return s.toFixed(1) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function tick(s) {  // an axis label: whole units where the step allows
    if (s < 600) return (Math.round(s * 10) / 10) + " s";
    if (s < 7200) return (Math.round(s / 6) / 10) + " min";
    return (Math.round(s / 360) / 10) + " h";
  }
  function when(t) { return new Date(t * 1000).toLocaleString(); }

  // ------------------------------------------------------------ header and breakdown
  var books = {replica_s: 0, spare_s: 0, productive_s: 0, lost_s: {}, steps_taken: 0, steps_lost: 0};
  nodes.forEach(function (n) {
    books.replica_s += n.replica_s || 0;
    books.spare_s += n.spare_s || 0;  // --spares: hot spares' wait, apart from the replica-time
    books.productive_s += n.productive_s || 0;
    books.steps_taken = Math.max(books.steps_taken, n.steps_taken || 0);
    books.steps_lost += n.steps_lost || 0;
    for (var c in n.lost_s || {}) books.lost_s[c] = (books.lost_s[c] || 0) + n.lost_s[c];
  });
  var goodput = books.replica_s > 0 ? books.productive_s / books.replica_s : null;
  var lanes = [];
  nodes.forEach(function (n) { n.lanes.forEach(function (l) { lanes.push({node: n.node_rank, lane: l}); }); });
  var failures = [];
  nodes.forEach(function (n) { (n.failures || []).forEach(function (f) { failures.push(f); }); });
  failures.sort(function (a, b) { return a.time - b.time; });

  el("h1", {}, root, "ftrun report: " + run.run_id);
  var argv = run.argv || [];
  var idx = argv.indexOf(run.script);
  el("div", {"class": "sub mono"}, root, (idx >= 0 ? argv.slice(idx) : [run.script]).join(" "));
  var last = nodes[nodes.length - 1];
  el("div", {"class": "sub"}, root, when(t0) + " \u2013 " + when(t1) + " (" + secs(t1 - t0) + "); " +
     lanes.length + " replica" + (lanes.length === 1 ? "" : "s") + (run.nnodes > 1 ? " on " + run.nnodes + " nodes" : "") +
     "; " + (run.policy || "") + (last.exit_summary ? "; exit " + last.exit_code + ": " + last.exit_summary : ""));

  var card = el("div", {"class": "card", id: "breakdown"}, root);
  var top = el("div", {"class": "summary"}, card);
  var big = el("div", {"class": "big", id: "goodput"}, top, goodput === null ? "-" : (100 * goodput).toFixed(1) + "%");
  el("small", {}, big, "goodput");
  var bar = el("div", {"class": "bar", title: "replica-time by where it went"}, top);
  var rows = CAUSES.map(function (c) {
    var v = c[0] === "productive" ? books.productive_s : (books.lost_s[c[0]] || 0);
    return [c[0], c[1], c[2], v];
  });
  rows.forEach(function (r) {
    if (r[3] <= 0 || books.replica_s <= 0) return;
    var d = el("div", {style: "width:" + (100 * r[3] / books.replica_s) + "%;background:" + r[2]}, bar);
    d.title = r[1] + ": " + secs(r[3]) + " (" + (100 * r[3] / books.replica_s).toFixed(1) + "%)";
  });
  var tbl = el("table", {style: "margin-top:10px"}, card);
  var hr = el("tr", {}, tbl);
  ["where the replica-time went", "replica-seconds", "share"].forEach(function (h, i) {
    el("th", {"class": i ? "num" : ""}, hr, h);
  });
  rows.forEach(function (r) {
    var tr = el("tr", {"class": "cause", "data-cause": r[0]}, tbl);
    var td = el("td", {}, tr);
    el("span", {"class": "swatch", style: "background:" + r[2]}, td);
    td.appendChild(document.createTextNode(r[1]));
    el("td", {"class": "num"}, tr, r[3].toFixed(1));
    el("td", {"class": "num"}, tr, books.replica_s > 0 ? (100 * r[3] / books.replica_s).toFixed(1) + "%" : "-");
  });
  var tot = el("tr", {}, tbl);
  var wall = (books.replica_s + books.spare_s) / Math.max(1, lanes.length);
  el("td", {}, tot, "the run's replica-time (" + lanes.length + " \u00d7 " + secs(wall) +
     (books.spare_s > 0 ? ", less the hot spares' wait" : "") + ")");
  el("td", {"class": "num"}, tot, books.replica_s.toFixed(1));
  el("td", {"class": "num"}, tot, "100%");
  if (books.spare_s > 0) {  // not replica-time: a spare trains nothing and is not counted in the goodput
    var sp = el("tr", {"class": "cause", "data-cause": "spare"}, tbl);
    var std = el("td", {}, sp);
    el("span", {"class": "swatch", style: "background:" + STATE_COLOURS.spare}, std);
    std.appendChild(document.createTextNode("apart: hot spares waiting"));
    el("td", {"class": "num"}, sp, books.spare_s.toFixed(1));
    el("td", {"class": "num"}, sp, "-");
  }
  el("div", {"class": "sub", style: "margin-top:6px"}, card, books.steps_taken + " steps taken" +
     (books.steps_lost ? ", " + books.steps_lost + " discarded or redone" : "") + "; " +
     failures.length + " failure" + (failures.length === 1 ? "" : "s"));

  // ------------------------------------------------------------ lanes
  el("h2", {}, root, "Replicas over time");
  var lcard = el("div", {"class": "card"}, root);
  var legend = el("div", {"class": "legend"}, lcard);
  Object.keys(STATE_COLOURS).forEach(function (s) {
    var item = el("span", {}, legend);
    el("span", {"class": "swatch", style: "background:" + STATE_COLOURS[s]}, item);
    item.appendChild(document.createTextNode(s));
  });
  var li = el("span", {}, legend);
  el("span", {"class": "swatch", style: "background:#c4161c"}, li);
  li.appendChild(document.createTextNode("failure"));
  var lc = el("span", {}, legend);
  el("span", {"class": "swatch", style: "background:#6a51a3"}, lc);
  lc.appendChild(document.createTextNode("checkpoint"));

  var W = 1100, LEFT = 150, RIGHT = 16, ROW = 24, AX = 26;
  var plotW = W - LEFT - RIGHT;
  function x(t) { return LEFT + plotW * Math.min(1, Math.max(0, (t - t0) / (t1 - t0))); }
  var H = AX + lanes.length * ROW + 8;
  var svg = sv("svg", {id: "lanes", width: W, height: H, viewBox: "0 0 " + W + " " + H}, lcard);
  function axis(g, y0, y1) {
    var step = niceStep((t1 - t0) / 10);
    for (var s = 0; s <= t1 - t0 + 1e-9; s += step) {
      sv("line", {x1: x(t0 + s), x2: x(t0 + s), y1: y0, y2: y1}, g);
      sv("text", {x: x(t0 + s), y: y0 - 6, "text-anchor": "middle"}, g, tick(s));
    }
  }
  function niceStep(raw) {
    var p = Math.pow(10, Math.floor(Math.log10(Math.max(raw, 1e-3))));
    var m = raw / p;
    return p * (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10);
  }
  axis(sv("g", {"class": "grid"}, svg), AX, H - 4);
  var rowOf = {};
  lanes.forEach(function (item, i) {
    var l = item.lane, y = AX + i * ROW;
    rowOf[item.node + ":" + l.replica] = y;
    var g = sv("g", {"class": "lane", "data-replica": l.replica, "data-node": item.node}, svg);
    var ranks = l.ranks.length > 1 ? "ranks " + l.ranks[0] + "-" + l.ranks[l.ranks.length - 1] : "rank " + l.ranks[0];
    sv("text", {x: 4, y: y + ROW / 2 + 4}, g, "replica " + l.replica + " (" + ranks + ")" + (run.nnodes > 1 ? " n" + item.node : ""));
    l.segments.forEach(function (s) {
      var r = sv("rect", {"class": "seg", "data-state": s[2], x: x(s[0]), y: y + 3, height: ROW - 6,
                          width: Math.max(0.5, x(s[1]) - x(s[0])), fill: STATE_COLOURS[s[2]] || "#999"}, g);
      sv("title", {}, r, s[2] + ": " + secs(s[0] - t0) + " \u2013 " + secs(s[1] - t0) + " (" + secs(s[1] - s[0]) + ")");
    });
  });
  nodes.forEach(function (n) {
    (n.checkpoints || []).forEach(function (c) {
      var start = c.time - (c.write_s || 0);
      var line = sv("line", {"class": "checkpoint-mark", "data-step": c.step, x1: x(start), x2: x(start), y1: AX, y2: H - 4}, svg);
      sv("title", {}, line, "checkpoint of step " + c.step + ": written in " + secs(c.write_s) + ", the loop paused " + secs(c.pause_s));
    });
  });
  failures.forEach(function (f) {
    var y = rowOf[f.node_rank + ":" + f.replica];
    var y0 = y === undefined ? AX : y, y1 = y === undefined ? H - 4 : y + ROW;
    var cx = x(f.time);
    sv("line", {"class": "failure-line", x1: cx, x2: cx, y1: y0, y2: y1}, svg);
    var m = sv("path", {"class": "failure-mark", "data-rank": f.rank, "data-kind": f.kind,
                        d: "M" + cx + " " + (y0 + 2) + " l6 9 l-12 0 z"}, svg);
    sv("title", {}, m, "rank " + f.rank + " " + f.cause + " at " + secs(f.time - t0) + "; detected in " + secs(f.detect_s) +
       "; " + (f.back_s === null ? notBack : "back in " + secs(f.back_s)) + "; cost " + secs(f.lost_s) + " of replica-time" +
       (f.lost_steps ? ", " + f.lost_steps + " steps redone" : ""));
  });

  // ------------------------------------------------------------ committed steps per second
  el("h2", {}, root, "Committed steps per second");
  var rcard = el("div", {"class": "card"}, root);
  var pts = [];
  var series = nodes.reduce(function (best, n) { return (n.steps || []).length > best.length ? n.steps : best; }, []);
  for (var i = 1; i < series.length; i++) {
    var dt = series[i][0] - series[i - 1][0];
    if (dt > 0) pts.push([(series[i][0] + series[i - 1][0]) / 2, Math.max(0, series[i][1] - series[i - 1][1]) / dt]);
  }
  var RH = 170, rtop = 14, rbottom = RH - 24;
  var rsvg = sv("svg", {id: "rate", width: W, height: RH, viewBox: "0 0 " + W + " " + RH}, rcard);
  var ymax = Math.max.apply(null, [1e-9].concat(pts.map(function (p) { return p[1]; })));
  var ystep = niceStep(ymax / 4);
  ymax = Math.ceil(ymax / ystep) * ystep;
  function y(v) { return rbottom - (rbottom - rtop) * v / ymax; }
  var grid = sv("g", {"class": "grid"}, rsvg);
  for (var v = 0; v <= ymax + 1e-9; v += ystep) {
    sv("line", {x1: LEFT, x2: W - RIGHT, y1: y(v), y2: y(v)}, grid);
    sv("text", {x: LEFT - 8, y: y(v) + 4, "text-anchor": "end"}, grid, v >= 10 ? v.toFixed(0) : v.toFixed(1));
  }
  var step = niceStep((t1 - t0) / 10);
  for (var s = 0; s <= t1 - t0 + 1e-9; s += step) sv("text", {x: x(t0 + s), y: RH - 6, "text-anchor": "middle"}, grid, tick(s));
  if (pts.length) {
    var d = pts.map(function (p, i) { return (i ? "L" : "M") + x(p[0]).toFixed(1) + " " + y(p[1]).toFixed(1); }).join(" ");
    sv("path", {id: "rate-area", d: d + " L" + x(pts[pts.length - 1][0]).toFixed(1) + " " + rbottom + " L" + x(pts[0][0]).toFixed(1) + " " + rbottom + " Z"}, rsvg);
    sv("path", {id: "rate-line", d: d}, rsvg);
  } else {
    el("div", {"class": "none"}, rcard, "no steps were committed");
  }
  failures.forEach(function (f) {
    sv("line", {"class": "failure-line", x1: x(f.time), x2: x(f.time), y1: rtop, y2: rbottom}, rsvg);
  });

  // ------------------------------------------------------------ failures and checkpoints
  el("h2", {}, root, "Failures");
  var fcard = el("div", {"class": "card", id: "failures"}, root);
  if (!failures.length) {
    el("div", {"class": "none"}, fcard, "none");
  } else {
    var ft = el("table", {}, fcard);
    var h = el("tr", {}, ft);
    ["at", "rank", "replica", "cause", "detected in", "back in", "cost (replica-s)", "steps redone"].forEach(function (c, i) {
      el("th", {"class": i >= 4 ? "num" : ""}, h, c);
    });
    failures.forEach(function (f) {
      var tr = el("tr", {"class": "failure", "data-rank": f.rank}, ft);
      el("td", {}, tr, secs(f.time - t0));
      el("td", {}, tr, f.rank >= 0 ? String(f.rank) : "-");
      el("td", {}, tr, f.replica >= 0 ? String(f.replica) : "-");
      el("td", {}, tr, f.cause);
      el("td", {"class": "num"}, tr, secs(f.detect_s));
      el("td", {"class": "num"}, tr, f.back_s === null ? notBack : secs(f.back_s));
      el("td", {"class": "num"}, tr, (f.lost_s || 0).toFixed(1));
      el("td", {"class": "num"}, tr, String(f.lost_steps || 0));
    });
  }
  el("h2", {}, root, "Checkpoints");
  var ccard = el("div", {"class": "card", id: "checkpoints"}, root);
  var cks = [];
  nodes.forEach(function (n) { (n.checkpoints || []).forEach(function (c) { cks.push(c); }); });
  if (!cks.length) {
    el("div", {"class": "none"}, ccard, "none written");
  } else {
    var ct = el("table", {}, ccard);
    var ch = el("tr", {}, ct);
    ["step", "at", "written in", "loop paused", "size"].forEach(function (c, i) { el("th", {"class": i >= 2 ? "num" : ""}, ch, c); });
    cks.forEach(function (c) {
      var tr = el("tr", {"class": "checkpoint"}, ct);
      el("td", {}, tr, String(c.step));
      el("td", {}, tr, secs(c.time - (c.write_s || 0) - t0));
      el("td", {"class": "num"}, tr, secs(c.write_s));
      el("td", {"class": "num"}, tr, secs(c.pause_s));
      el("td", {"class": "num"}, tr, c.bytes ? (c.bytes / 1048576).toFixed(1) + " MiB" : "-");
    });
  }
  el("div", {"class": "sub", style: "margin-top:18px;font-size:12px"}, root,
     "Goodput: the replica-time spent on committed steps over the run's replica-time (each replica counted from " +
     "ftrun's start to the run's end). Written by ftrun report at " + when(D.generated) + ".");
  document.body.setAttribute("data-drawn", "1");
})();
