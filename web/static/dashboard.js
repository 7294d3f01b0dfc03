// The dashboard's own script: what the server-rendered pages gain with JavaScript.
//  * charts: each <figure class="chart"> carries its data as JSON; this draws it with uPlot (last value
//    per bucket as the line, min..max as a band) and, while the run is live, refreshes it in place from
//    the run's charts.json, so hover and zoom survive the refresh;
//  * the events tail follows the run's event stream (SSE) and appends the rows the server renders.
// Everything else that is live (status badges, header, hosts) is htmx polling its own partials.
(function () {
  "use strict";

  document.documentElement.classList.add("js");

  var COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f",
                "#7c3aed", "#475569"];
  // The split chart reuses the explorer's colours: device, host, network.
  var SPLIT_COLORS = ["#2563eb", "#f59e0b", "#10b981"];
  var MAX_EVENT_ROWS = 500;
  // Steps are whole numbers: no tick at step 2.5.
  var STEP_INCREMENTS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2.5e3, 5e3, 1e4, 2e4, 2.5e4, 5e4,
                         1e5, 2e5, 2.5e5, 5e5, 1e6, 2e6, 5e6, 1e7];
  var plots = new Map(); // figure id -> {plot, raw}

  function alpha(hex, opacity) {
    var value = parseInt(hex.slice(1), 16);
    return "rgba(" + (value >> 16) + "," + ((value >> 8) & 255) + "," + (value & 255) + "," + opacity + ")";
  }

  function formatValue(value) {
    if (value === null || value === undefined) return "–";
    var magnitude = Math.abs(value);
    if (magnitude !== 0 && (magnitude < 1e-3 || magnitude >= 1e6)) return value.toExponential(3);
    return Number(value.toPrecision(4)).toLocaleString();
  }

  function valueOf(u, value) { return formatValue(value); }

  // Lines, each with its min..max band when downsampled: data = [x, last1, (min1, max1,) last2, ...].
  // Raw points (one step per point) come without min/max, and their legend without those entries.
  function bandedLayout(chart) {
    var data = [chart.x];
    var series = [{label: "step"}];
    var bands = [];
    chart.series.forEach(function (one, index) {
      var color = COLORS[index % COLORS.length];
      var line = data.length;
      data.push(one.last);
      series.push({label: one.label, stroke: color, width: 1.5, spanGaps: true, value: valueOf});
      if (!one.min) return;
      data.push(one.min, one.max);
      series.push({label: "min", stroke: alpha(color, 0.3), width: 0.5, spanGaps: true, points: {show: false}, value: valueOf});
      series.push({label: "max", stroke: alpha(color, 0.3), width: 0.5, spanGaps: true, points: {show: false}, value: valueOf});
      bands.push({series: [line + 2, line + 1], fill: alpha(color, 0.12)});
    });
    return {data: data, series: series, bands: bands};
  }

  // Parts of a whole drawn on top of each other: cumulative sums, each filled down to the one below.
  // The legend shows each part's own value, not the running sum.
  function stackedLayout(chart, raw) {
    var data = [chart.x];
    var series = [{label: "step"}];
    var bands = [];
    var below = chart.x.map(function () { return 0; });
    chart.series.forEach(function (one, index) {
      var color = SPLIT_COLORS[index % SPLIT_COLORS.length];
      var top = one.last.map(function (value, i) {
        return value === null || below[i] === null ? null : below[i] + Math.max(0, value);
      });
      raw[index] = one.last;
      data.push(top);
      series.push({
        label: one.label, stroke: color, width: 1, fill: index === 0 ? alpha(color, 0.35) : undefined,
        points: {show: false},
        value: function (u, v, seriesIndex, dataIndex) {
          return dataIndex === null || dataIndex === undefined ? "–" : formatValue(raw[seriesIndex - 1][dataIndex]);
        },
      });
      if (index > 0) bands.push({series: [index + 1, index], fill: alpha(color, 0.35)});
      below = top;
    });
    return {data: data, series: series, bands: bands};
  }

  function layout(chart, raw) {
    return chart.stacked ? stackedLayout(chart, raw) : bandedLayout(chart);
  }

  function plotWidth(figure) {
    return Math.max(240, figure.clientWidth - 16);
  }

  function draw(figure, chart) {
    var target = figure.querySelector(".plot");
    if (!target || typeof uPlot === "undefined") return;
    var raw = [];
    var shape = layout(chart, raw);
    // Most charts run over steps; the placement page's error chart runs over time (x in Unix seconds).
    var scales = {x: {time: !!chart.time}};
    if (chart.time) shape.series[0].label = "time";
    // A stack is read from zero; an unstacked line is read best zoomed to its own range.
    if (chart.stacked) scales.y = {range: function (u, low, high) { return [0, high > 0 ? high * 1.05 : 1]; }};
    // A flat series (reward 0 for every step) would get uPlot's default 0..100; pad around its value.
    else scales.y = {range: function (u, low, high) {
      if (low === null || high === null) return [0, 1];
      if (low === high) { var pad = low !== 0 ? Math.abs(low) * 0.1 : 1; return [low - pad, high + pad]; }
      return uPlot.rangeNum(low, high, 0.1, true);
    }};
    var plot = new uPlot({
      width: plotWidth(figure), height: 200, series: shape.series, bands: shape.bands, scales: scales,
      axes: [chart.time ? {} : {label: "step", incrs: STEP_INCREMENTS}, {size: 60}], legend: {live: true},
      cursor: {drag: {x: true, y: false}},
    }, shape.data, target);
    plots.set(figure.id, {plot: plot, raw: raw});
    figure.dataset.drawnPoints = String(chart.points);
  }

  function update(figure, chart) {
    var entry = plots.get(figure.id);
    if (!entry) return draw(figure, chart);
    // The stacked layout writes each part's raw values into `raw`, which its legend reads.
    var shape = layout(chart, entry.raw);
    if (shape.series.length !== entry.plot.series.length) {
      // A series just became downsampled (its band appears): a new layout needs a new plot.
      entry.plot.destroy();
      plots.delete(figure.id);
      return draw(figure, chart);
    }
    entry.plot.setData(shape.data);
    figure.dataset.drawnPoints = String(chart.points);
  }

  function drawAll(root) {
    root.querySelectorAll("figure.chart").forEach(function (figure) {
      var script = figure.querySelector("script.chart-data");
      if (script && !plots.has(figure.id)) draw(figure, JSON.parse(script.textContent));
    });
  }

  // While the run is live, fetch fresh chart data; the answer that says the run ended is the last one.
  function followCharts(section) {
    if (section.dataset.live !== "true") return;
    var url = section.dataset.chartsUrl;
    var every = parseInt(section.dataset.pollMs, 10) || 2000;
    function poll() {
      fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}})
        .then(function (response) {
          if (!response.ok) throw new Error("charts: HTTP " + response.status);
          return response.json();
        })
        .then(function (payload) {
          payload.charts.forEach(function (chart) {
            var figure = document.getElementById("chart-" + chart.id);
            if (figure) update(figure, chart);
          });
          if (payload.terminal) section.dataset.live = "false";
          else setTimeout(poll, every);
        })
        .catch(function () { setTimeout(poll, every * 5); }); // a blip (or a restart); try again, slower
    }
    setTimeout(poll, every);
  }

  function followEvents(box) {
    if (box.dataset.live !== "true" || typeof EventSource === "undefined") return;
    var body = box.querySelector("tbody");
    var source = new EventSource(box.dataset.eventsUrl);
    source.addEventListener("log", function (message) {
      if (message.lastEventId && document.getElementById("event-" + message.lastEventId)) return; // replayed
      var pinned = box.scrollTop + box.clientHeight >= box.scrollHeight - 8;
      body.insertAdjacentHTML("beforeend", message.data);
      while (body.rows.length > MAX_EVENT_ROWS) body.deleteRow(0);
      if (pinned) box.scrollTop = box.scrollHeight;
    });
    // The run is over: close, or EventSource would reconnect and ask again.
    source.addEventListener("end", function () { source.close(); box.dataset.live = "false"; });
  }

  function resizeAll() {
    plots.forEach(function (entry, id) {
      var figure = document.getElementById(id);
      if (figure) entry.plot.setSize({width: plotWidth(figure), height: 200});
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    drawAll(document);
    document.querySelectorAll("section.charts[data-charts-url]").forEach(followCharts);
    document.querySelectorAll("[data-events-url]").forEach(function (box) {
      box.scrollTop = box.scrollHeight;
      followEvents(box);
    });
    var pending = null;
    window.addEventListener("resize", function () {
      clearTimeout(pending);
      pending = setTimeout(resizeAll, 150);
    });
  });
})();
