// servelab lab: the page draws what /api answers; it computes no figure of its own.
"use strict";

const COMMON = ["model", "hardware", "weight_dtype", "kv_dtype", "tp"];
// min/max come from the catalog's limits (the API's own bounds), filled in by controlSpec.
const num = (name, label, step) => ({ name, label, type: "number", step: step || 1 });
const pick = (name, label, options) => ({ name, label, type: "select", options });

// Powers-of-two axes: a tick at each power with binary K suffixes ("16K", not "16.384k").
const pow2Axis = (values) => {
  const ticks = values.filter((v) => v > 0 && (v & (v - 1)) === 0);
  const step = Math.ceil(ticks.length / 12); // at most a dozen labels
  const shown = ticks.filter((_, i) => i % step === 0);
  return { type: "log", tickvals: shown, ticktext: shown.map((v) => (v >= 1024 ? v / 1024 + "K" : String(v))) };
};
// Log axes labelled at 1-2-5 steps with whole figures, never Plotly's bare digits ("2 ... 6").
const tickText = (v) => (v >= 1000 ? (v / 1000).toLocaleString("en", { maximumSignificantDigits: 3 }) + "k" : v.toLocaleString("en", { maximumSignificantDigits: 3 }));
const logAxis = (...series) => {
  const vals = series.flat().filter((v) => v != null && v > 0);
  if (!vals.length) return { type: "log" };
  const lo = Math.min(...vals), hi = Math.max(...vals);
  // Wide ranges get one label per decade, narrow ones more steps, so labels never crowd.
  const decades = Math.log10(hi / lo);
  let mantissas = decades > 3 ? [1] : [1, 2, 5];
  const make = () => {
    const out = [];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++)
      for (const m of mantissas) { const v = m * 10 ** e; if (v >= lo / 1.5 && v <= hi * 1.5) out.push(Number(v.toPrecision(3))); }
    return out;
  };
  let tickvals = make();
  if (tickvals.length < 3) { mantissas = [1, 1.5, 2, 3, 4, 5, 6, 8]; tickvals = make(); }
  return { type: "log", tickvals, ticktext: tickvals.map(tickText) };
};
// The region beyond a limit, shaded and named: [lo, hi] in the axis's data coordinates.
const NO_FIT = "rgba(198, 40, 40, 0.12)";
// Labels sit at the plot's right edge, inside it, so a narrow shade never pushes its name off the chart.
const limitShade = (x0, x1, text, color, yShift) => ({
  shape: { type: "rect", xref: "x", yref: "paper", x0, x1, y0: 0, y1: 1, fillcolor: color, line: { width: 0 }, layer: "below" },
  annotation: { x: 1, y: 1 - (yShift || 0), xref: "paper", yref: "paper", xanchor: "right", yanchor: "top", text, showarrow: false,
                font: { size: 11, color: color === NO_FIT ? "#c62828" : "#555" }, bgcolor: "rgba(255,255,255,0.7)" },
});
// Shades for the batching charts: beyond the KV-cache limit (red) and beyond the compute ridge (grey).
const batchShades = (d, toX, last) => {
  const out = [];
  const mem = d.limits.memory, comp = d.limits.compute;
  if (comp && comp.batch <= last.batch) out.push(limitShade(toX(comp.batch, "lo"), last.x, comp.label, "rgba(120,120,120,0.12)", 0.09));
  if (mem.batch < last.batch) out.push(limitShade(toX(mem.batch, "hi"), last.x, mem.label, NO_FIT, 0));
  return out;
};
const baseLayout = (title, x, y, extra) => Object.assign({
  title: { text: title, font: { size: 15 } },
  margin: { l: 64, r: 20, t: 44, b: 52 },
  xaxis: Object.assign({ title: { text: x } }, (extra && extra.xaxis) || {}),
  yaxis: Object.assign({ title: { text: y }, rangemode: "tozero" }, (extra && extra.yaxis) || {}),
  legend: { orientation: "h", y: -0.22 },
  hovermode: "closest",
}, extra && extra.rest);

const cdfTraces = (series, name, color) => [
  { x: series.x, y: series.cdf, mode: "lines", name, line: { color, shape: "hv" } },
];
const pctShapes = (pcts, color, yref) => Object.entries(pcts).map(([k, v]) => ({
  type: "line", x0: v, x1: v, y0: 0, y1: 1, yref: yref || "paper", line: { color, width: 1, dash: "dot" },
}));
const pctAnnotations = (pcts, color) => Object.entries(pcts).map(([k, v], i) => ({
  x: v, y: 0.08 + 0.1 * i, yref: "paper", text: k, showarrow: false, font: { color, size: 11 }, xanchor: "left",
}));

// One bar per dtype/attention variant; on a phone the bars lie down so their 3-line labels stay readable.
const variantBars = (d, values, color, name, title, unit, narrow) => {
  const colors = d.variants.selected.map((s) => (s ? "#c62828" : color));
  if (!narrow)
    return { data: [{ type: "bar", x: d.variants.label, y: values, marker: { color: colors }, name }],
             layout: baseLayout(title, "", unit, { rest: { margin: { l: 64, r: 20, t: 44, b: 80 } } }) };
  const labels = d.variants.label.map((l) => l.replace(/<br>/g, " · "));
  return { data: [{ type: "bar", orientation: "h", y: labels, x: values, marker: { color: colors }, name }],
           layout: baseLayout(title, unit, "", { yaxis: { autorange: "reversed", tickfont: { size: 10 } },
             rest: { height: 520, margin: { l: 130, r: 12, t: 60, b: 52 } } }) };
};

const LESSONS = [
  {
    id: "two-workloads", title: "1. A request is two workloads",
    prose: [
      "Prefill pushes every prompt token through the model in one step: big matrix multiplications, many FLOPs for each byte of weights read. Decode makes one token per sequence per step and must still read every weight, so its arithmetic intensity is tiny.",
      "The roofline puts both on one chart: below the ridge a step waits for memory, above it for arithmetic.",
    ],
    controls: [...COMMON, num("prompt_len", "prompt length (tokens)"), num("batch", "decode batch")],
    charts: [
      { id: "times", make: (d) => ({
          data: [{ type: "bar", x: d.phases.label, y: d.phases.time_ms, marker: { color: ["#2d6cdf", "#e07b00"] },
                   text: d.phases.bound, textposition: "outside", name: "step time" }],
          layout: baseLayout("Prefill time vs one decode step", "", "time (ms)", { yaxis: Object.assign(logAxis(d.phases.time_ms), { rangemode: "normal" }) }) }) },
      { id: "roofline", make: (d) => ({
          data: [
            { x: d.roofline.intensity, y: d.roofline.attainable_tflops, mode: "lines", name: "roofline", line: { color: "#444" } },
            { x: [d.prefill.intensity], y: [d.prefill.achieved_tflops], mode: "markers+text", name: "prefill",
              text: ["prefill"], textposition: "top left", marker: { size: 13, color: "#2d6cdf" } },
            { x: [d.decode.intensity], y: [d.decode.achieved_tflops], mode: "markers+text", name: "decode step",
              text: ["decode"], textposition: "top right", marker: { size: 13, color: "#e07b00" } },
          ],
          layout: baseLayout("Roofline: arithmetic intensity against the ridge", "arithmetic intensity (FLOP/byte)",
            "attained TFLOP/s", { xaxis: logAxis(d.roofline.intensity), yaxis: Object.assign(logAxis(d.roofline.attainable_tflops, [d.prefill.achieved_tflops, d.decode.achieved_tflops]), { rangemode: "normal" }), rest: {
              shapes: [{ type: "line", x0: d.ridge_flops_per_byte, x1: d.ridge_flops_per_byte, y0: 0, y1: 1, yref: "paper", line: { dash: "dash", color: "#999" } }],
              annotations: [{ x: Math.log10(d.ridge_flops_per_byte), y: 1, yref: "paper", text: "ridge " + d.ridge_label, showarrow: false, yanchor: "bottom" }] } }) }) },
      { id: "prefill-sweep", wide: true, make: (d) => ({
          data: [
            { x: d.sweep.prompt_len, y: d.sweep.prefill_ms, mode: "lines+markers", name: "prefill time (TTFT floor)" },
            { x: d.sweep.prompt_len, y: d.sweep.decode_step_ms, mode: "lines+markers", name: "one decode step at that context" },
          ],
          layout: (() => {
            // Beyond the context at which this batch's KV fits, the decode step cannot run: shade it.
            const lens = d.sweep.prompt_len, lim = d.limits.context, maxL = Math.max(...lens);
            const x0 = Math.max(lim.prompt_len, Math.min(...lens) / 1.5);
            const shades = lim.prompt_len < maxL ? [limitShade(x0, maxL * 1.5, lim.label, NO_FIT)] : [];
            return baseLayout("Prefill grows with the prompt; a decode step barely moves", "prompt length (tokens)", "time (ms)",
              { xaxis: pow2Axis(lens), yaxis: Object.assign(logAxis(d.sweep.prefill_ms, d.sweep.decode_step_ms), { rangemode: "normal" }),
                rest: { shapes: shades.map((s) => s.shape), annotations: shades.map((s) => s.annotation) } });
          })() }) },
    ],
  },
  {
    id: "batching", title: "2. Batching: the free lunch",
    prose: [
      "A decode step reads the weights once however many sequences share it. Batch more users and the step barely slows, so total tokens/s climbs while each user's tokens/s falls only a little.",
      "Two limits end the lunch: every sequence's KV cache is read each step too, so long contexts add bytes; and at some batch the arithmetic catches up with the bandwidth. And everything must fit in memory.",
    ],
    controls: [...COMMON, num("batch", "batch size"), num("context", "context length (tokens)")],
    charts: [
      { id: "throughput", make: (d) => ({
          data: [
            { x: d.sweep.batch, y: d.sweep.tokens_per_s_total, mode: "lines+markers", name: "total tokens/s" },
            { x: d.sweep.batch, y: d.sweep.tokens_per_s_per_user, mode: "lines+markers", name: "tokens/s per user", yaxis: "y2" },
            { x: [d.selected.batch], y: [d.selected.tokens_per_s_total], mode: "markers", name: "your batch", marker: { size: 14, symbol: "star", color: "#c62828" } },
          ],
          layout: (() => {
            const maxB = Math.max(...d.sweep.batch), minB = Math.min(...d.sweep.batch);
            // A log axis has no 0: a limit of batch 0 (the weights alone do not fit) shades from the left edge.
            const shades = batchShades(d, (b) => Math.max(b, minB / 1.5), { batch: maxB, x: maxB * 1.5 });
            return baseLayout("Throughput in total and per user", "batch size", "total tokens/s", { xaxis: pow2Axis(d.sweep.batch), rest: { margin: { l: 64, r: 64, t: 44, b: 52 },
              yaxis2: { title: { text: "tokens/s per user" }, overlaying: "y", side: "right", rangemode: "tozero", tickmode: "auto", nticks: 6, showgrid: false },
              shapes: shades.map((s) => s.shape), annotations: shades.map((s) => s.annotation) } });
          })() }) },
      { id: "bytes", make: (d) => ({
          data: [
            { type: "bar", x: d.sweep.batch.map(String), y: d.sweep.weight_gb, name: "weights read" },
            { type: "bar", x: d.sweep.batch.map(String), y: d.sweep.kv_gb, name: "KV read" },
            { x: d.sweep.batch.map(String), y: d.sweep.step_ms, mode: "lines+markers", name: "step time (ms)", yaxis: "y2", line: { color: "#c62828" } },
          ],
          layout: (() => {
            // Category positions: a limit between two swept batches shades from the first one past it.
            const n = d.sweep.batch.length;
            const idx = (b, side) => { const i = d.sweep.batch.findIndex((x) => (side === "hi" ? x > b : x >= b)); return (i < 0 ? n : i) - 0.5; };
            const shades = batchShades(d, idx, { batch: d.sweep.batch[n - 1], x: n - 0.5 });
            return baseLayout("Bytes per decode step: weights vs KV", "batch size", "GB read per step", { xaxis: { type: "category" }, rest: { barmode: "stack", margin: { l: 64, r: 64, t: 44, b: 52 },
              yaxis2: { title: { text: "step time (ms)" }, overlaying: "y", side: "right", rangemode: "tozero", tickmode: "auto", nticks: 6, showgrid: false },
              shapes: shades.map((s) => s.shape), annotations: shades.map((s) => s.annotation) } });
          })() }) },
      { id: "memory", wide: true, short: true, make: (d) => ({
          data: [
            { type: "bar", orientation: "h", y: ["memory"], x: [d.memory.weights_gb], name: "weights", marker: { color: "#2d6cdf" } },
            { type: "bar", orientation: "h", y: ["memory"], x: [d.memory.kv_gb], name: "KV cache at this batch and context",
              marker: { color: d.memory.fits ? "#43a047" : "#c62828" } },
          ],
          layout: baseLayout(d.memory.fits ? "Weights + KV vs accelerator memory: fits" : "Weights + KV vs accelerator memory: DOES NOT FIT",
            "GB", "", { rest: { barmode: "stack", height: 220, margin: { l: 70, r: 20, t: 44, b: 40 },
              title: { text: d.memory.fits ? "Weights + KV vs accelerator memory: fits" : "Weights + KV vs accelerator memory: DOES NOT FIT",
                       font: { size: 15, color: d.memory.fits ? "#1d2330" : "#c62828" } },
              shapes: [{ type: "line", x0: d.memory.capacity_gb, x1: d.memory.capacity_gb, y0: 0, y1: 1, yref: "paper", line: { color: "#000", width: 2 } }],
              annotations: [{ x: d.memory.capacity_gb, y: 1, yref: "paper", yanchor: "bottom", text: "usable memory " + d.memory.capacity_label, showarrow: false }] } }) }) },
    ],
  },
  {
    id: "slo", title: "3. TTFT and TPOT as SLOs",
    prose: [
      "Production targets are stated at a percentile: say p90 TTFT under 500 ms and p90 TPOT under 50 ms. The simulator below runs the engine's own scheduler on the cost model at a Poisson request rate.",
      "Raise the rate: batches grow, throughput rises, and the tails of both distributions move right until the SLOs break. Goodput counts only the requests that met every target.",
    ],
    controls: [...COMMON, num("rate", "request rate (req/s)", 0.1), num("ttft_slo_ms", "TTFT SLO (ms)"),
               num("tpot_slo_ms", "TPOT SLO (ms)"), num("prompt_len", "prompt tokens"), num("output_len", "output tokens")],
    charts: [
      { id: "ttft-cdf", make: (d) => ({
          data: cdfTraces(d.ttft_ms, "TTFT", "#2d6cdf"),
          layout: baseLayout("TTFT distribution (CDF)", "TTFT (ms)", "fraction of requests", { rest: {
            shapes: [...pctShapes(d.ttft_ms.percentiles, "#2d6cdf"), { type: "line", x0: d.ttft_slo_ms, x1: d.ttft_slo_ms, y0: 0, y1: 1, yref: "paper", line: { color: "#c62828", width: 2 } }],
            annotations: [...pctAnnotations(d.ttft_ms.percentiles, "#2d6cdf"), { x: d.ttft_slo_ms, y: 1, yref: "paper", yanchor: "bottom", text: "SLO", showarrow: false, font: { color: "#c62828" } }] } }) }) },
      { id: "tpot-cdf", make: (d) => ({
          data: cdfTraces(d.tpot_ms, "TPOT", "#e07b00"),
          layout: baseLayout("TPOT distribution (CDF)", "TPOT (ms)", "fraction of requests", { rest: {
            shapes: [...pctShapes(d.tpot_ms.percentiles, "#e07b00"), { type: "line", x0: d.tpot_slo_ms, x1: d.tpot_slo_ms, y0: 0, y1: 1, yref: "paper", line: { color: "#c62828", width: 2 } }],
            annotations: [...pctAnnotations(d.tpot_ms.percentiles, "#e07b00"), { x: d.tpot_slo_ms, y: 1, yref: "paper", yanchor: "bottom", text: "SLO", showarrow: false, font: { color: "#c62828" } }] } }) }) },
    ],
  },
  {
    id: "chunked-prefill", title: "4. Chunked prefill",
    prose: [
      "A long prompt arrives while a batch of users is decoding. Prefill-first runs the whole prompt in one step, and every decoding user waits for it: one huge gap between their tokens.",
      "Chunked prefill splits the prompt into pieces under a token budget and runs each piece alongside the decodes: many slightly longer steps instead of one stall.",
    ],
    controls: [...COMMON, num("prompt_len", "long prompt (tokens)"), num("decode_batch", "decoding users"),
               num("chunk_tokens", "chunk budget (tokens/step)")],
    charts: ["prefill_first", "chunked"].flatMap((mode) => [
      { id: "steps-" + mode, make: (d) => ({
          data: [{ type: "bar", x: d[mode].steps.start_ms, y: d[mode].steps.duration_ms, width: d[mode].steps.duration_ms, offset: 0,
                   marker: { color: d[mode].steps.prefill_tokens.map((t) => (t > 0 ? "#c62828" : "#2d6cdf")) },
                   hovertext: d[mode].steps.prefill_tokens.map((t) => (t > 0 ? t + " prefill tokens" : "decode only")), name: "step" }],
          layout: baseLayout(d[mode].label + ": step durations (red = carries prefill)", "time (ms)", "step duration (ms)",
            { rest: { xaxis: { title: { text: "time (ms)" }, range: d.time_range_ms } } }) }) },
      { id: "tokens-" + mode, make: (d) => ({
          data: [
            { x: d[mode].tokens.time_ms, y: d[mode].tokens.seq, mode: "markers", name: "decoding users' tokens", marker: { size: 4, color: "#2d6cdf" } },
            { x: d[mode].long_tokens.time_ms, y: d[mode].long_tokens.seq, mode: "markers", name: "long prompt's tokens", marker: { size: 6, color: "#c62828" } },
          ],
          layout: baseLayout(d[mode].label + ": every sequence's token times", "time (ms)", "sequence",
            { rest: { xaxis: { title: { text: "time (ms)" }, range: d.time_range_ms } } }) }) },
    ]),
  },
  {
    id: "disaggregated", title: "5. Disaggregated serving",
    prose: [
      "Colocated serving runs prefill and decode on the same GPUs, so prefills interrupt decodes. Disaggregated serving puts them on separate pools and ships each request's KV cache from the prefill GPU to a decode GPU.",
      "The decode pool never stalls on a prefill, so inter-token latency gets smooth; TTFT pays the KV transfer and the smaller prefill pool.",
    ],
    controls: [...COMMON, num("rate", "request rate (req/s)", 0.1), num("prefill_gpus", "prefill GPUs"), num("decode_gpus", "decode GPUs"),
               num("link_gbps", "KV link (GB/s)"), num("prompt_len", "prompt tokens"), num("output_len", "output tokens")],
    charts: [
      { id: "ttft", make: (d) => ({
          data: [...cdfTraces(d.colocated.ttft_ms, d.colocated.label, "#2d6cdf"), ...cdfTraces(d.disaggregated.ttft_ms, d.disaggregated.label, "#e07b00")],
          layout: baseLayout("TTFT (disaggregated includes the KV transfer)", "TTFT (ms)", "fraction of requests") }) },
      { id: "itl", make: (d) => ({
          data: [...cdfTraces(d.colocated.itl_ms, d.colocated.label, "#2d6cdf"), ...cdfTraces(d.disaggregated.itl_ms, d.disaggregated.label, "#e07b00")],
          layout: baseLayout("Inter-token latency", "ITL (ms, log scale)", "fraction of token gaps", { xaxis: logAxis(d.colocated.itl_ms.x, d.disaggregated.itl_ms.x) }) }) },
    ],
  },
  {
    id: "memory", title: "6. Memory is the scarce resource",
    prose: [
      "Weights take a fixed share of the accelerator; the rest holds KV cache, and each running sequence needs KV for its whole context. Smaller weight dtypes free memory for KV; smaller KV dtypes and grouped-query attention (fewer KV heads) shrink the KV per token.",
      "More sequences in memory means a bigger batch, and a bigger batch means more tokens/s per GPU, as long as each step stays within the TPOT target.",
    ],
    controls: [...COMMON, pick("attention", "attention", ["gqa", "full"]), num("context", "context length (tokens)"), num("tpot_ms", "TPOT target (ms)")],
    charts: [
      { id: "max-batch", make: (d, narrow) => variantBars(d, d.variants.max_batch, "#2d6cdf", "largest batch",
          "Largest batch that fits at this context", "sequences", narrow) },
      { id: "capacity", make: (d, narrow) => variantBars(d, d.variants.tokens_per_s_per_gpu, "#43a047", "tokens/s",
          "Capacity at the TPOT target (tokens/s per GPU)", "tokens/s", narrow) },
    ],
  },
  {
    id: "capacity", title: "7. Capacity and cost across accelerators",
    prose: [
      "Self-hosted capacity is tokens per second per GPU at a target TPOT, not QPS. The planner finds, for each accelerator, the largest load whose decode steps meet the target and that fits in memory, and turns it into dollars per million output tokens.",
    ],
    controls: [...COMMON, num("tpot_ms", "TPOT target (ms)"), num("prompt_len", "prompt tokens"), num("output_len", "output tokens")],
    charts: [
      { id: "tokens-per-gpu", make: (d) => ({
          data: [{ type: "bar", x: d.plan.hardware, y: d.plan.tokens_per_s_per_gpu, name: "tokens/s per GPU", text: d.plan.config, textposition: "outside" }],
          layout: baseLayout("Output tokens/s per GPU at the TPOT target", "", "tokens/s per GPU") }) },
      { id: "cost", make: (d) => ({
          data: [{ type: "bar", x: d.plan.hardware, y: d.plan.usd_per_million_tokens, name: "$ per million tokens", marker: { color: "#43a047" } }],
          layout: baseLayout("Cost per million output tokens", "", "$ / 1M tokens") }) },
    ],
  },
];

const LIVE = {
  id: "live", title: "Live engine", live: true,
  prose: ["This panel reads the running engine's own metrics every two seconds: requests running and waiting, KV cache use, and the TTFT and inter-token latency histograms it measured."],
  controls: [],
  charts: [
    { id: "live-queue", make: (d) => ({
        data: [{ type: "bar", x: ["running", "waiting"], y: [d.running, d.waiting], marker: { color: ["#2d6cdf", "#e07b00"] }, name: "requests" }],
        layout: baseLayout("Requests", "", "requests") }) },
    { id: "live-kv", make: (d) => ({
        data: [{ type: "bar", orientation: "h", y: ["KV cache"], x: [d.kv_usage == null ? null : d.kv_usage * 100], name: "KV in use", marker: { color: "#43a047" } }],
        layout: baseLayout("KV cache in use (%)", "%", "", { xaxis: { range: [0, 100] }, rest: { height: 220 } }) }) },
    { id: "live-ttft", make: (d) => histogram(d.ttft_s, "TTFT histogram") },
    { id: "live-itl", make: (d) => histogram(d.itl_s, "Inter-token latency histogram") },
  ],
};

function histogram(h, title) {
  const labels = h ? h.le.map((le) => (le == null ? "+Inf" : "≤ " + le + " s")) : [];
  return { data: [{ type: "bar", x: labels, y: h ? h.counts : [], name: "count" }], layout: baseLayout(title, "bucket", "count") };
}

// ---------------------------------------------------------------------------------------------

const state = { catalog: null, lesson: null, seq: 0, liveTimer: null, live: false };
window.lab = { renders: 0, last: null, errors: 0 };
const $ = (id) => document.getElementById(id);

function lessonById(id) {
  return [...LESSONS, LIVE].find((l) => l.id === id) || LESSONS[0];
}

function controlSpec(c, lesson) {
  if (typeof c !== "string") {
    if (c.type !== "number") return c;
    const lim = (state.catalog.limits[lesson.id] || {})[c.name];
    if (!lim) throw new Error("the API publishes no limits for " + lesson.id + "." + c.name);
    return Object.assign({}, c, { min: lim.min, max: lim.max });
  }
  const cat = state.catalog;
  const labels = { model: "model", hardware: "accelerator", weight_dtype: "weight dtype", kv_dtype: "KV dtype", tp: "tensor parallel" };
  const options = { model: cat.models.map((m) => m.name), hardware: cat.hardware.map((h) => h.name),
                    weight_dtype: cat.weight_dtypes, kv_dtype: cat.kv_dtypes, tp: cat.tp.map(String) }[c];
  return pick(c, labels[c], options);
}

function buildNav() {
  const nav = $("nav");
  nav.innerHTML = "";
  for (const l of [...LESSONS, ...(state.live ? [LIVE] : [])]) {
    const a = document.createElement("a");
    a.href = "?lesson=" + l.id;
    a.textContent = l.title;
    a.dataset.lesson = l.id;
    if (l.live) a.className = "live";
    a.addEventListener("click", (e) => { e.preventDefault(); openLesson(l.id, {}); });
    nav.appendChild(a);
  }
}

function buildControls(lesson, values) {
  const form = $("controls");
  form.innerHTML = "";
  form.hidden = lesson.controls.length === 0;
  const defaults = state.catalog.defaults[lesson.id] || {};
  for (const raw of lesson.controls) {
    const c = controlSpec(raw, lesson);
    const label = document.createElement("label");
    label.textContent = c.label;
    let input;
    if (c.type === "select") {
      input = document.createElement("select");
      for (const o of c.options) {
        const opt = document.createElement("option");
        opt.value = o; opt.textContent = o;
        input.appendChild(opt);
      }
    } else {
      input = document.createElement("input");
      input.type = "number"; input.min = c.min; input.max = c.max; input.step = c.step; input.required = true;
    }
    input.name = c.name; input.id = "ctl-" + c.name;
    const v = values[c.name] !== undefined ? values[c.name] : defaults[c.name];
    if (v !== undefined) input.value = v;
    input.addEventListener("change", () => refresh());
    label.appendChild(input);
    form.appendChild(label);
  }
}

function currentParams() {
  const params = new URLSearchParams();
  for (const el of $("controls").elements) params.set(el.name, el.value);
  return params;
}

function invalidControls() {
  const bad = [];
  for (const el of $("controls").elements) {
    el.classList.remove("invalid");
    if (!el.checkValidity()) {
      el.classList.add("invalid");
      const c = el.closest("label").firstChild.textContent;
      bad.push(c + ": " + (el.validationMessage || "invalid value") + (el.min ? " (allowed " + el.min + " to " + el.max + ")" : ""));
    }
  }
  return bad;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
  $("warning").hidden = true;
  $("notice").textContent = "";
  $("summary").innerHTML = "";
  for (const chart of $("charts").children) Plotly.purge(chart);
  $("charts").hidden = true;
}

function render(lesson, data) {
  $("error").hidden = true;
  $("warning").textContent = data.warning || "";
  $("warning").hidden = !data.warning;
  $("charts").hidden = false;
  $("notice").textContent = data.notice || "";
  const summary = $("summary");
  summary.innerHTML = "";
  for (const s of data.stats || []) {
    const div = document.createElement("div");
    div.className = "stat";
    const b = document.createElement("b"); b.textContent = s.value;
    const span = document.createElement("span"); span.textContent = s.label;
    div.append(b, span);
    summary.appendChild(div);
  }
  for (const chart of lesson.charts) {
    const narrow = $("chart-" + chart.id).clientWidth < 520;
    const fig = chart.make(data, narrow);
    const title = fig.layout.title;
    if (title && title.text && narrow) {
      // Plotly titles never wrap: on a phone, break a long one at its colon so it is not clipped.
      title.text = title.text.replace(": ", ":<br>");
      title.font = Object.assign({}, title.font, { size: 13 });
      fig.layout.margin = Object.assign({ l: 64, r: 20, b: 52 }, fig.layout.margin, { t: 60 });
    }
    Plotly.react("chart-" + chart.id, fig.data, fig.layout, { displaylogo: false, responsive: true });
  }
  window.lab.last = { lesson: lesson.id, data };
  window.lab.renders += 1;
  document.body.dataset.renders = String(window.lab.renders);
}

async function refresh() {
  const lesson = state.lesson;
  const params = currentParams();
  const query = new URLSearchParams(params);
  query.set("lesson", lesson.id);
  history.replaceState(null, "", "?" + query.toString());
  const bad = invalidControls();
  if (bad.length) { showError(bad.join("\n")); window.lab.errors += 1; document.body.dataset.errors = String(window.lab.errors); return; }
  const seq = ++state.seq;
  document.body.classList.add("busy");
  try {
    const url = lesson.live ? "api/live" : "api/lessons/" + lesson.id + "?" + params.toString();
    const response = await fetch(url);
    const body = await response.json();
    if (seq !== state.seq) return; // a newer request superseded this one
    if (response.status === 202) {
      // A long computation (the capacity plan) is running on the server: show progress, poll.
      $("notice").textContent = body.message;
      setTimeout(() => { if (seq === state.seq) refresh(); }, 700);
      return;
    }
    if (!response.ok) {
      showError((body.error && body.error.message) || response.statusText);
      window.lab.errors += 1;
      document.body.dataset.errors = String(window.lab.errors);
    } else {
      render(lesson, body);
    }
  } finally {
    if (seq === state.seq) document.body.classList.remove("busy");
  }
}

function openLesson(id, values) {
  const lesson = lessonById(id);
  state.lesson = lesson;
  clearInterval(state.liveTimer);
  $("title").textContent = lesson.title;
  $("prose").innerHTML = "";
  for (const p of lesson.prose) {
    const el = document.createElement("p"); el.textContent = p; $("prose").appendChild(el);
  }
  for (const a of $("nav").children) a.classList.toggle("active", a.dataset.lesson === lesson.id);
  buildControls(lesson, values);
  const charts = $("charts");
  for (const chart of charts.children) Plotly.purge(chart);
  charts.innerHTML = "";
  for (const chart of lesson.charts) {
    const div = document.createElement("div");
    div.id = "chart-" + chart.id;
    div.className = "chart" + (chart.wide ? " wide" : "") + (chart.short ? " short" : "");
    charts.appendChild(div);
  }
  refresh();
  if (lesson.live) state.liveTimer = setInterval(refresh, 2000);
}

async function main() {
  const [catalog, health] = await Promise.all([fetch("api/catalog").then((r) => r.json()), fetch("api/health").then((r) => r.json())]);
  state.catalog = catalog;
  state.live = health.live;
  buildNav();
  const query = new URLSearchParams(location.search);
  const values = Object.fromEntries(query.entries());
  openLesson(values.lesson || LESSONS[0].id, values);
}

main();
