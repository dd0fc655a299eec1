/* Nightwatch dashboard: one WebSocket per page, sections swapped in as the server renders them,
 * the loss / gradient-norm chart drawn by uPlot, and the confirm-with-a-reason dialog of actions.
 * Everything the page shows comes from the server: a snapshot on every (re)connect, then updates. */
(function () {
  "use strict";
  // The timeline folds routine checkpoint activity; the toggle sits outside the live section, so
  // a re-rendered timeline keeps the person's choice (older pages of the timeline have it too).
  const routine = document.getElementById("timeline-routine");
  if (routine) {
    routine.addEventListener("change", () => {
      document.getElementById("timeline-wrap").classList.toggle("show-routine", routine.checked);
    });
  }

  const page = document.getElementById("page");
  if (!page) return;
  const live = document.getElementById("live");
  const nw = (window.nightwatch = { socket: null, frames: 0, snapshots: 0, points: new Map(), chart: null,
                                     holdReconnect: false, markers: [] });

  // --- sections -------------------------------------------------------------------------------
  function swap(html) {
    for (const [name, fragment] of Object.entries(html || {})) {
      const el = page.querySelector(`[data-section="${name}"]`);
      if (el) { el.innerHTML = fragment; sizeBars(el); }
    }
  }

  // The page's CSP admits no inline style attribute: bar widths come as data-width (percent).
  function sizeBars(root) {
    for (const bar of root.querySelectorAll("[data-width]")) bar.style.width = `${Number(bar.dataset.width)}%`;
  }
  sizeBars(page);

  // --- chart ----------------------------------------------------------------------------------
  const chartEl = document.getElementById("chart");
  let chartMeta = { checkpoints: [], restarts: [] };

  function mergePoint(p) {
    const old = nw.points.get(p.step);
    if (!old || p.generation > old.generation) { nw.points.set(p.step, { ...p }); return; }
    if (p.generation < old.generation) return;
    const low = p.rank <= old.rank ? p : old, high = low === p ? old : p;
    nw.points.set(p.step, { step: p.step, generation: p.generation, rank: low.rank,
      loss: low.loss ?? high.loss, grad_norm: low.grad_norm ?? high.grad_norm,
      spike: old.spike || p.spike, skipped: old.skipped || p.skipped, nan: old.nan || p.nan });
  }

  function verticalLines() {
    return { hooks: { draw: [(u) => {
      const ctx = u.ctx, top = u.bbox.top, height = u.bbox.height;
      const lines = [...chartMeta.checkpoints.map((c) => [c.step, c.state === "corrupt" ? "#c5221f" : "#1a73e8", [2, 3]]),
                     ...chartMeta.restarts.map((r) => [r.step, "#b06000", []])];
      ctx.save();
      ctx.lineWidth = 1;
      for (const [step, colour, dash] of lines) {
        const x = Math.round(u.valToPos(step, "x", true));
        if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
        ctx.strokeStyle = colour; ctx.setLineDash(dash);
        ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
      }
      ctx.restore();
    }] } };
  }

  function chartData() {
    const rows = [...nw.points.values()].sort((a, b) => a.step - b.step);
    const steps = rows.map((r) => r.step), loss = rows.map((r) => r.loss), grad = rows.map((r) => r.grad_norm);
    const spike = rows.map((r) => (r.spike || r.nan ? r.loss : null));
    const skipped = rows.map((r) => (r.skipped ? (r.loss ?? 0) : null));
    return [steps, loss, grad, spike, skipped];
  }

  function drawChart() {
    renderMarkers();
    if (!chartEl || typeof uPlot === "undefined") return;
    const data = chartData();
    if (!nw.chart) {
      const width = Math.max(320, chartEl.clientWidth || 800);
      nw.chart = new uPlot({
        width, height: 280, plugins: [verticalLines()],
        scales: { x: { time: false } },
        axes: [{ label: "step" }, { label: "loss", scale: "loss" }, { label: "grad norm", scale: "grad", side: 1, grid: { show: false } }],
        series: [
          { label: "step" },
          { label: "loss", scale: "loss", stroke: "#1a73e8", width: 1.5 },
          { label: "grad norm", scale: "grad", stroke: "#7b8794", width: 1 },
          { label: "spike", scale: "loss", stroke: "#c5221f", paths: () => null, points: { show: true, size: 9, fill: "#c5221f" } },
          { label: "skipped", scale: "loss", stroke: "#b06000", paths: () => null, points: { show: true, size: 9, fill: "#fff" } },
        ],
      }, data, chartEl);
    } else {
      nw.chart.setData(data);
    }
  }

  function describeDetection(d) {
    // What the detector saw: docs/detection.md explains each rule.
    const num = (x) => (x == null ? "?" : Number(x).toPrecision(4));
    const what = { spike: "loss spike", level_shift: "level shift", divergence: "divergence" }[d.kind] || d.kind;
    let seen = "";
    if (d.kind === "spike") seen = `: score ${num(d.score)}, baseline ${num(d.baseline)}, threshold ${num(d.threshold)}`;
    else if (d.rise != null) seen = `: ${(100 * d.rise).toFixed(1)} % over the baseline` +
      (d.since_step != null ? ` since step ${d.since_step}` : "");
    return `${what} at step ${d.step} (rank ${d.rank})${seen} → ${d.action || "marker"}`;
  }

  function renderMarkers() {
    const list = document.getElementById("markers");
    if (!list) return;
    const markers = [];
    const explained = new Set();
    for (const d of chartMeta.detections || []) {
      explained.add(d.step);
      markers.push([d.kind, d.step, describeDetection(d)]);
    }
    for (const p of nw.points.values()) {
      if (p.spike && !explained.has(p.step)) markers.push(["spike", p.step, `loss spike at step ${p.step}`]);
      if (p.nan) markers.push(["nan", p.step, `non-finite loss at step ${p.step}`]);
      if (p.skipped) markers.push(["skipped", p.step, `step ${p.step} skipped`]);
    }
    for (const c of chartMeta.checkpoints) markers.push(["checkpoint", c.step, `checkpoint at step ${c.step} (${c.state})`]);
    for (const r of chartMeta.restarts) markers.push(["restart", r.step, `restart: generation ${r.generation} from step ${r.step}`]);
    markers.sort((a, b) => b[1] - a[1]);
    nw.markers = markers;
    list.replaceChildren(...markers.slice(0, 40).map(([kind, step, text]) => {
      const li = document.createElement("li");
      li.dataset.kind = kind; li.dataset.step = step; li.className = `marker marker-${kind}`; li.textContent = text;
      return li;
    }));
    const last = [...nw.points.values()].sort((a, b) => b.step - a.step)[0];
    const lastEl = document.getElementById("chart-last");
    if (last && lastEl) {
      lastEl.textContent = `step ${last.step} · loss ${last.loss == null ? "n/a" : last.loss.toFixed(4)}` +
        (last.grad_norm == null ? "" : ` · grad norm ${last.grad_norm.toFixed(3)}`);
      lastEl.dataset.step = last.step;
    }
  }

  function setChart(chart) {
    if (!chart) return;
    chartMeta = { checkpoints: chart.checkpoints || [], restarts: chart.restarts || [],
                  detections: chart.detections || [] };
    if (chart.points) { nw.points.clear(); chart.points.forEach(mergePoint); }
    drawChart();
  }

  // --- a node's telemetry (the node page): one chart per reading, a line per GPU -----------------
  // The series comes in the page as a JSON data block (not a script: the CSP runs none inline).
  function drawNodeCharts() {
    const data = document.getElementById("node-series");
    const box = document.getElementById("node-charts");
    if (!data || !box || typeof uPlot === "undefined") return;
    const series = JSON.parse(data.textContent);
    if (!series.t.length) return;
    const palette = ["#1a73e8", "#d93025", "#188038", "#f29900", "#9334e6", "#12b5cb", "#e8710a", "#5f6368"];
    const width = Math.max(320, Math.floor((box.clientWidth || 900) / 2) - 16);
    for (const metric of series.metrics) {
      const el = document.createElement("div");
      el.className = "node-chart";
      el.dataset.metric = metric.name;
      box.appendChild(el);
      new uPlot({
        title: `${metric.name} (${metric.unit})`, width, height: 200, axes: [{}, { label: metric.unit }],
        series: [{}, ...metric.values.map((_, gpu) => ({ label: `GPU ${gpu}`, stroke: palette[gpu % palette.length],
                                                         width: 1 }))],
      }, [series.t, ...metric.values], el);
    }
    nw.nodeCharts = series.metrics.length;
  }
  drawNodeCharts();

  // The nodes page's heat map is patched a node at a time: a live update carries only the blocks
  // of the nodes that changed (null: the node left the filter). A node the map does not show yet
  // (it just registered) has no place to go: a fresh snapshot draws the map again.
  nw.cellsPatched = 0;
  function patchCells(cells) {
    const map = document.getElementById("gpu-heatmap");
    if (!map) return;
    for (const [pk, html] of Object.entries(cells)) {
      const old = map.querySelector(`a.hm-node[data-pk="${pk}"]`);
      if (html === null) { if (old) old.remove(); continue; }
      if (!old) { nw.socket.send(JSON.stringify({ type: "snapshot" })); return; }
      old.outerHTML = html;
      nw.cellsPatched += 1;
    }
  }

  // --- the socket -----------------------------------------------------------------------------
  let backoff = 500;
  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}${page.dataset.ws}`);
    nw.socket = socket;
    live.dataset.state = "connecting";
    socket.onopen = () => { backoff = 500; live.dataset.state = "live"; };
    socket.onmessage = (event) => {
      const frame = JSON.parse(event.data);
      nw.frames += 1;
      if (frame.type === "snapshot") {
        nw.snapshots += 1;
        swap(frame.html);
        if (frame.chart) setChart(frame.chart);
      } else if (frame.type === "update") {
        swap(frame.html);
        if (frame.cells) patchCells(frame.cells);
        if (frame.chart) setChart({ ...frame.chart, points: null });
        if (frame.chart && frame.chart.points) frame.chart.points.forEach(mergePoint);
        if (frame.points && frame.points.length) frame.points.forEach(mergePoint);
        if (frame.chart || (frame.points && frame.points.length)) drawChart();
      }
    };
    socket.onclose = () => {
      live.dataset.state = "reconnecting";
      if (nw.socket !== socket) return;
      setTimeout(function retry() {
        if (nw.holdReconnect) { setTimeout(retry, 200); return; }
        connect();
      }, backoff);
      backoff = Math.min(backoff * 2, 5000);
    };
  }
  nw.drop = () => nw.socket && nw.socket.close();
  connect();

  // heartbeat ages tick in the browser between pushes
  setInterval(() => {
    const now = Date.now() / 1000;
    for (const el of document.querySelectorAll("[data-since]")) {
      const s = Math.max(0, now - Number(el.dataset.since));
      el.textContent = s < 60 ? `${s.toFixed(0)} s` : `${Math.floor(s / 60)} m ${String(Math.floor(s % 60)).padStart(2, "0")} s`;
    }
  }, 1000);

  // --- actions: confirm with a reason, POST with the CSRF token -----------------------------------
  const dialog = document.getElementById("confirm");
  const form = document.getElementById("confirm-form");
  const flash = document.getElementById("flash");
  let pending = null;

  function say(text, bad) {
    flash.textContent = text; flash.className = bad ? "bad show" : "show";
    clearTimeout(say.timer); say.timer = setTimeout(() => { flash.className = ""; }, 8000);
  }

  document.addEventListener("click", (event) => {
    const button = event.target.closest("button.act");
    if (!button) return;
    pending = button;
    document.getElementById("confirm-title").textContent = button.dataset.title || button.textContent;
    document.getElementById("confirm-text").textContent = button.dataset.text || "";
    document.getElementById("confirm-error").textContent = "";
    document.getElementById("confirm-reason").value = "";
    document.getElementById("confirm-force").checked = false;
    document.getElementById("confirm-force-label").hidden = !button.dataset.force;
    document.getElementById("confirm-size").hidden = !button.dataset.resize;
    if (button.dataset.resize) {
      document.getElementById("confirm-nnodes").value = button.dataset.nnodes || "";
      document.getElementById("confirm-nproc").value = button.dataset.nproc || "";
    }
    dialog.showModal();
  });
  document.getElementById("confirm-cancel").addEventListener("click", () => dialog.close());
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!pending) return;
    const body = new FormData();
    body.append("reason", document.getElementById("confirm-reason").value);
    if (pending.dataset.force && document.getElementById("confirm-force").checked) body.append("force", "1");
    if (pending.dataset.resize) {
      body.append("nnodes", document.getElementById("confirm-nnodes").value);
      body.append("nproc_per_node", document.getElementById("confirm-nproc").value);
    }
    for (const [key, value] of Object.entries(pending.dataset)) {
      if (key.startsWith("field")) body.append(key.slice(5).toLowerCase(), value);
    }
    const token = form.querySelector("input[name=csrfmiddlewaretoken]").value;
    const okButton = document.getElementById("confirm-ok");
    okButton.disabled = true;
    try {
      const response = await fetch(pending.dataset.action, { method: "POST", body, credentials: "same-origin",
                                                              headers: { "X-CSRFToken": token } });
      const answer = await response.json().catch(() => ({ detail: `HTTP ${response.status}` }));
      if (response.ok) { dialog.close(); say(answer.message || "done"); }
      else { document.getElementById("confirm-error").textContent = answer.detail || `HTTP ${response.status}`; }
    } finally {
      okButton.disabled = false;
    }
  });
})();
