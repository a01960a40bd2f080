// legorl dashboard: reads the server's JSON endpoints (or, in a static export, window.LEGORL_STATIC)
// and draws every panel with plotly.js. Live mode polls api/fingerprint and refetches only on change.
"use strict";

const CFG = Object.assign({ pollMs: 2000 }, window.LEGORL_CONFIG || {});
const STATIC = window.LEGORL_STATIC || null;
const state = { runs: [], overviews: [], fpKey: null, filters: {}, open: null, updated: null, shown: 200 };

const CATEGORY_COLORS = {
  "resolved": "#2e9d5b",
  "unresolved: submitted": "#f2a541",
  "unresolved: no_submission": "#e07b39",
  "unresolved: max_turns": "#c45a2c",
  "unresolved: budget": "#a84a8a",
  "unresolved: context_overflow": "#7d4fb3",
  "unresolved: timeout": "#b0682d",
  "unresolved: harness_crash": "#8a5a44",
  "grade: empty_patch": "#b9bfcc",
  "grade: patch_apply_failed": "#8d94a5",
  "grade: test_timeout": "#6f7791",
  "not graded yet": "#dde1e8",
  "infra: rollout": "#d0413c",
  "infra: grade": "#f08a86",
};
const PALETTE = ["#3366cc", "#dc7a2c", "#2e9d5b", "#9a4fc4", "#d0413c", "#1aa3a3", "#8a6d3b", "#e377c2"];
// No toolbar: it sat over the panels' titles and a colour bar (drag still zooms, a double click resets).
const PLOT_CONFIG = { displaylogo: false, responsive: true, displayModeBar: false };

// ------------------------------------------------------------------ helpers

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "—";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toPrecision(digits);
  return String(v);
}
function pct(v) { return v === null || v === undefined ? "—" : (100 * v).toFixed(1) + "%"; }
function $(id) { return document.getElementById(id); }
function colorFor(name, names) {
  if (name === "all") return "#1d2330";
  const i = names.filter((n) => n !== "all").indexOf(name);
  return PALETTE[(i < 0 ? 0 : i) % PALETTE.length];
}
function baseLayout(extra) {
  return Object.assign({
    margin: { l: 50, r: 20, t: 36, b: 40 }, height: 300,
    font: { family: "system-ui, sans-serif", size: 12, color: "#1d2330" },
    paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
    legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom" },
    xaxis: { title: { text: "step" }, dtick: 1, gridcolor: "#eceff4", zeroline: false },
    yaxis: { gridcolor: "#eceff4", zeroline: false },
  }, extra || {});
}
function setPanel(id, ready, message) {
  const panel = $(id);
  panel.dataset.state = ready ? "ready" : "empty";
  let note = panel.querySelector(":scope > .empty-note");
  if (ready) { if (note) note.remove(); return; }
  if (!note) { note = document.createElement("p"); note.className = "empty-note"; panel.appendChild(note); }
  note.textContent = message;
}
function plot(div, traces, layout) {
  return Plotly.react(div, traces, layout, PLOT_CONFIG);
}
function table(columns, rows, opts) {
  // columns: [{key, label, num, render}], rows: array of objects
  const head = columns.map((c) => `<th class="${c.num ? "num" : ""}">${esc(c.label)}</th>`).join("");
  const body = rows.map((r, i) => {
    const cls = opts && opts.rowClass ? opts.rowClass(r) : "";
    const cells = columns.map((c) => `<td class="${c.num ? "num" : ""}">${c.render ? c.render(r[c.key], r) : esc(fmt(r[c.key]))}</td>`).join("");
    return `<tr class="${cls}" data-i="${i}">${cells}</tr>`;
  }).join("");
  return `<table><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
}

// ------------------------------------------------------------------ data access

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}
function loadScript(src) {
  return new Promise((resolve, reject) => {
    const s = document.createElement("script");
    s.src = src; s.onload = resolve; s.onerror = () => reject(new Error(`cannot load ${src}`));
    document.head.appendChild(s);
  });
}
async function loadTrial(run, row) {
  if (STATIC) {
    const name = `${run}-${row.key}`;
    if (!(window.LEGORL_TRIALS || {})[name]) await loadScript(`data/trials/${name}.js`);
    return window.LEGORL_TRIALS[name];
  }
  return getJSON(`api/trial?run=${run}&id=${encodeURIComponent(row.trial_id)}`);
}

// ------------------------------------------------------------------ panels

function renderCounts(ov) {
  const c = ov.counts;
  const steps = c.steps.length ? `${c.steps[0]}–${c.steps[c.steps.length - 1]}` : "—";
  const items = [["tasks", c.tasks], ["trials", c.trials], ["graded", c.graded], ["pending grades", c.pending_grades],
    ["infra failures", c.infra_failures], ["steps", steps]];
  $("counts").innerHTML = items.map(([k, v]) => `<div class="count" id="stat-${k.replace(/ /g, "-")}"><b>${esc(v)}</b><span>${esc(k)}</span></div>`).join("");
  $("warnings").innerHTML = ov.warnings.map((w) => `<div class="warning">⚠ ${esc(w)}</div>`).join("");
}

function renderReward(ov) {
  const names = Object.keys(ov.reward).sort();
  const traces = [];
  for (const h of names) {
    const s = ov.reward[h];
    const color = colorFor(h, names);
    traces.push({ x: s.steps, y: s.reward_mean, name: `${h} reward`, mode: "lines+markers", line: { color, width: h === "all" ? 3 : 2 },
      customdata: s.n, hovertemplate: "step %{x}: reward %{y:.3f} (n=%{customdata})<extra>" + esc(h) + "</extra>" });
    traces.push({ x: s.steps, y: s.solve_rate, name: `${h} solve rate`, mode: "lines+markers", line: { color, dash: "dot", width: h === "all" ? 3 : 2 },
      hovertemplate: "step %{x}: solved %{y:.1%}<extra>" + esc(h) + "</extra>" });
  }
  setPanel("panel-reward", traces.length > 0, "No graded trials yet.");
  plot("chart-reward", traces, baseLayout({ yaxis: { range: [0, 1.05], gridcolor: "#eceff4", title: { text: "reward / solve rate" } } }));
}

function renderOutcomes(ov) {
  const o = ov.outcomes;
  const traces = Object.entries(o.categories).map(([name, counts]) => ({
    type: "bar", name, x: o.steps, y: counts, marker: { color: CATEGORY_COLORS[name] || "#999" },
    hovertemplate: "step %{x}: %{y}<extra>" + esc(name) + "</extra>",
  }));
  setPanel("panel-outcomes", o.steps.length > 0, "No trials yet.");
  plot("chart-outcomes", traces, baseLayout({ barmode: "stack", yaxis: { title: { text: "trials" }, gridcolor: "#eceff4" } }));
}

function renderGroups(ov) {
  const g = ov.groups;
  const traces = [
    { type: "bar", name: "all solved", x: g.steps, y: g.all_solved, marker: { color: "#2e9d5b" } },
    { type: "bar", name: "all failed", x: g.steps, y: g.all_failed, marker: { color: "#9aa3b5" } },
    { type: "bar", name: "mixed (signal)", x: g.steps, y: g.mixed, marker: { color: "#3366cc" } },
    { name: "zero-variance share", x: g.steps, y: g.zero_variance_share, yaxis: "y2", mode: "lines+markers", line: { color: "#d0413c", width: 2 } },
  ];
  const m = ov.zero_variance_metric && ov.zero_variance_metric.all;
  if (m) traces.push({ name: "trainer zero_variance_share", x: m.steps, y: m.values, yaxis: "y2", mode: "lines", line: { color: "#d0413c", dash: "dot" } });
  setPanel("panel-groups", g.steps.length > 0 || !!m, "No group has two graded attempts yet.");
  plot("chart-groups", traces, baseLayout({
    barmode: "stack", margin: { l: 50, r: 50, t: 36, b: 40 },  // room for the right axis's "100%"
    yaxis: { title: { text: "groups" }, gridcolor: "#eceff4" },
    yaxis2: { overlaying: "y", side: "right", range: [0, 1.05], tickformat: ".0%", showgrid: false },
  }));
}

function smallMultiples(containerId, entries, titleOf) {
  // entries: [[key, {harness: {steps, values}}]]; one small chart per key, one line per harness.
  const container = $(containerId);
  const wanted = entries.map(([k]) => `sm-${containerId}-${k}`);
  for (const child of Array.from(container.children)) if (!wanted.includes(child.id)) child.remove();
  for (const [key, perHarness] of entries) {
    const id = `sm-${containerId}-${key}`;
    let div = $(id);
    if (!div) { div = document.createElement("div"); div.id = id; div.className = "small"; div.dataset.key = key; container.appendChild(div); }
    const names = Object.keys(perHarness).sort();
    const traces = names.map((h) => ({
      x: perHarness[h].steps, y: perHarness[h].values, name: h, mode: "lines+markers",
      line: { color: colorFor(h, names), width: h === "all" ? 2.5 : 1.5 }, marker: { size: 5 },
    }));
    plot(div, traces, baseLayout({
      height: 200, margin: { l: 46, r: 10, t: 30, b: 30 }, showlegend: false,
      title: { text: titleOf(key), font: { size: 12 }, x: 0.02, xanchor: "left" },
      xaxis: { dtick: 1, gridcolor: "#eceff4" },
    }));
  }
}

function skippedText(ov) {
  // "steps 0, 1 made no update: <why>", one sentence per reason, or "" when every step trained.
  const byWhy = {};
  for (const [step, reasons] of Object.entries(ov.skipped || {})) {
    const why = reasons.map((r) => (ov.skip_reasons || {})[r] || r).join("; ");
    (byWhy[why] = byWhy[why] || []).push(step);
  }
  return Object.entries(byWhy).map(([why, steps]) =>
    `${steps.length > 1 ? "steps" : "step"} ${steps.join(", ")} made no update: ${why}`).join(". ");
}

function renderFidelity(ov) {
  const entries = Object.entries(ov.fidelity);
  const skipped = skippedText(ov);
  setPanel("panel-fidelity", entries.length > 0, skipped ? `No fidelity figures: ${skipped}.`
    : "No train/metrics yet (fidelity figures come from the trainer).");
  const panel = $("panel-fidelity");
  let note = panel.querySelector(":scope > .skipped-note");
  if (entries.length > 0 && skipped) {
    if (!note) { note = document.createElement("p"); note.className = "skipped-note empty-note"; panel.appendChild(note); }
    note.textContent = `${skipped}.`;
  } else if (note) note.remove();
  smallMultiples("fidelity-charts", entries, (k) => k);
  for (const [k] of entries) { const d = $(`sm-fidelity-charts-${k}`); if (d) d.title = ov.fidelity_help[k] || k; }
}

function renderStaleness(ov) {
  // Stacked bars: share of each step's sampled tokens per lag; dotted lines: the trainer's ESS per lag.
  const st = ov.staleness;
  const lagColor = (lag) => PALETTE[Math.abs(Number(lag)) % PALETTE.length];
  const traces = Object.entries(st.shares).map(([lag, shares]) => ({
    type: "bar", name: `lag ${lag}`, x: st.steps, y: shares, customdata: st.tokens, marker: { color: lagColor(lag), opacity: 0.5 },
    hovertemplate: "step %{x}: %{y:.1%} of %{customdata} sampled tokens<extra>lag " + esc(lag) + "</extra>",
  }));
  for (const [lag, s] of Object.entries(st.ess)) {
    traces.push({ name: `ESS lag ${lag}`, x: s.steps, y: s.values, yaxis: "y2", mode: "lines+markers",
      line: { color: lagColor(lag), dash: "dot", width: 2 }, marker: { size: 9, line: { color: "#1d2330", width: 1.5 } }, hovertemplate: "step %{x}: ESS %{y:.3f}<extra>lag " + esc(lag) + "</extra>" });
  }
  setPanel("panel-staleness", traces.length > 0, "No call records its policy version (rollouts from before versions, or no rollouts yet).");
  plot("chart-staleness", traces, baseLayout({
    barmode: "stack", margin: { l: 60, r: 60, t: 36, b: 40 }, yaxis: { title: { text: "share of sampled tokens" }, range: [0, 1.05], tickformat: ".0%", gridcolor: "#eceff4" },
    yaxis2: { title: { text: "ESS (normalised)" }, overlaying: "y", side: "right", range: [0, 1.05], showgrid: false },
  }));
}

function renderBehaviour(ov) {
  const entries = Object.entries(ov.behaviour).filter(([, per]) => Object.values(per).some((s) => s.values.some((v) => v !== null)));
  setPanel("panel-behaviour", entries.length > 0, "No trajectories yet.");
  smallMultiples("behaviour-charts", entries, (k) => k.replace(/_/g, " "));
  for (const [k] of entries) { const d = $(`sm-behaviour-charts-${k}`); if (d) d.title = ov.behaviour_help[k] || k; }
}

function renderGrid(ov) {
  const g = ov.grid;
  // the overview sends the attempted cells only ([task, step, solve rate, attempts]); the heatmap wants rows
  const z = g.tasks.map(() => new Array(g.steps.length).fill(null));
  const text = g.tasks.map(() => new Array(g.steps.length).fill(""));
  for (const [t, s, rate, n] of g.cells) { z[t][s] = rate; text[t][s] = `n=${n}`; }
  setPanel("panel-grid", g.tasks.length > 0, "No graded trials yet.");
  const div = $("chart-grid");
  plot(div, [{
    type: "heatmap", z, x: g.steps.map(String), y: g.tasks, zmin: 0, zmax: 1, colorscale: [[0, "#d73027"], [0.5, "#fee08b"], [1, "#1a9850"]],
    text, hovertemplate: "%{y}<br>step %{x}: solved %{z:.0%} (%{text})<extra></extra>", xgap: 2, ygap: 2,
    colorbar: { tickformat: ".0%", thickness: 12 },
  }], baseLayout({
    height: Math.max(240, 60 + 26 * g.tasks.length), margin: { l: 190, r: 20, t: 10, b: 40 }, showlegend: false,
    xaxis: { title: { text: "step" }, type: "category" }, yaxis: { automargin: true, autorange: "reversed" },
  }));
  if (!div.dataset.bound) {
    div.dataset.bound = "1";
    div.on("plotly_click", (ev) => {
      const p = ev.points[0];
      state.filters = Object.assign(state.filters, { task: String(p.y), step: String(p.x) });
      syncFilters(); renderTrials(); $("panel-trials").scrollIntoView({ behavior: "smooth" });
    });
  }
}

function evalRows(report) {
  const rows = [["overall", "all", report.overall]];
  for (const [n, r] of Object.entries(report.by_harness)) rows.push(["harness", n, r]);
  for (const [n, r] of Object.entries(report.by_repo)) rows.push(["repo", n, r]);
  return rows;
}

function renderEval(ov) {
  const report = ov.eval;
  setPanel("panel-eval", !!report, "No eval/report.json in this run (legorl eval writes it).");
  if (!report) { Plotly.purge("chart-eval"); $("eval-table").innerHTML = ""; return; }
  const harnesses = Object.keys(report.by_harness);
  const traces = report.ks.map((k, i) => ({
    type: "bar", name: `pass@${k}`, x: ["overall", ...harnesses],
    y: [report.overall.pass_at[k], ...harnesses.map((h) => report.by_harness[h].pass_at[k])],
    marker: { color: PALETTE[i % PALETTE.length] }, hovertemplate: "%{x}: %{y:.1%}<extra>pass@" + k + "</extra>",
  }));
  if (report.baseline) {
    traces.push({ type: "bar", name: `baseline pass@1 (${report.baseline.run})`, x: ["overall", ...harnesses],
      y: [report.baseline.overall.pass_at["1"], ...harnesses.map((h) => (report.baseline.by_harness[h] || { pass_at: {} }).pass_at["1"])],
      marker: { color: "#b9bfcc" } });
  }
  plot("chart-eval", traces, baseLayout({ barmode: "group", height: 240, xaxis: { type: "category" },
    yaxis: { range: [0, 1.05], tickformat: ".0%", gridcolor: "#eceff4" } }));
  const cols = [{ key: "section", label: "" }, { key: "name", label: "name" }, { key: "tasks", label: "tasks", num: true },
    { key: "attempts", label: "attempts", num: true }, { key: "infra", label: "infra", num: true },
    ...report.ks.map((k) => ({ key: `p${k}`, label: `pass@${k}`, num: true, render: pct }))];
  const rows = evalRows(report).map(([section, name, r]) => {
    const row = { section, name, tasks: r.tasks, attempts: r.attempts, infra: r.infra_failures };
    for (const k of report.ks) row[`p${k}`] = r.pass_at[k];
    return row;
  });
  $("eval-table").innerHTML = `<p class="muted">steps ${esc(report.steps.join(", "))} · models ${esc(report.models.join(", ") || "—")}` +
    ` · ${report.trials} trials, ${report.infra_failures} infra failures excluded</p>` + table(cols, rows);
}

function renderCompare() {
  const traces = [];
  const rows = [];
  state.overviews.forEach((ov, i) => {
    const s = ov.reward.all;
    const name = state.runs[i].name + (i === 0 ? " (this run)" : "");
    if (s) traces.push({ x: s.steps, y: s.solve_rate, name, mode: "lines+markers", line: { color: PALETTE[i % PALETTE.length], width: 2.5 } });
    const ev = ov.eval;
    rows.push({
      run: name, trials: ov.counts.trials, infra: ov.counts.infra_failures,
      solve: s ? s.solve_rate[s.solve_rate.length - 1] : null, reward: s ? s.reward_mean[s.reward_mean.length - 1] : null,
      pass1: ev ? ev.overall.pass_at["1"] : null,
      tot: ov.behaviour.text_only_turn_share.all ? ov.behaviour.text_only_turn_share.all.values.slice(-1)[0] : null,
      sv: ov.behaviour.self_verification_rate.all ? ov.behaviour.self_verification_rate.all.values.slice(-1)[0] : null,
    });
  });
  setPanel("panel-compare", traces.length > 0, "No graded trials in any run.");
  plot("chart-compare", traces, baseLayout({ height: 240, yaxis: { range: [0, 1.05], tickformat: ".0%", gridcolor: "#eceff4" } }));
  const note = state.runs.length < 2 ? `<p class="muted">Only this run is shown; add others with <code>legorl dashboard RUN --compare OTHER</code>.</p>` : "";
  $("compare-table").innerHTML = note + table([
    { key: "run", label: "run" }, { key: "trials", label: "trials", num: true }, { key: "infra", label: "infra", num: true },
    { key: "reward", label: "reward (last step)", num: true }, { key: "solve", label: "solved (last step)", num: true, render: pct },
    { key: "pass1", label: "eval pass@1", num: true, render: pct }, { key: "tot", label: "text-only turns", num: true, render: pct },
    { key: "sv", label: "self-verifying", num: true, render: pct },
  ], rows);
}

// ------------------------------------------------------------------ trajectories

function currentRun() { return Number(state.filters.run || 0); }

function fillSelect(id, values, current, allLabel) {
  const el = $(id);
  const options = [`<option value="">${allLabel}</option>`, ...values.map((v) => `<option value="${esc(v)}">${esc(v)}</option>`)];
  el.innerHTML = options.join("");
  el.value = values.map(String).includes(String(current)) ? String(current) : "";
}

function syncFilters() {
  const runSel = $("f-run");
  runSel.innerHTML = state.runs.map((r, i) => `<option value="${i}">${esc(r.name)}</option>`).join("");
  runSel.value = String(currentRun());
  const trials = state.overviews[currentRun()].trials;
  const uniq = (key) => [...new Set(trials.map((t) => t[key]))].sort((a, b) => (a > b ? 1 : a < b ? -1 : 0));
  fillSelect("f-step", uniq("step"), state.filters.step, "all");
  fillSelect("f-harness", uniq("harness"), state.filters.harness, "all");
  fillSelect("f-category", uniq("category"), state.filters.category, "all");
  $("f-task").value = state.filters.task || "";
}

function filteredTrials() {
  const f = state.filters;
  return state.overviews[currentRun()].trials.filter((t) =>
    (!f.step || String(t.step) === f.step) && (!f.harness || t.harness === f.harness) &&
    (!f.category || t.category === f.category) && (!f.task || t.task_id.includes(f.task)));
}

function categoryTag(cat) {
  const cls = cat === "resolved" ? "good" : cat.startsWith("infra") ? "bad" : cat.startsWith("unresolved") ? "warn" : "";
  return `<span class="tag ${cls}">${esc(cat)}</span>`;
}
const yes = (v) => (v ? "✓" : "");

function renderTrials() {
  const rows = filteredTrials();
  const shown = rows.slice(0, state.shown);
  setPanel("panel-trials", state.overviews[currentRun()].trials.length > 0, "No trials yet.");
  $("trial-count").textContent = `${rows.length} trials${rows.length > shown.length ? `, first ${shown.length} shown` : ""}`;
  $("trial-table").innerHTML = table([
    { key: "step", label: "step", num: true }, { key: "harness", label: "harness" }, { key: "task_id", label: "task" },
    { key: "sample_index", label: "sample", num: true }, { key: "category", label: "outcome", render: categoryTag },
    { key: "reward", label: "reward", num: true }, { key: "turns", label: "turns", num: true },
    { key: "tool_calls", label: "tool calls", num: true }, { key: "model_tokens", label: "model tok", num: true },
    { key: "env_tokens", label: "env tok", num: true }, { key: "self_verifying", label: "self-verifies", render: yes },
    { key: "ran_tests", label: "ran tests", render: yes }, { key: "text_only", label: "text-only", render: yes },
    { key: "forks", label: "forks", num: true },
  ], shown, { rowClass: (r) => "clickable" + (state.open && state.open.trial_id === r.trial_id ? " selected" : "") });
  $("trial-table").querySelectorAll("tbody tr").forEach((tr) => {
    tr.addEventListener("click", () => openTrial(currentRun(), shown[Number(tr.dataset.i)]));
  });
}

function renderContent(text) {
  // <think>…</think> blocks are reasoning: shown apart, dimmed.
  const parts = [];
  const re = /<think>([\s\S]*?)(?:<\/think>|$)/g;
  let last = 0; let m;
  while ((m = re.exec(text)) !== null) {
    if (m.index > last) parts.push(`<pre>${esc(text.slice(last, m.index))}</pre>`);
    parts.push(`<div class="think">${esc(m[1])}</div>`);
    last = re.lastIndex;
    if (m[0].length === 0) break;
  }
  if (last < text.length) parts.push(`<pre>${esc(text.slice(last))}</pre>`);
  return parts.join("");
}

function contentText(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((p) => (p && typeof p.text === "string" ? p.text : "")).join("");
  return "";
}

function prettyArgs(raw) {
  try { return JSON.stringify(typeof raw === "string" ? JSON.parse(raw) : raw, null, 2); } catch (e) { return String(raw); }
}

function renderMessage(msg) {
  const role = msg.role || "?";
  let html = `<div class="msg ${esc(role)}"><div class="role">${esc(role)}${msg.name ? " · " + esc(msg.name) : ""}</div>`;
  const text = contentText(msg.content);
  const reasoning = msg.reasoning_content || msg.reasoning;
  if (reasoning) html += `<div class="think">${esc(reasoning)}</div>`;
  if (text) {
    html += role === "tool" && text.length > 1500
      ? `<pre>${esc(text.slice(0, 600))}</pre><details><summary>${text.length} characters: show all</summary><pre>${esc(text)}</pre></details>`
      : renderContent(text);
  }
  for (const call of msg.tool_calls || []) {
    const fn = call.function || {};
    const tags = (call.legorl_actions || []).map((a) => `<span class="tag ${esc(a)}">${esc(a)}</span>`).join("");
    html += `<div class="toolcall"><span class="name">${esc(fn.name)}</span>${tags}<pre>${esc(prettyArgs(fn.arguments))}</pre></div>`;
  }
  return html + "</div>";
}

function renderPatch(patch) {
  if (!patch) return `<p class="empty-note">No patch.</p>`;
  const lines = patch.split("\n").map((line) => {
    const cls = line.startsWith("+++") || line.startsWith("---") ? "" : line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : line.startsWith("@@") ? "hunk" : "";
    return cls ? `<span class="${cls}">${esc(line)}</span>` : esc(line) + "\n";
  });
  return `<pre class="patch" id="viewer-patch">${lines.join("")}</pre>`;
}

function kv(pairs) {
  return `<dl class="kv">${pairs.map(([k, v]) => `<dt>${esc(k)}</dt><dd>${v}</dd>`).join("")}</dl>`;
}

function renderViewer(d) {
  const b = d.behaviour;
  const flags = [
    b.self_verifying ? `<span class="tag good">self-verifying</span>` : b.edits ? `<span class="tag warn">edits without verifying</span>` : "",
    b.test_runs ? `<span class="tag test">ran tests ×${b.test_runs}</span>` : "",
    b.tool_calls === 0 && b.assistant_turns ? `<span class="tag bad">text-only</span>` : "",
    b.forks ? `<span class="tag">forks ×${b.forks}</span>` : "",
    b.parse_errors ? `<span class="tag bad">parse errors ×${b.parse_errors}</span>` : "",
    b.budget_stops ? `<span class="tag bad">budget cut-off</span>` : "",
  ].join("");
  const t = d.timings || {};
  const summary = kv([
    ["trial", esc(d.trial_id)], ["outcome", `${esc(d.outcome)} ${categoryTag(d.category)}`], ["model", esc(d.model || "—")],
    ["error", esc(d.error || "—")], ["turns", `${b.turns} (${b.tool_calls} tool calls)`],
    ["tokens", `${b.model_tokens} sampled · ${b.env_tokens} prompt/tool`],
    ["actions", `${b.edits} edits · ${b.reads} reads · ${b.test_runs} test runs`], ["behaviour", flags || "—"],
    ["time", `total ${fmt(t.total_s)} s · agent ${fmt(t.agent_s)} s · model ${fmt(t.model_s)} s · sandbox ${fmt(t.sandbox_s)} s`],
    ["cost", d.cost ? `sandboxes ${fmt(d.cost.sandbox_s)} s · engine ${fmt(d.cost.engine_s)} s · ${d.cost.prompt_tokens} prompt ` +
      `(${d.cost.cached_tokens} cached) · ${d.cost.sampled_tokens} sampled tokens · ${d.cost.retries} retries` : "—"],
    ["forks", d.fork_cost && d.fork_cost.segments ? `${d.fork_cost.segments} segments · ${d.fork_cost.segment_tokens} segment tokens ` +
      `for ${d.fork_cost.sampled_tokens} sampled (${fmt(d.fork_cost.tokens_per_sampled)}× per sampled token) · ` +
      `${fmt(d.fork_cost.shared_share === null ? null : 100 * d.fork_cost.shared_share)} % a prefix shared with an earlier segment` : "—"],
    ["made by", d.fingerprint ? esc(`${d.fingerprint.harness} ${d.fingerprint.harness_version || "?"} · config ` +
      `${d.fingerprint.harness_config || "?"} · legorl ${d.fingerprint.legorl_version || "?"} · model ${d.fingerprint.model_revision || "?"}`) : "—"],
  ]);
  const segTable = table([
    { key: "index", label: "segment", num: true }, { key: "reason", label: "reason", render: (v) => `<span class="tag ${v === "main" ? "" : "warn"}">${esc(v)}</span>` },
    { key: "parent", label: "forked from", num: true }, { key: "tokens", label: "tokens", num: true },
    { key: "model_tokens", label: "sampled", num: true }, { key: "env_tokens", label: "prompt/tool", num: true },
    { key: "turns", label: "turns", num: true }, { key: "mean_logprob", label: "mean logprob", num: true },
  ], d.segments);
  const callTable = table([
    { key: "index", label: "call", num: true }, { key: "segment", label: "seg", num: true }, { key: "api", label: "api" },
    { key: "stream", label: "stream", render: yes }, { key: "prompt_tokens", label: "prompt", num: true },
    { key: "new_prompt_tokens", label: "new prompt", num: true }, { key: "completion_tokens", label: "completion", num: true },
    { key: "mean_logprob", label: "mean lp", num: true }, { key: "min_logprob", label: "min lp", num: true },
    { key: "latency_s", label: "latency s", num: true }, { key: "finish_reason", label: "finish" },
    { key: "parse_error", label: "parse error", render: (v) => (v ? `<span class="tag bad">${esc(v)}</span>` : "") },
    { key: "budget_stop", label: "budget", render: (v) => (v ? `<span class="tag bad">${esc(v)}</span>` : "") },
  ], d.calls);
  let gradeHtml = `<p class="empty-note">Not graded yet.</p>`;
  if (d.grade) {
    const g = d.grade;
    gradeHtml = kv([["status", esc(g.status)], ["reward", esc(fmt(g.reward))], ["resolved", esc(fmt(g.resolved))],
      ["resolution", esc(g.resolution || "—")], ["apply", esc(g.apply_method || "—")], ["error", esc(g.error || "—")],
      ["dropped paths", esc((g.dropped_paths || []).join(", ") || "—")]]) +
      `<div id="viewer-tests">` + table([
        { key: "kind", label: "kind" }, { key: "name", label: "test" },
        { key: "status", label: "status", render: (v, r) => `<span class="tag ${r.passed ? "good" : "bad"}">${esc(v)}</span>` },
      ], g.tests || []) + `</div>` +
      (g.log ? `<details><summary>test log${g.log_truncated ? " (tail)" : ""}</summary><pre class="log">${esc(g.log)}</pre></details>` : "");
  }
  $("viewer").innerHTML = `
    <div class="viewer-grid">
      <div>
        <h3>Conversation</h3>
        <div class="conversation" id="viewer-conversation">${d.messages.map(renderMessage).join("") || '<p class="empty-note">No messages.</p>'}</div>
      </div>
      <div>
        <h3>Summary</h3>${summary}
        <h3>Sampled-token logprobs</h3><div id="viewer-logprobs" class="chart" style="min-height:220px"></div>
        <h3>Segments</h3><div class="table-wrap" id="viewer-segments">${segTable}</div>
        <h3>Model calls</h3><div class="table-wrap" id="viewer-calls">${callTable}</div>
        <h3>Patch</h3>${renderPatch(d.patch)}
        <h3>Grade</h3><div id="viewer-grade">${gradeHtml}</div>
      </div>
    </div>`;
  const traces = d.segments.map((s, i) => ({
    x: s.logprob_x, y: s.logprob_y, name: `segment ${s.index} (${s.reason})`, mode: "lines",
    line: { width: 1, color: PALETTE[i % PALETTE.length] }, hovertemplate: "token %{x}: %{y:.3f}<extra>segment " + s.index + "</extra>",
  }));
  const shapes = [];
  d.segments.forEach((s, i) => s.spans.forEach((sp, j) => {
    if (j % 2 === 0) shapes.push({ type: "rect", xref: "x", yref: "paper", x0: sp[0], x1: sp[1], y0: 0, y1: 1, fillcolor: PALETTE[i % PALETTE.length], opacity: 0.06, line: { width: 0 } });
  }));
  if (traces.some((tr) => tr.x.length)) {
    plot("viewer-logprobs", traces, baseLayout({ height: 220, shapes, xaxis: { title: { text: "token position in segment" }, gridcolor: "#eceff4" },
      yaxis: { title: { text: "logprob" }, gridcolor: "#eceff4" } }));
  } else {
    $("viewer-logprobs").innerHTML = `<p class="empty-note">No sampled tokens recorded.</p>`;
  }
  $("viewer-title").textContent = `${d.trial_id}`;
  setPanel("panel-viewer", true, "");
}

async function openTrial(run, row) {
  try {
    $("viewer-title").textContent = `loading ${row.trial_id}…`;
    const detail = await loadTrial(run, row);
    state.open = { run, trial_id: row.trial_id, key: row.key };
    renderViewer(detail);
    renderTrials();
    history.replaceState(null, "", `#trial=${encodeURIComponent(row.trial_id)}&run=${run}`);
  } catch (err) {
    $("viewer").innerHTML = `<p class="empty-note">Could not open ${esc(row.trial_id)}: ${esc(err.message)}</p>`;
  }
}

function renderCost(ov) {
  const rows = ov.cost || [];
  setPanel("panel-cost", rows.length > 0, "No trials yet.");
  const n = (digits) => (v) => (v === null || v === undefined ? "—" : Number(v).toFixed(digits));
  $("cost-table").innerHTML = table([
    { key: "step", label: "step", num: true }, { key: "harness", label: "harness" }, { key: "trials", label: "trials", num: true },
    { key: "sandbox_s_per_trial", label: "sandbox s", num: true, render: n(1) },
    { key: "engine_s_per_trial", label: "engine s", num: true, render: n(2) },
    { key: "prompt_tokens_per_trial", label: "prompt tok", num: true, render: n(0) },
    { key: "sampled_tokens_per_trial", label: "sampled tok", num: true, render: n(0) },
    { key: "cached_share", label: "cached", num: true, render: pct },
    { key: "retries", label: "retries", num: true },
  ], rows) + `<p class="muted">per trial (means); cached = prompt tokens reused from the session's history</p>`;
}

// ------------------------------------------------------------------ refresh loop

function renderAll() {
  const ov = state.overviews[0];
  $("run-name").textContent = state.runs.map((r) => r.name).join(" vs ");
  document.title = `legorl · ${state.runs[0].name}`;
  const panels = [renderCounts, renderReward, renderOutcomes, renderGroups, renderGrid, renderFidelity, renderStaleness, renderBehaviour, renderEval, renderCost];
  for (const fn of panels) {
    try { fn(ov); } catch (err) { console.error(fn.name, err); }
  }
  try { renderCompare(); } catch (err) { console.error("renderCompare", err); }
  syncFilters();
  renderTrials();
  document.body.dataset.fingerprint = state.fpKey || "static";
  document.body.dataset.trials = String(ov.counts.trials);
}

function setStatus(kind, text) {
  $("live-dot").className = `dot ${kind}`;
  $("status-text").textContent = text;
}

async function refresh() {
  const fp = await getJSON("api/fingerprint");
  const key = fp.fingerprints.join(",");
  if (key !== state.fpKey) {
    state.overviews = await Promise.all(state.runs.map((_, i) => getJSON(`api/overview?run=${i}`)));
    state.fpKey = key;
    state.updated = new Date();
    renderAll();
  }
  setStatus("live", `live · updated ${state.updated.toLocaleTimeString()} · ${state.overviews[0].counts.trials} trials`);
}

async function poll() {
  try { await refresh(); } catch (err) { setStatus("error", `cannot reach the dashboard server (${err.message})`); }
  setTimeout(poll, CFG.pollMs);
}

function bindFilters() {
  const bind = (id, key, ev) => $(id).addEventListener(ev || "change", (e) => {
    state.filters[key] = e.target.value; state.shown = 200;
    if (key === "run") { state.filters.step = state.filters.harness = state.filters.category = ""; syncFilters(); }
    renderTrials();
  });
  bind("f-run", "run"); bind("f-step", "step"); bind("f-harness", "harness"); bind("f-category", "category"); bind("f-task", "task", "input");
}

async function openFromHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  const id = params.get("trial");
  if (!id) return;
  const run = Number(params.get("run") || 0);
  const row = (state.overviews[run] || { trials: [] }).trials.find((t) => t.trial_id === id);
  if (row) { state.filters.run = String(run); syncFilters(); await openTrial(run, row); }
}

async function main() {
  bindFilters();
  if (STATIC) {
    state.runs = STATIC.runs; state.overviews = STATIC.overviews; state.fpKey = null;
    renderAll();
    setStatus("static", `static export · ${state.overviews[0].counts.trials} trials`);
    await openFromHash();
    return;
  }
  state.runs = await getJSON("api/runs");
  await refresh();
  await openFromHash();
  setTimeout(poll, CFG.pollMs);
}

main().catch((err) => setStatus("error", err.message));
