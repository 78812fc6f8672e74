// servelab lab: the page draws what /api answers; it computes no figure of its own.
"use strict";

const COMMON = ["model", "hardware", "weight_dtype", "kv_dtype", "tp"];
const ENGINE = "engine_profile"; // the simulated lessons run as this engine's defaults
// min/max come from the catalog's limits (the API's own bounds), filled in by controlSpec.
const num = (name, label, step, optional) => ({ name, label, type: "number", step: step || 1, optional: !!optional });
const fmtNum = (v) => (v == null ? "n/a" : v.toLocaleString("en", { maximumSignificantDigits: 3 }));
const pick = (name, label, options) => ({ name, label, type: "select", options });

// Powers-of-two axes: a tick at each power with binary K suffixes ("16K", not "16.384k").
const pow2Axis = (values) => {
  const ticks = values.filter((v) => v > 0 && (v & (v - 1)) === 0);
  const step = Math.ceil(ticks.length / 12); // at most a dozen labels
  const shown = ticks.filter((_, i) => i % step === 0);
  return { type: "log", tickvals: shown, ticktext: shown.map((v) => (v >= 1024 ? v / 1024 + "K" : String(v))) };
};
// Log axes labelled at 1-2-5 steps with whole figures, never Plotly's bare digits ("2 ... 6").
const sig3 = (v) => v.toLocaleString("en", { maximumSignificantDigits: 3 });
const tickText = (v) => (v >= 1e6 ? sig3(v / 1e6) + "M" : v >= 1000 ? sig3(v / 1000) + "k" : sig3(v));
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
  if (tickvals.length < 4) { mantissas = [1, 1.5, 2, 3, 4, 5, 6, 8]; tickvals = make(); }
  return { type: "log", tickvals, ticktext: tickvals.map(tickText) };
};
// The region beyond a limit, shaded and named: [lo, hi] in the axis's data coordinates. On a phone the
// name moves to the legend (see draw), where no curve can run under it.
const SHADE_LABEL = "limit-shade";
const NO_FIT = "rgba(198, 40, 40, 0.12)";
// Labels sit at the plot's right edge, inside it, so a narrow shade never pushes its name off the chart.
const limitShade = (x0, x1, text, color, yShift) => ({
  shape: { type: "rect", xref: "x", yref: "paper", x0, x1, y0: 0, y1: 1, fillcolor: color, line: { width: 0 }, layer: "below" },
  annotation: { x: 1, y: 1 - (yShift || 0), xref: "paper", yref: "paper", xanchor: "right", yanchor: "top", text, showarrow: false,
                font: { size: 11, color: color === NO_FIT ? "#c62828" : "#555" }, bgcolor: "rgba(255,255,255,0.7)", name: SHADE_LABEL },
});
// Shades for the batching charts: beyond the KV-cache limit (red) and beyond the compute ridge (grey).
const batchShades = (d, toX, last) => {
  const out = [];
  const mem = d.limits.memory, comp = d.limits.compute;
  if (comp && comp.batch <= last.batch) out.push(limitShade(toX(comp.batch, "lo"), last.x, comp.label, "rgba(120,120,120,0.12)", 0.09));
  if (mem.batch < last.batch) out.push(limitShade(toX(mem.batch, "hi"), last.x, mem.label, NO_FIT, 0));
  return out;
};
const withShades = (shades) => ({ shapes: shades.map((s) => s.shape), annotations: shades.map((s) => s.annotation) });
// Long limit names wrap so they stay inside a phone-width chart.
const wrap = (text, width) => text.replace(new RegExp("(.{1," + (width || 46) + "})(\\s+|$)", "g"), "$1<br>").replace(/(<br>)+$/, "");
// A lesson that cannot run this configuration: every chart is one shaded area naming the limit.
const noFitFigure = (label) => ({
  data: [],
  layout: baseLayout("", "", "", { xaxis: { visible: false }, yaxis: { visible: false }, rest: {
    shapes: [{ type: "rect", xref: "paper", yref: "paper", x0: 0, x1: 1, y0: 0, y1: 1, fillcolor: NO_FIT, line: { width: 0 } }],
    annotations: [{ x: 0.5, y: 0.5, xref: "paper", yref: "paper", text: wrap(label), showarrow: false, font: { size: 13, color: "#c62828" } }] } }),
});
// A vertical marker at x with a label on top, to its right (or, with xanchor "right", to its left).
const marker = (x, text, color, dash, yShift, xanchor) => ({
  shape: { type: "line", x0: x, x1: x, y0: 0, y1: 1, yref: "paper", line: { color, width: 2, dash: dash || "solid" } },
  annotation: { x, y: 1 - (yShift || 0), yref: "paper", xanchor: xanchor || "left", yanchor: "top", text, showarrow: false, font: { size: 11, color }, bgcolor: "rgba(255,255,255,0.7)" },
});
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
// On a log axis Plotly places annotations at log10(x) (shapes take x itself).
const pctAnnotations = (pcts, color, log) => Object.entries(pcts).map(([k, v], i) => ({
  x: log ? Math.log10(v) : v, y: 0.08 + 0.1 * i, yref: "paper", text: k, showarrow: false, font: { color, size: 11 }, xanchor: "left",
}));

// One bar per dtype/attention variant; on a phone the bars lie down so their 3-line labels stay readable.
// `texts`: each bar's label; a zero bar's says which limit made it zero.
const variantBars = (d, values, color, name, title, unit, narrow, texts) => {
  const colors = d.variants.selected.map((s) => (s ? "#c62828" : color));
  const text = texts || values.map((v, i) => (v ? fmtNum(v) : d.variants.bar_label[i]));
  const label = { text, textposition: "outside", cliponaxis: false, textfont: { size: 11 }, constraintext: "none" };
  const top = Math.max(1, ...values) * (narrow ? 1.9 : 1.3); // room for the labels beyond the longest bar
  if (!narrow)
    return { data: [Object.assign({ type: "bar", x: d.variants.label, y: values, marker: { color: colors }, name }, label)],
             layout: baseLayout(title, "", unit, { yaxis: { range: [0, top] }, rest: { margin: { l: 64, r: 20, t: 44, b: 80 } } }) };
  const labels = d.variants.label.map((l) => l.replace(/<br>/g, " · "));
  return { data: [Object.assign({ type: "bar", orientation: "h", y: labels, x: values, marker: { color: colors }, name }, label)],
           layout: baseLayout(title, unit, "", { xaxis: { range: [0, top] }, yaxis: { autorange: "reversed", tickfont: { size: 11 } },
             rest: { height: 560, margin: { l: 150, r: 12, t: 60, b: 52 } } }) };
};

const LESSONS = [
  {
    id: "two-workloads", title: "1. A request is two workloads",
    prose: [
      "Prefill pushes every prompt token through the model in one step: big matrix multiplications, many FLOPs for each byte of weights read. Decode makes one token per sequence per step and must still read every weight, so its arithmetic intensity is tiny.",
      "The roofline puts both on one chart: below the ridge a step waits for memory, above it for arithmetic.",
      "Split by operator, as LLM-Viewer draws it: batching moves the matrix multiplications (QKV, output projection, MLP, LM head) right, since the batch shares their weights; decode attention stays put below the ridge, since each sequence reads its own KV cache.",
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
            // The points are named in the legend: text beside them would sit on the roof or on each other.
            { x: [d.prefill.intensity], y: [d.prefill.achieved_tflops], mode: "markers", name: "prefill (" + d.prefill.bound + "-bound)",
              marker: { size: 13, color: "#2d6cdf" } },
            { x: [d.decode.intensity], y: [d.decode.achieved_tflops], mode: "markers", name: "decode step (" + d.decode.bound + "-bound)",
              marker: { size: 13, color: "#e07b00" } },
          ],
          layout: (() => {
            // Right of the ridge a step is compute-bound (grey). The decode wall limits decode alone, so it is a
            // line, not a shade: a prefill right of it still fits. Labels sit at the bottom, under the roof.
            const xs = d.roofline.intensity, xMax = Math.max(...xs) * 1.5, wall = d.limits.roofline;
            const ridge = limitShade(d.ridge_flops_per_byte, xMax, "compute-bound beyond the ridge (" + d.ridge_label + ")", "rgba(120,120,120,0.12)");
            Object.assign(ridge.annotation, { y: 0.02, yanchor: "bottom" });
            const sh = withShades([ridge]);
            sh.shapes.push({ type: "line", x0: d.ridge_flops_per_byte, x1: d.ridge_flops_per_byte, y0: 0, y1: 1, yref: "paper", line: { dash: "dash", color: "#999" } });
            if (wall.intensity > 0 && wall.intensity < Math.max(...xs)) {
              const m = marker(wall.intensity, wrap(wall.label, 24), "#c62828", "dot");
              // On a log axis an annotation's x is in log10 units (a shape's is not).
              Object.assign(m.annotation, { x: Math.log10(wall.intensity), y: 0.14, yanchor: "bottom" });
              sh.shapes.push(m.shape); sh.annotations.push(m.annotation);
            }
            return baseLayout("Roofline: arithmetic intensity against the ridge", "arithmetic intensity (FLOP/byte)",
              "attained TFLOP/s", { xaxis: logAxis(xs), yaxis: Object.assign(logAxis(d.roofline.attainable_tflops, [d.prefill.achieved_tflops, d.decode.achieved_tflops]), { rangemode: "normal" }), rest: sh });
          })() }) },
      { id: "operators", wide: true, make: (d) => {
          // Each operator of a step as its own point: colour names the operator, the symbol the step.
          const ops = d.operators, phases = Object.keys(ops.phases);
          const colors = ["#2d6cdf", "#c62828", "#00897b", "#e07b00", "#6a1b9a"];
          const symbols = { prefill: "circle", decode_batch_1: "diamond-open" };
          const symbol = (ph) => symbols[ph] || "diamond";
          const data = [{ x: d.roofline.intensity, y: d.roofline.attainable_tflops, mode: "lines", name: "roofline", line: { color: "#444" } }];
          ops.labels.forEach((label, i) => {
            const decodes = phases.filter((ph) => ph !== "prefill");
            // The move of each decode matmul with the batch, batch 1 to the chosen one.
            if (decodes.length > 1) data.push({ x: decodes.map((ph) => ops.phases[ph].intensity[i]), y: decodes.map((ph) => ops.phases[ph].achieved_tflops[i]),
              mode: "lines", line: { color: colors[i], dash: "dot", width: 1 }, showlegend: false, hoverinfo: "skip" });
            data.push({ x: phases.map((ph) => ops.phases[ph].intensity[i]), y: phases.map((ph) => ops.phases[ph].achieved_tflops[i]), mode: "markers", name: label,
              text: phases.map((ph) => ops.phase_labels[ph] + ": " + label + ", " + ops.phases[ph].bound[i] + "-bound, " + fmtNum(ops.phases[ph].time_ms[i]) + " ms"),
              hoverinfo: "text", marker: { size: 11, color: colors[i], symbol: phases.map(symbol), line: { width: 2, color: colors[i] } } });
          });
          for (const ph of phases) data.push({ x: [null], y: [null], mode: "markers", name: ops.phase_labels[ph], marker: { size: 10, color: "#777", symbol: symbol(ph) } });
          const xs = d.roofline.intensity;
          const all = phases.flatMap((ph) => ops.phases[ph].achieved_tflops);
          const ridge = limitShade(d.ridge_flops_per_byte, Math.max(...xs) * 1.5, "compute-bound beyond the ridge", "rgba(120,120,120,0.12)");
          Object.assign(ridge.annotation, { y: 0.02, yanchor: "bottom" });
          return { data, layout: baseLayout("Per operator: prefill, and decode at batch 1 and yours", "arithmetic intensity (FLOP/byte)", "attained TFLOP/s",
            { xaxis: logAxis(xs), yaxis: Object.assign(logAxis(d.roofline.attainable_tflops, all), { rangemode: "normal" }), rest: withShades([ridge]) }) };
        } },
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
      { id: "busy", make: (d) => ({
          data: [{ x: d.sweep.batch, y: d.sweep.busy_pct, mode: "lines+markers", name: "tensor cores busy", line: { color: "#6a1b9a" } },
                 { x: [d.sweep.batch[0]], y: [d.sweep.busy_pct[0]], mode: "markers+text", text: [(100 - d.sweep.busy_pct[0]).toFixed(1) + "% idle at batch 1"],
                   textposition: "top right", marker: { size: 10, color: "#6a1b9a" }, name: "batch 1", showlegend: false }],
          layout: (() => {
            const maxB = Math.max(...d.sweep.batch), minB = Math.min(...d.sweep.batch);
            const shades = batchShades(d, (b) => Math.max(b, minB / 1.5), { batch: maxB, x: maxB * 1.5 });
            return baseLayout("Tensor cores busy per decode step (% of the step)", "batch size", "busy (%)",
              { xaxis: pow2Axis(d.sweep.batch), yaxis: { range: [0, 100] }, rest: withShades(shades) });
          })() }) },
      { id: "frontier", make: (d) => {
          const fit = d.sweep.fits;
          const pick = (arr, want) => arr.map((v, i) => (fit[i] === want ? v : null));
          const wall = d.limits.memory.batch;
          const i = d.sweep.batch.findIndex((b) => b > wall);
          const shades = [];
          // Points left of the wall's per-user speed need more memory than there is: shade them.
          if (i >= 0 && wall > 0) {
            const xWall = d.sweep.tokens_per_s_per_user[Math.max(0, i - 1)];
            const xs = d.sweep.tokens_per_s_per_user;
            shades.push(limitShade(Math.min(...xs) / 1.3, xWall, "memory wall: " + d.limits.memory.label, NO_FIT, 0));
          }
          return {
            data: [
              { x: pick(d.sweep.tokens_per_s_per_user, true), y: pick(d.sweep.tokens_per_s_total, true), text: d.sweep.batch.map((b) => "batch " + b),
                mode: "lines+markers", name: "fits", line: { color: "#2d6cdf" } },
              { x: pick(d.sweep.tokens_per_s_per_user, false), y: pick(d.sweep.tokens_per_s_total, false), text: d.sweep.batch.map((b) => "batch " + b),
                mode: "lines+markers", name: "does not fit", line: { color: "#c62828", dash: "dot" } },
            ],
            layout: baseLayout("Frontier: total throughput against each user's speed", "tokens/s per user (log scale)", "total tokens/s",
              { xaxis: logAxis(d.sweep.tokens_per_s_per_user), rest: withShades(shades) }),
          };
        } },
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
      "Production targets are stated at a percentile: say p90 TTFT under 500 ms and p90 TPOT under 20 ms. The simulator below runs the engine's own scheduler on the cost model at a sustained Poisson request rate, long enough for a queue to build; the first fifth of the arrivals (the system filling from empty) is not measured.",
      "Raise the rate: batches grow, throughput rises, and the tails of both distributions move right until the SLOs break. Goodput counts only the requests that met every target; past saturation the system completes less than is offered and the queue grows without end.",
    ],
    controls: [...COMMON, ENGINE, num("rate", "request rate (req/s)", 0.1), num("ttft_slo_ms", "TTFT SLO (ms)"),
               num("tpot_slo_ms", "TPOT SLO (ms)"), num("prompt_len", "prompt tokens"), num("output_len", "output tokens")],
    charts: [
      { id: "goodput", wide: true, make: (d, narrow) => {
          const sw = d.sweep;
          const top = Math.max(...sw.arrived_rps, d.arrived_rps) * 1.05;
          // Labels in the right half of the axis sit left of their line, so none runs off the chart.
          const side = (x) => (x > top / 2 ? "right" : "left");
          const saturates = "saturates: at most" + (narrow ? "<br>" : " ") + fmtNum(sw.saturation_rps) + " req/s completed";
          // x is the rate the run's arrivals actually came at (a Poisson sample is not its nominal rate).
          // A sweep still running has no saturation yet: its rates so far are drawn, then the rest.
          const marks = [marker(d.arrived_rps, "your rate", "#c62828", "dot", narrow ? 0.24 : 0.18, side(d.arrived_rps))];
          if (sw.saturation_rps != null) marks.unshift(marker(sw.saturation_rps, saturates, "#555", "dash", 0, side(sw.saturation_rps)));
          if (sw.knee_rps != null) marks.push(marker(sw.knee_rps, "p90 targets break", "#e65100", "dashdot", narrow ? 0.15 : 0.09, side(sw.knee_rps)));
          return {
            data: [
              { x: [0, top], y: [0, top], mode: "lines", name: "completed = arrived", line: { color: "#bbb", dash: "dot" }, hoverinfo: "skip" },
              { x: sw.arrived_rps, y: sw.achieved_rps, mode: "lines+markers", name: "achieved (completed req/s)", line: { color: "#2d6cdf" } },
              { x: sw.arrived_rps, y: sw.goodput_rps, mode: "lines+markers", name: "goodput (met both p90 targets)", line: { color: "#43a047" } },
              { x: [d.arrived_rps], y: [d.achieved_rps], mode: "markers", name: "your rate: achieved", marker: { size: 13, symbol: "star", color: "#c62828" } },
            ],
            layout: baseLayout("Arrival rate against achieved rate and goodput", "arrival rate, measured (req/s)", "req/s",
              { xaxis: { range: [0, top] }, rest: withShades(marks) }),
          };
        } },
      { id: "latency-vs-rate", wide: true, make: (d) => {
          // Per-request TPOT averages a request's steps; per-token gaps (ITL) show the steps that carried a prefill.
          const sw = d.sweep, dash = { p50: "dot", p90: "dash", p99: "solid" };
          const lines = (pcts, what, color) => Object.keys(dash).map((k) => ({ x: sw.arrived_rps, y: pcts[k], mode: "lines+markers",
            name: what + " " + k, line: { color, dash: dash[k] }, marker: { size: 5 } }));
          const slo = marker(d.tpot_slo_ms, "", "#c62828", "solid").shape;
          return {
            data: [...lines(sw.tpot_pct_ms, "TPOT", "#e07b00"), ...lines(sw.itl_pct_ms, "ITL", "#6a1b9a")],
            layout: baseLayout("Per-request TPOT and per-token ITL against the arrival rate", "arrival rate, measured (req/s)", "ms",
              { rest: { shapes: [Object.assign(slo, { x0: 0, x1: 1, xref: "paper", y0: d.tpot_slo_ms, y1: d.tpot_slo_ms, yref: "y" })],
                        annotations: [{ x: 0, xref: "paper", xanchor: "left", y: d.tpot_slo_ms, yanchor: "bottom", text: "TPOT SLO",
                                        showarrow: false, font: { size: 11, color: "#c62828" } }] } }),
          };
        } },
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
      { id: "itl-cdf", make: (d) => ({
          data: cdfTraces(d.itl_ms, "ITL", "#6a1b9a"),
          layout: baseLayout("Per-token gaps (ITL, CDF)", "gap between tokens (ms, log scale)", "fraction of gaps", { xaxis: logAxis(d.itl_ms.x),
            rest: { shapes: pctShapes(d.itl_ms.percentiles, "#6a1b9a"), annotations: pctAnnotations(d.itl_ms.percentiles, "#6a1b9a", true) } }) }) },
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
      // Both policies' steps on one y-scale: the comparison of a stall with a chunk is the lesson.
      { id: "steps-" + mode, make: (d) => ({
          data: [{ type: "bar", x: d[mode].steps.start_ms, y: d[mode].steps.duration_ms, width: d[mode].steps.duration_ms, offset: 0,
                   marker: { color: d[mode].steps.prefill_tokens.map((t) => (t > 0 ? "#c62828" : "#2d6cdf")) },
                   hovertext: d[mode].steps.prefill_tokens.map((t) => (t > 0 ? t + " prefill tokens" : "decode only")), name: "step" }],
          layout: baseLayout(d[mode].label + ": step durations (red = carries prefill)", "time (ms)", "step duration (ms)",
            { yaxis: { range: [0, 1.08 * Math.max(d.prefill_first.longest_step_ms, d.chunked.longest_step_ms)] },
              rest: { xaxis: { title: { text: "time (ms)" }, range: d.time_range_ms } } }) }) },
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
      "The decode pool never stalls on a prefill, so the inter-token latency tail shrinks; the median need not improve (it is often slightly worse: fewer GPUs decode bigger batches), and TTFT pays the KV transfer and the smaller prefill pool.",
    ],
    controls: [...COMMON, ENGINE, num("rate", "request rate (req/s)", 0.1), num("prefill_gpus", "prefill GPUs"), num("decode_gpus", "decode GPUs"),
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
      "Weights take a fixed share of the accelerator; the rest holds KV cache, and each running sequence needs KV for its whole context. Smaller weight dtypes free memory for KV; smaller KV dtypes and grouped-query attention (GQA: fewer KV heads than query heads, against multi-head attention, MHA, with one each) shrink the KV per token.",
      "More sequences in memory means a bigger batch, and a bigger batch means more tokens/s per GPU, as long as each step stays within the TPOT target.",
    ],
    controls: [...COMMON, pick("attention", "attention", ["gqa", "mha"]), num("context", "context length (tokens)"), num("tpot_ms", "TPOT target (ms)")],
    charts: [
      { id: "max-batch", make: (d, narrow) => variantBars(d, d.variants.max_batch, "#2d6cdf", "largest batch",
          "Largest batch that fits at this context", "sequences", narrow) },
      { id: "capacity", make: (d, narrow) => variantBars(d, d.variants.tokens_per_s_per_gpu, "#43a047", "tokens/s",
          "Capacity at the TPOT target (tokens/s per GPU)", "tokens/s", narrow,
          d.variants.tokens_per_s_per_gpu.map((v, i) => (v ? fmtNum(v) + " · " : "") + d.variants.bar_label[i])) },
    ],
  },
  {
    id: "capacity", title: "7. Capacity and cost across accelerators",
    prose: [
      "Self-hosted capacity is tokens per second per GPU at a target TTFT and TPOT, not QPS. For each accelerator the planner (`servelab plan`, the same code) finds the most concurrent requests whose p90 TTFT and p90 TPOT both meet the targets, up to the most that run at once, and turns them into dollars per million output tokens. Clients queued for a slot or for memory are not users: their wait breaks the TTFT target.",
      "Each bar names the limit that bound it (the TTFT target, the TPOT target, or memory: the KV cache full, measured at the limit itself), and the command under the chart reproduces it. Until an accelerator's simulation ends its bar is pale: the roofline's upper bound, which can be far above the simulated answer.",
    ],
    controls: [...COMMON, ENGINE, num("ttft_ms", "TTFT target (ms)"), num("tpot_ms", "TPOT target (ms)"), num("prompt_len", "prompt tokens"), num("output_len", "output tokens")],
    charts: [
      { id: "tokens-per-gpu", make: (d) => ({
          data: [{ type: "bar", x: d.plan.hardware, y: d.plan.tokens_per_s_per_gpu, name: "tokens/s per GPU", text: d.plan.config.map((t) => wrap(t, 18)),
                   textposition: "outside", cliponaxis: false, hovertext: d.plan.command, hoverinfo: "text+y",
                   marker: { color: d.plan.status.map((s, i) => (s === "estimate" ? "rgba(45,108,223,0.3)" : d.plan.binds[i] === "memory" ? "#2d6cdf" : "#1b3f8b")),
                             line: { color: "#2d6cdf", width: d.plan.status.map((s) => (s === "estimate" ? 2 : 0)) } } }],
          layout: baseLayout("Output tokens/s per GPU at the TTFT and TPOT targets" + (d.status === "running" ? " (pale: upper bound from the roofline, simulating)" : ""),
            "", "tokens/s per GPU", { yaxis: { range: [0, Math.max(1, ...d.plan.tokens_per_s_per_gpu) * 1.3] } }) }) },
      { id: "cost", make: (d) => ({
          data: [{ type: "bar", x: d.plan.hardware, y: d.plan.usd_per_million_tokens, name: "$ per million tokens",
                   marker: { color: d.plan.status.map((s) => (s === "estimate" ? "rgba(67,160,71,0.3)" : "#43a047")) } }],
          layout: baseLayout("Cost per million output tokens", "", "$ / 1M tokens") }) },
    ],
  },
];

// The canonical capacity chart: throughput per GPU against speed per user, one Pareto curve per accelerator
// from `servelab plan`'s simulated levels (servelab/bench/pareto.py; `plan --plot` draws the same).
const PARETO_COLORS = ["#2d6cdf", "#e07b00", "#43a047", "#6a1b9a"];
function paretoHover(c, j) {
  const P = c.points, usd = P.usd_per_million_tokens[j];
  return c.hardware + " tp=" + P.tp[j] + ", " + P.concurrency[j] + " users<br>" + fmtNum(P.tokens_per_s_per_device[j]) + " tok/s per GPU, " +
    fmtNum(P.tokens_per_s_per_user[j]) + " tok/s per user<br>p90 TPOT " + fmtNum(P.tpot_ms[j]) + " ms, p90 TTFT " + fmtNum(P.ttft_ms[j]) + " ms" +
    (P.serves[j] ? "" : " (misses the TTFT target)") + "<br>" + (usd == null ? "no price in the catalog" : "$" + fmtNum(usd) + " per million output tokens");
}
function paretoFigure(d, narrow) {
  const data = [];
  d.curves.forEach((c, i) => {
    const P = c.points, color = PARETO_COLORS[i % PARETO_COLORS.length];
    const where = (keep) => P.pareto.map((p, j) => (keep(p) ? j : -1)).filter((j) => j >= 0);
    const trace = (idx, extra) => Object.assign({ x: idx.map((j) => P.tokens_per_s_per_user[j]), y: idx.map((j) => P.tokens_per_s_per_device[j]),
      hovertext: idx.map((j) => paretoHover(c, j)), hoverinfo: "text", legendgroup: c.hardware }, extra);
    data.push(trace(where((p) => p), { mode: "lines+markers", name: c.hardware, line: { color, width: 2 }, marker: { color, size: 7 } }));
    data.push(trace(where((p) => !p), { mode: "markers", name: c.hardware + " (dominated)", showlegend: false, marker: { color, size: 7, opacity: 0.25 } }));
    if (c.capacity) {
      const k = P.concurrency.findIndex((n, j) => n === c.capacity.concurrency && P.tp[j] === c.capacity.tp);
      data.push({ x: [c.capacity.tokens_per_s_per_user], y: [c.capacity.tokens_per_s_per_device], mode: "markers", name: c.hardware + " at the target",
        showlegend: false, legendgroup: c.hardware, hoverinfo: "text", hovertext: ["capacity at the target: " + paretoHover(c, k)],
        marker: { symbol: "star", size: narrow ? 13 : 16, color, line: { color: "#000", width: 1 } } });
    }
  });
  const line = marker(d.tpot_line_tokens_per_s_per_user, "TPOT " + fmtNum(d.config.tpot_ms) + " ms", "#c62828", "dash");
  return { data, layout: baseLayout("Throughput per GPU against speed per user (★: capacity at the target)", "output tokens/s per user (1 / p90 TPOT)",
    "output tokens/s per GPU", { rest: withShades([line]) }) };
}
LESSONS.splice(LESSONS.findIndex((l) => l.id === "capacity") + 1, 0, {
  id: "capacity-pareto", title: "7b. Capacity on the Pareto frontier",
  prose: [
    "Batching trades one user's speed for the GPU's total: more users per GPU, each served more slowly. Each point is one simulated concurrency (`servelab plan`'s search, then on past the first level that misses the TPOT target); the line joins the accelerator's Pareto-optimal points, those no other point beats on both axes. Faint points are dominated, or miss the TTFT target.",
    "The TPOT target is the dashed line at 1 / TPOT tokens/s per user. Capacity is the highest point on a curve right of it that meets both targets: the same tokens/s per GPU as `servelab plan`. Hover a point for its $ per million output tokens at the catalog price.",
  ],
  controls: [{ name: "accelerators", label: "accelerators (comma list, up to 4)", type: "text" }, "model", "weight_dtype", "kv_dtype", "tp", ENGINE,
             num("ttft_ms", "TTFT target (ms)"), num("tpot_ms", "TPOT target (ms)"), num("prompt_len", "prompt tokens"), num("output_len", "output tokens")],
  charts: [{ id: "pareto", wide: true, make: paretoFigure }],
});

LESSONS.push({
  id: "request-cost", title: "8. What a request costs",
  prose: [
    "A request's latency is its prefill (TTFT) plus one decode step per further output token: long outputs cost total latency even when every step is fast.",
    "Its cost is GPU time: its prefill alone on the GPU, plus its share of every decode step it rides in (1 / batch). Long prompts cost prefill, KV read on every step, and memory: past the KV limit fewer users fit, so each pays a bigger share. Set your own GPU price.",
  ],
  controls: [...COMMON, num("prompt_len", "prompt tokens"), num("output_len", "output tokens"), num("batch", "users sharing the GPU"),
             num("price_per_gpu_hour", "$ per GPU-hour (empty: catalog price)", 0.01, true)],
  charts: [
    { id: "latency", make: (d) => {
        const L = d.latency, lim = d.limits.output;
        const shades = lim ? [limitShade(lim.output_len, Math.max(...L.output_len) * 1.5, lim.label, NO_FIT, 0)] : [];
        return {
          data: [
            // Lines, not stacked areas: on a log axis a stacked band's height means nothing.
            { x: L.output_len, y: L.e2e_ms, mode: "lines", name: "end to end", line: { color: "#1d2330" } },
            { x: L.output_len, y: L.ttft_ms, mode: "lines", name: "TTFT (prefill)", line: { color: "#2d6cdf", dash: "dot" } },
            { x: L.output_len, y: L.decode_ms, mode: "lines", name: "decode steps", line: { color: "#e07b00", dash: "dash" } },
            { x: [d.selected.output_len], y: [d.selected.e2e_ms], mode: "markers", name: "your request", marker: { size: 13, symbol: "star", color: "#c62828" } },
          ],
          layout: baseLayout("Long outputs cost total latency", "output tokens", "end-to-end latency (ms, log scale)",
            { xaxis: pow2Axis(L.output_len), yaxis: Object.assign(logAxis(L.ttft_ms, L.decode_ms, L.e2e_ms), { rangemode: "normal" }), rest: withShades(shades) }),
        };
      } },
    { id: "money", make: (d) => {
        const M = d.money, lim = d.limits.prompt;
        const shades = lim ? [limitShade(lim.prompt_len, Math.max(...M.prompt_len) * 1.5, lim.label, NO_FIT, 0)] : [];
        return {
          data: [
            { x: M.prompt_len, y: M.total_usd, mode: "lines", name: "total", line: { color: "#1d2330" } },
            { x: M.prompt_len, y: M.prefill_usd, mode: "lines", name: "prefill", line: { color: "#2d6cdf", dash: "dot" } },
            { x: M.prompt_len, y: M.decode_usd, mode: "lines", name: "share of decode steps", line: { color: "#e07b00", dash: "dash" } },
            { x: [d.selected.prompt_len], y: [d.selected.usd_per_k_requests], mode: "markers", name: "your request", marker: { size: 13, symbol: "star", color: "#c62828" } },
          ],
          layout: baseLayout("Long prompts cost money ($ per " + d.per_requests.toLocaleString("en") + " requests)", "prompt tokens",
            "$ per " + d.per_requests.toLocaleString("en") + " requests (log scale)", { xaxis: pow2Axis(M.prompt_len),
              yaxis: Object.assign(logAxis(M.prefill_usd, M.decode_usd, M.total_usd), { rangemode: "normal" }), rest: withShades(shades) }),
        };
      } },
  ],
});

// The seed's design claims, each drawn from its own API answer (servelab/lab/seed_lessons.py).
const CAP_COLORS = ["#1d2330", "#2d6cdf", "#e07b00", "#43a047"];
LESSONS.push({
  id: "limits", title: "9. Put limits on both",
  prose: [
    "Real prompts and outputs have long tails: a few requests are ten or twenty times the typical one. The same heavy-tailed stream is simulated four times: without caps, with a prompt cap (longer prompts cut to it), with an output cap (max_tokens) and with both.",
    "A long prompt holds up every request behind it for its prefill (TTFT) and fills the KV cache; a long output keeps its sequence in the batch, and its growing context slows every step (TPOT). The cost is the GPU time of the same requests with the KV cache full of them.",
  ],
  controls: [...COMMON, ENGINE, num("rate", "request rate (req/s)", 0.1), num("prompt_len", "mean prompt tokens"), num("output_len", "mean output tokens"),
             num("prompt_cap", "prompt cap (tokens)"), num("output_cap", "output cap (tokens)")],
  charts: [
    { id: "tails", wide: true, make: (d, narrow) => {
        const v = d.variants;
        const series = [["ttft_p50_ms", "TTFT p50"], ["ttft_p99_ms", "TTFT p99"], ["tpot_p99_ms", "TPOT p99"], ["e2e_p99_ms", "end to end p99"]];
        // On a phone sixteen bar labels would sit on each other: the figures are in the hover and the tiles.
        const label = (i) => (narrow ? {} : { text: series.map((s) => fmtNum(v[s[0]][i])), textposition: "outside", cliponaxis: false, textfont: { size: 11 } });
        return {
          data: v.label.map((name, i) => Object.assign({ type: "bar", name, x: series.map((s) => s[1]), y: series.map((s) => v[s[0]][i]),
            marker: { color: CAP_COLORS[i] } }, label(i))),
          layout: baseLayout("Latency tails with and without caps", "", "ms (log scale)",
            { yaxis: Object.assign(logAxis(...series.map((s) => v[s[0]])), { rangemode: "normal" }), rest: { barmode: "group" } }),
        };
      } },
    { id: "ttft-cdf", make: (d) => ({
        data: d.variants.name.flatMap((n, i) => cdfTraces(d.ttft_ms[n], d.ttft_ms[n].label, CAP_COLORS[i])),
        layout: baseLayout("TTFT distribution (CDF)", "TTFT (ms, log scale)", "fraction of requests",
          { xaxis: logAxis(...d.variants.name.map((n) => d.ttft_ms[n].x)) }) }) },
    { id: "cost", make: (d, narrow) => {
        const v = d.variants;
        return {
          data: [{ type: "bar", x: v.label, y: v.usd_per_k_requests, name: "$ per 1,000 requests", marker: { color: CAP_COLORS },
                   text: v.usd_per_k_requests.map((x, i) => "$" + fmtNum(x) + (narrow ? "" : " · $" + fmtNum(v.usd_per_m_output_tokens[i]) + "/M out")),
                   textposition: "outside", cliponaxis: false, textfont: { size: 11 } }],
          layout: baseLayout("GPU cost at full load ($ per 1,000 requests)", "", "$ per 1,000 requests",
            { yaxis: { range: [0, Math.max(...v.usd_per_k_requests) * 1.3] } }),
        };
      } },
    { id: "lengths", make: (d) => {
        const caps = [["prompt", d.config.prompt_cap, "#2d6cdf"], ["output", d.config.output_cap, "#e07b00"]];
        return {
          data: caps.map(([k, , color]) => ({ x: d.lengths[k].x, y: d.lengths[k].cdf, mode: "lines", name: k + " lengths", line: { color, shape: "hv" } })),
          layout: baseLayout("The workload's lengths and the caps", "tokens (log scale)", "fraction of requests",
            { xaxis: logAxis(d.lengths.prompt.x, d.lengths.output.x, [d.config.prompt_cap, d.config.output_cap]),
              rest: withShades(caps.map(([k, cap, color], i) => {
                const m = marker(cap, k + " cap", color, "dash", 0.1 * i);
                m.annotation.x = Math.log10(cap); // log axis: an annotation's x in log10 units
                return m;
              })) }),
        };
      } },
  ],
});

LESSONS.push({
  id: "qps-vs-tokens", title: "10. Capacity is tokens/s, not QPS",
  prose: [
    "Two services each receive the same number of requests per second. One answers short chat turns; the other summarizes long documents. A request count says they are the same size.",
    "They are not: GPU time follows tokens (every prompt token's prefill, every output token's decode step), so capacity is stated as tokens per second per GPU at a target TPOT. Each workload runs at the largest batch that meets the target and fits the KV cache.",
  ],
  controls: [...COMMON, num("qps", "requests per second (both)", 0.1), num("tpot_ms", "TPOT target (ms)"),
             num("a_prompt_len", "A: prompt tokens"), num("a_output_len", "A: output tokens"),
             num("b_prompt_len", "B: prompt tokens"), num("b_output_len", "B: output tokens")],
  charts: [
    { id: "tokens", make: (d) => {
        const w = [d.workloads.a, d.workloads.b], x = w.map((v) => v.label);
        return {
          data: [
            { type: "bar", x, y: w.map((v) => v.prompt_tokens_per_s), name: "prompt tokens/s", marker: { color: "#2d6cdf" } },
            { type: "bar", x, y: w.map((v) => v.output_tokens_per_s), name: "output tokens/s", marker: { color: "#e07b00" },
              text: w.map((v) => fmtNum(v.tokens_per_s) + " tokens/s"), textposition: "outside", cliponaxis: false, textfont: { size: 11 } },
          ],
          layout: baseLayout("Same QPS, tokens per second", "", "tokens/s", { rest: { barmode: "stack" },
            yaxis: { range: [0, Math.max(...w.map((v) => v.tokens_per_s)) * 1.25] } }),
        };
      } },
    { id: "gpus", make: (d) => {
        const w = [d.workloads.a, d.workloads.b];
        return {
          data: [{ type: "bar", x: w.map((v) => v.label), y: w.map((v) => v.gpus), name: "GPUs needed", marker: { color: ["#43a047", "#c62828"] },
                   text: w.map((v) => fmtNum(v.gpus) + " GPUs (" + v.gpus_whole + " whole) · batch " + v.batch), textposition: "outside", cliponaxis: false, textfont: { size: 11 } }],
          layout: baseLayout("Same QPS, GPUs needed at the TPOT target", "", "GPUs", { yaxis: { range: [0, Math.max(...w.map((v) => v.gpus)) * 1.3] } }),
        };
      } },
    { id: "gpus-vs-qps", wide: true, make: (d) => ({
        data: [
          { x: d.sweep.qps, y: d.sweep.gpus_a, mode: "lines+markers", name: d.workloads.a.label, line: { color: "#43a047", shape: "hv" } },
          { x: d.sweep.qps, y: d.sweep.gpus_b, mode: "lines+markers", name: d.workloads.b.label, line: { color: "#c62828", shape: "hv" } },
        ],
        layout: baseLayout("GPUs against request rate", "requests per second (log scale)", "GPUs (log scale)",
          { xaxis: logAxis(d.sweep.qps), yaxis: Object.assign(logAxis(d.sweep.gpus_a, d.sweep.gpus_b), { rangemode: "normal" }),
            rest: (() => {
              const m = marker(d.config.qps, "your rate", "#555", "dot", 0);
              m.annotation.x = Math.log10(d.config.qps); // log axis: an annotation's x in log10 units
              return withShades([m]);
            })() }) }) },
  ],
});

LESSONS.push({
  id: "decode-chain", title: "11. One token at a time",
  prose: [
    "Each new token depends on the one before it: the model must have token n before it can compute token n + 1, so a sequence's decode steps run one after another and never in parallel.",
    "The simulator traces one sequence decoding among others (the batch): its prefill makes the first token, then every step adds one, each waiting for the last. Were the tokens known in advance (a prompt, or a draft to check), one step would compute them all.",
  ],
  controls: [...COMMON, ENGINE, num("prompt_len", "prompt tokens"), num("output_len", "output tokens"), num("batch", "sequences decoding together")],
  charts: [
    { id: "chain", wide: true, make: (d) => {
        const c = d.chain, n = c.token.length;
        // Arrows from each token to the next, as long as there are few enough to read.
        const arrows = n <= 64 ? c.token.slice(1).map((t, i) => ({ x: c.time_ms[i + 1], y: t, ax: c.time_ms[i], ay: c.token[i], xref: "x", yref: "y",
          axref: "x", ayref: "y", showarrow: true, arrowhead: 2, arrowsize: 1, arrowwidth: 1.5, standoff: 5, startstandoff: 5, arrowcolor: "#2d6cdf", text: "" })) : [];
        return {
          data: [
            { x: c.time_ms, y: c.token, mode: "markers", name: "token n, from token n - 1", marker: { size: 8, color: "#2d6cdf" },
              text: c.step_ms.map((s, i) => "token " + (i + 1) + ": its step " + fmtNum(s) + " ms"), hoverinfo: "text" },
            { x: [0, d.one_step_ms], y: [n, n], mode: "lines+markers", name: "all " + n + " tokens in one step, were they known",
              line: { color: "#c62828", width: 3 }, marker: { size: 8, color: "#c62828" } },
          ],
          layout: baseLayout("Each token waits for the one before it", "time since the request arrived (ms)", "output token",
            { rest: { annotations: arrows } }),
        };
      } },
    { id: "steps", wide: true, make: (d) => ({
        data: [{ type: "bar", x: d.chain.token, y: d.chain.step_ms, name: "step time", marker: { color: d.chain.token.map((t) => (t === 1 ? "#2d6cdf" : "#e07b00")) } }],
        layout: baseLayout("Each token's step (the first is the prefill, TTFT)", "output token", "ms (log scale)",
          { yaxis: Object.assign(logAxis(d.chain.step_ms), { rangemode: "normal" }) }) }) },
  ],
});

// Lesson 12: speculative decoding. The curves are the roofline's (servelab.cost.speculative), the dots the
// simulator's closed loops at a few concurrencies, the dashed green curve the server's measured acceptance, priced.
const SPEC_ALPHA_COLORS = { 0.5: "#9aa3b2", 0.7: "#2d6cdf", 0.9: "#6a1b9a" };
const specColor = (c) => (c.alpha == null ? "#c62828" : SPEC_ALPHA_COLORS[c.alpha] || "#c62828");
LESSONS.push({
  id: "speculative", title: "12. Spending the idle FLOPs",
  prose: [
    "At batch 1 a decode step leaves the arithmetic units idle almost all the time: it waits for the weights to stream in. Speculative decoding spends that idle compute on tokens: a cheap proposer (prompt lookup, or a small draft model) guesses K tokens, and one forward pass of the target checks all of them, reading the weights once. Each step keeps the accepted guesses plus one token of its own.",
    "The verification does K + 1 times the arithmetic of a decode step. While the step is memory-bound that is free; as the batch grows the arithmetic catches up with the bandwidth and the extra FLOPs start to cost, until speculation is slower than plain decoding: the crossover, the batching lesson seen from the other side. Higher acceptance moves it out.",
    "Under `servelab serve --speculative-config ...`, the lab reads your server's spec-decode counters and draws the curve its measured acceptance predicts (dashed green). That curve is a prediction: measuring the speedup itself needs the server run twice, with and without speculation.",
  ],
  controls: ["model", pick("hardware", "accelerator", (cat) => cat.speculative.hardware), "weight_dtype", "kv_dtype", "tp", ENGINE,
             pick("method", "proposer (ngram or draft model)", (cat) => cat.speculative.methods), num("num_speculative_tokens", "K (tokens proposed)"),
             num("acceptance", "acceptance α", 0.05), num("prompt_len", "prompt tokens"), num("output_len", "output tokens")],
  charts: [
    { id: "spec-speedup", wide: true, make: (d, narrow) => {
        const batches = d.curves[0].batch, maxB = Math.max(...batches);
        const data = d.curves.map((c) => ({ x: c.batch, y: c.speedup, mode: "lines", name: "roofline, " + c.label + (c.chosen ? " (yours)" : ""),
          line: { color: specColor(c), width: c.chosen ? 3 : 1.5 } }));
        const crossed = d.curves.filter((c) => c.crossover_batch != null && c.crossover_batch > 1);
        data.push({ x: crossed.map((c) => c.crossover_batch), y: crossed.map(() => 1), mode: "markers", name: "crossover (roofline)",
          text: crossed.map((c) => c.label + ": stops paying at batch " + c.crossover_batch.toLocaleString("en")),
          marker: { size: 11, symbol: "x", color: crossed.map(specColor), line: { width: 1, color: "#000" } } });
        const lv = d.sim.levels;
        data.push({ x: lv.map((l) => l.concurrency), y: lv.map((l) => l.speedup), mode: "markers", name: "simulator (concurrency)",
          text: lv.map((l) => "concurrency " + l.concurrency + ": TPOT " + fmtNum(l.plain_tpot_s * 1e3) + " → " + fmtNum(l.spec_tpot_s * 1e3) + " ms, " +
                        fmtNum(l.tokens_per_verification) + " tokens/verification, tok/s ×" + fmtNum(l.throughput_ratio)),
          marker: { size: 12, color: lv.map((l) => (l.pays ? "#43a047" : "#c62828")), line: { width: 1, color: "#000" } } });
        if (d.measured.available) data.push({ x: d.measured.curve.batch, y: d.measured.curve.speedup, mode: "lines", name: d.measured.curve.label,
          line: { color: "#2e7d32", dash: "dash", width: 2 } });
        const shades = [];
        const mem = d.limits.memory;
        if (mem.batch < maxB) shades.push(limitShade(Math.max(mem.batch, 1), maxB * 1.5, mem.label, NO_FIT, 0));
        const mine = d.curves.find((c) => c.chosen);
        if (mine.crossover_batch != null && mine.crossover_batch > 1) {
          const m = marker(mine.crossover_batch, "your crossover: batch " + mine.crossover_batch.toLocaleString("en"), "#c62828", "dot", 0.09);
          m.annotation.x = Math.log10(mine.crossover_batch); // annotations on a log axis take the exponent; shapes take the value
          shades.push(m);
        }
        const sh = withShades(shades);
        sh.shapes.push({ type: "line", xref: "paper", x0: 0, x1: 1, y0: 1, y1: 1, line: { color: "#000", width: 1.5, dash: "dash" } });
        sh.annotations.push({ xref: "paper", x: 0, y: 1, yanchor: "bottom", xanchor: "left", text: "1× (no gain)", showarrow: false, font: { size: 11, color: "#000" } });
        const ys = [...d.curves.flatMap((c) => c.speedup), ...lv.map((l) => l.speedup)];
        return { data, layout: baseLayout("Speedup per user against batch size", "decode batch (simulator: concurrency)", "speedup (plain TPOT ÷ speculative)",
          { xaxis: pow2Axis(batches), yaxis: { range: [0, Math.max(1.5, ...ys) * 1.08] },
            // On a phone the six legend entries stack below the plot: room for them under the axis title.
            rest: Object.assign(sh, narrow ? { height: 560, legend: { orientation: "h", y: -0.3, font: { size: 11 } } }
                                           : { legend: { orientation: "h", y: -0.25, font: { size: 11 } } }) }) };
      } },
    { id: "spec-tpot", make: (d) => {
        const mine = d.curves.find((c) => c.chosen), lv = d.sim.levels;
        return {
          data: [
            { x: mine.batch, y: mine.plain_tpot_ms, mode: "lines", name: "plain (roofline)", line: { color: "#555" } },
            { x: mine.batch, y: mine.spec_tpot_ms, mode: "lines", name: "speculative (roofline)", line: { color: "#c62828" } },
            { x: lv.map((l) => l.concurrency), y: lv.map((l) => l.plain_tpot_s * 1e3), mode: "markers", name: "plain (simulator)", marker: { size: 10, color: "#555", symbol: "circle-open" } },
            { x: lv.map((l) => l.concurrency), y: lv.map((l) => l.spec_tpot_s * 1e3), mode: "markers", name: "speculative (simulator)", marker: { size: 10, color: "#c62828" } },
          ],
          layout: baseLayout("TPOT with and without speculation", "decode batch (simulator: concurrency)", "TPOT (ms, log scale)",
            { xaxis: pow2Axis(mine.batch), yaxis: Object.assign(logAxis(mine.plain_tpot_ms, mine.spec_tpot_ms), { rangemode: "normal" }) }),
        };
      } },
    { id: "spec-tokens", make: (d) => {
        const lv = d.sim.levels, mine = d.curves.find((c) => c.chosen);
        const expected = mine.acceptance.expected_tokens_per_verification;
        return {
          data: [{ type: "bar", x: lv.map((l) => String(l.concurrency)), y: lv.map((l) => l.tokens_per_verification), name: "realised (simulator)", marker: { color: "#2d6cdf" } }],
          layout: baseLayout("Tokens per verification step", "concurrency", "tokens per sequence per step", { xaxis: { type: "category" }, rest: {
            shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: expected, y1: expected, line: { color: "#c62828", dash: "dash" } }],
            annotations: [{ xref: "paper", x: 1, y: expected, xanchor: "right", yanchor: "bottom", showarrow: false, font: { size: 11, color: "#c62828" },
              text: "expected " + fmtNum(expected) + " (K = " + mine.acceptance.acceptance_per_position.length + ")" }] } }),
        };
      } },
  ],
});

// The "your machine" panel: the engine's own metrics, polled, and a short load sent from this page to
// the server's own /v1/completions (its API key and limits apply), measured here and, with a profile,
// replayed through the simulator by api/live/predict.
const LIVE = {
  id: "live", title: "Your machine", live: true,
  prose: [
    "Everything else in the lab is predicted. Here the real engine answers: send a short load from this page to the server the lab runs in, and see the TTFT and TPOT it measured.",
    "With a calibrated profile the simulator replays exactly that traffic, and its prediction is drawn over the measurement, p50, p90 and p99 side by side. Calibrate measures this server from outside in the background (`servelab calibrate --base-url`, about two minutes); `servelab serve --profile profile.json` loads one made earlier. The profile's held-out error and the host's noise while it was measured say how far to trust it. The charts below the load read the engine's own metrics every two seconds.",
  ],
  controls: [num("requests", "requests"), num("concurrency", "concurrency"), num("prompt_words", "prompt words"), num("max_tokens", "output tokens"), num("think_ms", "pause after each request (ms)")],
  charts: [
    { id: "machine-ttft", load: true, make: (d) => loadHistogram(d, "ttft", "TTFT: measured" + (d.has_prediction ? " vs predicted" : ""), "TTFT (ms)") },
    { id: "machine-tpot", load: true, make: (d) => loadHistogram(d, "tpot", "TPOT: measured" + (d.has_prediction ? " vs predicted" : ""), "TPOT (ms)") },
    { id: "machine-percentiles", load: true, wide: true, placeholder: "… and their p50, p90 and p99, predicted beside measured", make: percentileBars },
    { id: "live-queue", make: (d) => ({
        data: [{ type: "bar", x: ["running", "waiting"], y: [d.running, d.waiting], marker: { color: ["#2d6cdf", "#e07b00"] }, name: "requests" }],
        layout: baseLayout("Requests", "", "requests") }) },
    { id: "live-kv", make: (d) => ({
        data: [{ type: "bar", orientation: "h", y: ["KV cache"], x: [d.kv_usage == null ? null : d.kv_usage * 100], name: "KV in use", marker: { color: "#43a047" } }],
        layout: baseLayout("KV cache in use (%)", "%", "", { xaxis: { range: [0, 100] }, rest: { height: 220 } }) }) },
    { id: "live-ttft", make: (d) => histogram(d.ttft_s, "TTFT histogram (all traffic)") },
    { id: "live-itl", make: (d) => histogram(d.itl_s, "Inter-token latency histogram (all traffic)") },
  ],
};

function loadHistogram(d, key, title, unit) {
  const h = d[key], e = h.edges_ms;
  const mids = e.slice(0, -1).map((lo, i) => Math.sqrt(lo * e[i + 1]));
  const widths = e.slice(0, -1).map((lo, i) => e[i + 1] - lo);
  const data = [{ type: "bar", x: mids, y: h.measured, width: widths, name: "measured", marker: { color: "rgba(45,108,223,0.7)" } }];
  if (d.has_prediction) data.push({ type: "bar", x: mids, y: h.predicted, width: widths, name: "predicted (simulator + profile)", marker: { color: "rgba(224,123,0,0.55)" } });
  return { data, layout: baseLayout(title, unit + ", log scale", "requests", { xaxis: logAxis(e), rest: { barmode: "overlay" } }) };
}

// p50, p90 and p99 of TTFT and TPOT, measured beside predicted, each prediction's error on its bar.
function percentileBars(d) {
  const x = [], measured = [], predicted = [], errors = [];
  for (const metric of ["TTFT", "TPOT"]) {
    const t = d.percentiles[metric];
    t.percentiles.forEach((p, i) => { x.push(metric + " " + p); measured.push(t.measured_ms[i]); predicted.push(t.predicted_ms[i]); errors.push(t.error_pct[i]); });
  }
  const data = [{ type: "bar", x, y: measured, name: "measured", marker: { color: "rgba(45,108,223,0.8)" },
                  text: measured.map((v) => (v == null ? "" : fmtNum(v))), textposition: "outside", cliponaxis: false, textfont: { size: 11 } }];
  if (d.has_prediction)
    data.push({ type: "bar", x, y: predicted, name: "predicted (simulator + profile)", marker: { color: "rgba(224,123,0,0.8)" },
                text: errors.map((e) => (e == null ? "" : (e >= 0 ? "+" : "") + Math.round(e) + "%")), textposition: "outside", cliponaxis: false,
                textfont: { size: 11 } });
  return { data, layout: baseLayout("p50 / p90 / p99: measured" + (d.has_prediction ? " beside predicted (error on the bar)" : ""), "",
    "ms (log scale)", { xaxis: { type: "category" }, yaxis: Object.assign(logAxis(measured, predicted), { rangemode: "normal" }), rest: { barmode: "group" } }) };
}

// The profile the prediction uses (its held-out error, the host's noise while it was measured) and
// the button that calibrates this server in the background (api/live/calibrate), with its progress.
function profileLine(p) {
  if (!p) return "No profile loaded: the prediction needs one. Calibrate measures this server from outside for about two minutes.";
  const held = p.held_out ? "held-out error median " + fmtNum(p.held_out.median_abs_pct) + "%, max " + fmtNum(p.held_out.max_abs_pct) + "% over " + p.held_out.count + " steps"
                          : "held-out error not recorded";
  const noise = !p.noise ? "host noise not recorded" : p.noise.noisy == null ? "host noise not measured"
    : (p.noise.noisy ? "host NOISY while calibrating" : "host quiet while calibrating") + (p.noise.spread_median_pct == null ? "" : " (median repeat " + fmtNum(p.noise.spread_median_pct) + "% over its fastest; " + p.noise.rule + ")");
  return "Profile " + p.path + " (" + p.model + ", " + p.source + "): " + held + "; " + noise + ".";
}
function calibrationLine(c) {
  if (c.state === "running") {
    const points = c.points_total ? c.points_done + " of " + c.points_total + " points" : "starting";
    return "calibrating: " + points + ", " + Math.round(c.elapsed_s) + " s of its " + c.budget_s + " s budget" + (c.current ? " (" + c.current + ")" : "");
  }
  if (c.state === "done") return "calibrated in " + Math.round(c.elapsed_s) + " s: the profile above is loaded; send a load to compare.";
  if (c.state === "failed" || c.state === "cancelled") return "calibration " + c.state + ": " + c.error;
  return "";
}
async function renderMachineProfile(lesson) {
  let box = $("machine-profile");
  if (!lesson.live || !state.live) { if (box) box.remove(); return; }
  if (!box) {
    box = document.createElement("div"); box.id = "machine-profile"; box.className = "machine-profile";
    const text = document.createElement("p"); text.id = "machine-profile-text";
    const button = document.createElement("button"); button.type = "button"; button.id = "calibrate";
    button.addEventListener("click", startCalibration);
    const status = document.createElement("p"); status.id = "calibrate-status"; status.setAttribute("role", "status");
    box.append(text, button, status);
    $("controls").after(box);
  }
  $("machine-profile-text").textContent = profileLine(state.setup.profile);
  const c = await fetch("api/live/calibrate").then((r) => r.json());
  showCalibration(c);
  if (c.state === "running") pollCalibration();
}
function showCalibration(c) {
  const button = $("calibrate"), status = $("calibrate-status");
  if (!button) return;
  button.disabled = c.state === "running";
  button.textContent = (state.setup.profile ? "Recalibrate" : "Calibrate") + " this server (~" + c.budget_s + " s)";
  status.textContent = calibrationLine(c);
  status.classList.toggle("error", c.state === "failed" || c.state === "cancelled");
}
async function startCalibration() {
  const response = await fetch("api/live/calibrate", { method: "POST", headers: { "Content-Type": "application/json" }, body: "{}" });
  const body = await response.json();
  if (!response.ok) { $("calibrate-status").textContent = (body.error && body.error.message) || response.statusText; $("calibrate-status").classList.add("error"); return; }
  showCalibration(body);
  pollCalibration();
}
function pollCalibration() {
  clearTimeout(state.calibrationTimer);
  state.calibrationTimer = setTimeout(async () => {
    const c = await fetch("api/live/calibrate").then((r) => r.json());
    if (c.state === "done") {
      state.setup = await fetch("api/live/setup").then((r) => r.json());
      const text = $("machine-profile-text");
      if (text) text.textContent = profileLine(state.setup.profile);
    }
    showCalibration(c);
    if (c.state === "running") pollCalibration();
  }, 1000);
}

function histogram(h, title) {
  const labels = h ? h.le.map((le) => (le == null ? "+Inf" : "≤ " + le + " s")) : [];
  return { data: [{ type: "bar", x: labels, y: h ? h.counts : [], name: "count" }], layout: baseLayout(title, "bucket", "count") };
}

// ---------------------------------------------------------------------------------------------

const state = { catalog: null, lesson: null, seq: 0, liveTimer: null, live: false, load: null, setup: null, ruleHandler: null,
                progressTimer: null, startedAt: 0 };
window.lab = { renders: 0, last: null, errors: 0, frames: [] };
const $ = (id) => document.getElementById(id);

function lessonById(id) {
  return [...LESSONS, LIVE].find((l) => l.id === id) || LESSONS[0];
}

function controlSpec(c, lesson) {
  if (typeof c !== "string") {
    if (c.type === "select" && typeof c.options === "function") return Object.assign({}, c, { options: c.options(state.catalog) });
    if (c.type !== "number") return c;
    const lim = (state.catalog.limits[lesson.id] || {})[c.name];
    if (!lim) throw new Error("the API publishes no limits for " + lesson.id + "." + c.name);
    return Object.assign({}, c, { min: lim.min, max: lim.max });
  }
  const cat = state.catalog;
  const labels = { model: "model", hardware: "accelerator", weight_dtype: "weight dtype", kv_dtype: "KV dtype", tp: "tensor parallel",
                   engine_profile: "engine defaults" };
  const options = { model: cat.models.map((m) => m.name), hardware: cat.hardware.map((h) => h.name),
                    weight_dtype: cat.weight_dtypes, kv_dtype: cat.kv_dtypes, tp: cat.tp.map(String),
                    engine_profile: cat.engine_profiles.map((p) => p.name) }[c];
  return pick(c, labels[c], options);
}

function buildNav() {
  const nav = $("nav");
  nav.innerHTML = "";
  for (const l of [...LESSONS, LIVE]) {
    const a = document.createElement("a");
    a.href = "?lesson=" + l.id;
    a.textContent = l.title;
    a.dataset.lesson = l.id;
    if (l.live) a.className = state.live ? "live" : "live off";
    a.addEventListener("click", (e) => { e.preventDefault(); openLesson(l.id, {}); });
    nav.appendChild(a);
  }
}

// A slider beside each number box. Wide ranges slide on a log scale so the small values stay reachable;
// the box stays the exact value, and both move together.
const SLIDER_STEPS = 1000;
function sliderFor(input, c, instant) {
  const lo = Number(c.min), hi = Number(c.max);
  const log = lo > 0 && hi / lo > 100;
  const toPos = (v) => (log ? Math.log(v / lo) / Math.log(hi / lo) : (v - lo) / (hi - lo)) * SLIDER_STEPS;
  const fromPos = (p) => {
    const f = p / SLIDER_STEPS;
    let v = log ? lo * (hi / lo) ** f : lo + f * (hi - lo);
    const step = Number(c.step) || 1;
    v = Math.round(v / step) * step;
    if (v >= 10) v = Number(v.toPrecision(step < 1 ? 3 : 2)); // round slider values to readable figures
    return Math.min(hi, Math.max(lo, Number(v.toFixed(step < 1 ? 2 : 0))));
  };
  const range = document.createElement("input");
  range.type = "range"; range.min = 0; range.max = SLIDER_STEPS; range.step = 1; range.className = "slider";
  range.id = "slider-" + c.name; range.setAttribute("aria-label", c.label + " (slider)");
  const sync = () => { const v = Number(input.value); if (input.value !== "" && Number.isFinite(v)) range.value = toPos(Math.min(hi, Math.max(lo, v))); };
  // A lesson the roofline answers in milliseconds follows the thumb; a simulated one waits for the release.
  range.addEventListener("input", () => { input.value = fromPos(Number(range.value)); if (instant) refreshLatest(true); });
  range.addEventListener("change", () => { input.value = fromPos(Number(range.value)); if (instant) refreshLatest(false); else refresh(); });
  input.addEventListener("input", sync);
  sync();
  return { range, sync };
}

function buildControls(lesson, values) {
  const form = $("controls");
  form.innerHTML = "";
  form.hidden = lesson.controls.length === 0 || (lesson.live && !state.live);
  const defaults = (lesson.live ? state.setup.defaults : state.catalog.defaults[lesson.id]) || {};
  for (const raw of lesson.controls) {
    const c = controlSpec(raw, lesson);
    const label = document.createElement("label");
    label.textContent = c.label;
    let input, slider = null;
    if (c.type === "select") {
      input = document.createElement("select");
      for (const o of c.options) {
        const opt = document.createElement("option");
        opt.value = o; opt.textContent = o;
        input.appendChild(opt);
      }
    } else if (c.type === "text") {
      input = document.createElement("input");
      input.type = "text"; input.required = true;
    } else {
      input = document.createElement("input");
      input.type = "number"; input.min = c.min; input.max = c.max; input.step = c.step; input.required = !c.optional;
      if (c.optional) input.placeholder = "default";
    }
    input.name = c.name; input.id = "ctl-" + c.name;
    const v = values[c.name] !== undefined ? values[c.name] : defaults[c.name];
    if (v !== undefined && v !== null) input.value = v;
    if (!lesson.live) input.addEventListener("change", () => { if (slider) slider.sync(); refresh(); });
    if (c.type === "number") slider = sliderFor(input, c, state.catalog.instant_lessons.includes(lesson.id));
    label.appendChild(input);
    if (slider) label.appendChild(slider.range);
    form.appendChild(label);
  }
  if (state.ruleHandler) { form.removeEventListener("input", state.ruleHandler); form.removeEventListener("change", state.ruleHandler, true); }
  state.ruleHandler = null;
  if (!lesson.live) {
    state.ruleHandler = () => applyContextRule(lesson);
    applyContextRule(lesson);
    form.addEventListener("input", state.ruleHandler);
    form.addEventListener("change", state.ruleHandler, true); // capture: before the refresh that validates
  }
  if (lesson.live && state.live) {
    const button = document.createElement("button");
    button.type = "button"; button.id = "send-load"; button.textContent = "Send load";
    button.addEventListener("click", sendLoad);
    form.appendChild(button);
  }
}

// A lesson's lengths must fit the chosen model's context (the catalog's rule, the API's own check):
// each length's max is lowered to what the model and the other lengths leave, so the form refuses
// what the lesson would.
function applyContextRule(lesson) {
  const rule = (state.catalog.context_rules || {})[lesson.id];
  const modelSel = $("ctl-model");
  if (!rule || !modelSel) return;
  const model = state.catalog.models.find((m) => m.name === modelSel.value);
  if (!model) return;
  const [num, den] = rule.spread;
  // floor(num × total / den) <= max_context  <=>  total <= floor((den × max_context + den - 1) / num)
  const total = Math.floor((den * model.max_context + den - 1) / num) - rule.extra;
  for (const name of rule.fields) {
    const el = $("ctl-" + name);
    if (!el) continue;
    const others = rule.fields.filter((f) => f !== name).reduce((sum, f) => sum + (Number($("ctl-" + f).value) || 0), 0);
    const published = state.catalog.limits[lesson.id][name].max;
    el.max = Math.max(Number(el.min) || 1, Math.min(published, total - others));
  }
}

function currentParams() {
  const params = new URLSearchParams();
  for (const el of $("controls").elements) if (el.name) params.set(el.name, el.value);
  return params;
}

function invalidControls() {
  const bad = [];
  for (const el of $("controls").elements) {
    if (!el.name) continue;
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
  $("formulas").hidden = true;
  $("commands").hidden = true;
  for (const chart of $("charts").children) Plotly.purge(chart);
  $("charts").hidden = true;
  $("charts").classList.remove("stale");
}

function renderStats(stats) {
  const summary = $("summary");
  summary.innerHTML = "";
  for (const s of stats || []) {
    const div = document.createElement("div");
    div.className = "stat";
    const b = document.createElement("b"); b.textContent = s.value;
    const span = document.createElement("span"); span.textContent = s.label;
    div.append(b, span);
    summary.appendChild(div);
  }
}

// The roofline terms behind the numbers, as the API computed them: shown beside the charts.
function renderFormulas(formulas) {
  const box = $("formulas");
  box.hidden = !formulas || !formulas.length;
  const body = $("formulas-body");
  body.innerHTML = "";
  for (const f of formulas || []) {
    const h = document.createElement("h3"); h.textContent = f.title;
    const pre = document.createElement("pre"); pre.textContent = f.lines.filter((l) => l).join("\n");
    body.append(h, pre);
  }
}

// The `servelab plan` command behind each bar of the capacity lesson.
function renderCommands(commands) {
  $("commands").hidden = !commands || !commands.length;
  $("commands-body").textContent = (commands || []).join("\n");
}

function draw(chart, fig) {
  const narrow = $("chart-" + chart.id).clientWidth < 520;
  const title = fig.layout.title;
  if (title && title.text && narrow) {
    // Plotly titles never wrap: on a phone, break a long one at its colon so it is not clipped.
    title.text = title.text.includes(": ") ? title.text.replace(": ", ":<br>") : wrap(title.text, 40);
    title.font = Object.assign({}, title.font, { size: 13 });
    fig.layout.margin = Object.assign({ l: 64, r: 20, b: 52 }, fig.layout.margin, { t: 60 });
  }
  const shadeLabels = narrow ? (fig.layout.annotations || []).filter((a) => a.name === SHADE_LABEL) : [];
  if (shadeLabels.length) {
    // On a phone a limit's name would cover the curves that run into its shade: it joins the legend.
    fig.layout.annotations = fig.layout.annotations.filter((a) => a.name !== SHADE_LABEL);
    fig.data = [...fig.data, ...shadeLabels.map((a) => ({ x: [null], y: [null], mode: "markers", name: wrap(a.text.replace(/<br>/g, " "), 40),
      marker: { symbol: "square", size: 12, color: a.font.color, opacity: 0.3 }, hoverinfo: "skip" }))];
  }
  if (narrow && fig.data.length > 1 && fig.layout.showlegend !== false) {
    // A phone's legend wraps to several rows: anchor it by its top, below the x-axis title, and make room.
    fig.layout.legend = Object.assign({}, fig.layout.legend, { orientation: "h", yanchor: "top", y: -0.3, font: { size: 11 } });
    // Room for a row per entry at worst (a long name takes a row of its own), beside a plot of 240 px.
    const entries = fig.data.filter((t) => t.showlegend !== false).length;
    const bottom = Math.max(130, 80 + 21 * entries, (fig.layout.margin && fig.layout.margin.b) || 0);
    fig.layout.margin = Object.assign({}, fig.layout.margin, { b: bottom });
    fig.layout.height = Math.max(fig.layout.height || 0, 440, bottom + fig.layout.margin.t + 240);
  }
  Plotly.react("chart-" + chart.id, fig.data, fig.layout, { displaylogo: false, responsive: true });
}

function render(lesson, data, visibleOnly) {
  $("error").hidden = true;
  $("warning").textContent = data.warning || "";
  $("warning").hidden = !data.warning;
  $("charts").hidden = false;
  // A capacity plan's pale bars are estimates; the SLO lesson's first stage is final for its rate, only the sweep is to come.
  $("charts").classList.toggle("stale", data.status === "running" && !data.sweep);
  $("notice").textContent = (lesson.live && state.load ? state.load.notice : data.notice) || "";
  renderStats(lesson.live && state.load ? [...state.load.stats, ...(data.stats || [])] : data.stats);
  renderFormulas(data.formulas);
  renderCommands(data.commands || (data.plan && data.plan.command));
  for (const chart of lesson.charts) {
    const el = $("chart-" + chart.id);
    if (visibleOnly && !onScreen(el)) continue;
    const narrow = el.clientWidth < 520;
    let fig;
    if (data.no_fit) fig = noFitFigure(data.no_fit.label);
    else if (chart.load) fig = state.load ? chart.make(state.load, narrow) : placeholder(chart.placeholder || (chart.id === "machine-ttft" ? "press Send load to measure TTFT" : "… and TPOT"));
    else fig = chart.make(data, narrow);
    draw(chart, fig);
  }
  window.lab.last = { lesson: lesson.id, data };
  window.lab.renders += 1;
  document.body.dataset.renders = String(window.lab.renders);
}

const placeholder = (text) => ({ data: [], layout: baseLayout("", "", "", { xaxis: { visible: false }, yaxis: { visible: false },
  rest: { annotations: [{ x: 0.5, y: 0.5, xref: "paper", yref: "paper", text, showarrow: false, font: { size: 13, color: "#5b6475" } }] } }) });

function countError() {
  window.lab.errors += 1;
  document.body.dataset.errors = String(window.lab.errors);
}

// While a slider is dragged: at most one request in flight, and the last one sent carries the latest
// value (values passed over while one was in flight are coalesced into it).
// Mid-drag, only the charts at least half on screen are redrawn (Plotly takes 10-60 ms a chart, and a
// sliver at the window's edge is not what the reader watches); the release redraws all.
const dragging = { inFlight: false, pending: false, visibleOnly: true };
function refreshLatest(visibleOnly) {
  if (dragging.inFlight) {
    dragging.visibleOnly = dragging.pending ? dragging.visibleOnly && visibleOnly : visibleOnly;
    dragging.pending = true;
    return;
  }
  dragging.inFlight = true;
  refresh(false, visibleOnly).finally(() => {
    dragging.inFlight = false;
    if (dragging.pending) { dragging.pending = false; refreshLatest(dragging.visibleOnly); }
  });
}
const onScreen = (el) => {
  const r = el.getBoundingClientRect();
  return r.height > 0 && Math.min(r.bottom, window.innerHeight) - Math.max(r.top, 0) >= r.height / 2;
};

// "computing… 1.2 s" while an answer is on its way (shown once it takes longer than a frame or two).
const PROGRESS_AFTER_MS = 150;
function showProgress(seq, startedAt) {
  clearInterval(state.progressTimer);
  const tick = () => {
    const elapsed = performance.now() - startedAt;
    if (seq !== state.seq) return;
    $("progress").hidden = elapsed < PROGRESS_AFTER_MS;
    $("progress").textContent = "computing… " + (elapsed / 1000).toFixed(1) + " s";
  };
  tick();
  state.progressTimer = setInterval(tick, 100);
}
function hideProgress() {
  clearInterval(state.progressTimer);
  $("progress").hidden = true;
}

async function refresh(poll, visibleOnly) {
  const lesson = state.lesson;
  const params = currentParams();
  const query = new URLSearchParams(lesson.live ? {} : params);
  query.set("lesson", lesson.id);
  history.replaceState(null, "", "?" + query.toString());
  if (lesson.live && !state.live) return showMachineSetup();
  const bad = invalidControls();
  if (bad.length && !lesson.live) { showError(bad.join("\n")); countError(); return; }
  const seq = ++state.seq;
  const sentAt = performance.now();
  if (!poll) state.startedAt = sentAt; // a capacity plan's polls count from the first request
  showProgress(seq, state.startedAt);
  document.body.classList.add("busy");
  // The old charts stay, dimmed, until the new numbers arrive; the roofline's come within a frame, undimmed.
  // A poll leaves them as its last answer drew them (the SLO lesson's first stage stays undimmed).
  if (!poll && !state.catalog.instant_lessons.includes(lesson.id)) $("charts").classList.add("stale");
  let polling = false;
  try {
    // A lesson is a JSON POST of the form's values (strings, as typed: the server validates them).
    const response = lesson.live ? await fetch("api/live") : await fetch("api/lessons/" + lesson.id, {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(Object.fromEntries(params)),
    });
    const body = await response.json();
    const answeredMs = performance.now() - sentAt;
    if (seq !== state.seq) return; // a newer request superseded this one
    if (response.status === 202) {
      // A long computation (the capacity plan, the SLO sweep) runs on the server: draw its partial result, show progress, poll.
      if (body.plan || body.sweep) render(lesson, body);
      if (!body.sweep) $("notice").textContent = body.message; // the SLO note already says what is still running
      setTimeout(() => { if (seq === state.seq) refresh(true); }, 700);
      polling = true;
      return;
    }
    if (!response.ok) {
      showError((body.error && body.error.message) || response.statusText);
      countError();
    } else {
      render(lesson, body, visibleOnly);
      // Request to redraw, for the drag test and anyone timing the page: the last 200.
      window.lab.frames.push({ lesson: lesson.id, ms: performance.now() - sentAt, answered_ms: answeredMs });
      if (window.lab.frames.length > 200) window.lab.frames.shift();
    }
  } finally {
    if (seq === state.seq && !polling) { document.body.classList.remove("busy"); hideProgress(); }
  }
}

// Without an engine, the panel says how to get one, and shows the profile it was given.
function showMachineSetup() {
  const setup = state.setup || {};
  const lines = ["This panel needs the real engine: run `servelab serve` (add `--profile profile.json` from `servelab calibrate` for the prediction) and open its /lab/."];
  if (setup.profile) {
    const c = setup.profile.coefficients;
    lines.push("Profile " + setup.profile.path + " (model " + setup.profile.model + "): per step " + fmtNum(c.per_step_s * 1e3) + " ms, per token " +
               fmtNum(c.per_token_s * 1e3) + " ms, per sequence " + fmtNum(c.per_seq_s * 1e3) + " ms, per context token " + fmtNum(c.per_context_token_s * 1e6) + " µs.");
    lines.push(profileLine(setup.profile));
  }
  $("error").hidden = true;
  $("warning").textContent = lines.join("\n");
  $("warning").hidden = false;
  $("notice").textContent = "";
  $("summary").innerHTML = "";
  $("formulas").hidden = true;
  $("commands").hidden = true;
  $("charts").hidden = true;
  window.lab.last = { lesson: "live", data: { status: "no-engine", setup } };
  window.lab.renders += 1;
  document.body.dataset.renders = String(window.lab.renders);
}

const WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak tree".split(" ");

// One streamed completion: when it was sent, its first and last content chunk, and the server's token counts.
async function oneRequest(model, prompt, maxTokens, t0) {
  const now = () => (performance.now() - t0) / 1000;
  const rec = { sent_s: now(), ok: false, first_token_s: null, last_token_s: null, prompt_tokens: 0, output_tokens: 0 };
  try {
    const r = await fetch("../v1/completions", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model, prompt, max_tokens: maxTokens, stream: true, stream_options: { include_usage: true }, ignore_eos: true, temperature: 0 }) });
    if (!r.ok) { const b = await r.json().catch(() => ({})); throw new Error((b.error && b.error.message) || r.statusText); }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      const t = now();
      buf += dec.decode(value, { stream: true });
      let k;
      while ((k = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, k); buf = buf.slice(k + 2);
        if (!ev.startsWith("data: ") || ev === "data: [DONE]") continue;
        const j = JSON.parse(ev.slice(6));
        if (j.choices && j.choices.length && j.choices[0].text) { if (rec.first_token_s == null) rec.first_token_s = t; rec.last_token_s = t; }
        if (j.usage) { rec.prompt_tokens = j.usage.prompt_tokens; rec.output_tokens = j.usage.completion_tokens; }
      }
    }
    rec.ok = rec.first_token_s != null;
  } catch (e) {
    rec.error = String(e.message || e);
  }
  return rec;
}

async function sendLoad() {
  const bad = invalidControls();
  if (bad.length) { showError(bad.join("\n")); countError(); return; }
  const v = Object.fromEntries(currentParams());
  const n = Number(v.requests), c = Number(v.concurrency), words = Number(v.prompt_words), maxTokens = Number(v.max_tokens);
  const thinkMs = Number(v.think_ms);
  const button = $("send-load");
  button.disabled = true;
  try {
    const models = await fetch("../v1/models").then((r) => r.json());
    const model = models.data[0].id;
    const prompt = Array.from({ length: words }, (_, i) => WORDS[i % WORDS.length]).join(" ");
    const t0 = performance.now(), records = new Array(n);
    let next = 0, done = 0;
    const worker = async () => {
      while (next < n) {
        const i = next++;
        records[i] = await oneRequest(model, prompt, maxTokens, t0);
        done += 1;
        $("notice").textContent = "measuring: " + done + " of " + n + " requests done";
        // the client's pause before its next request; the replay's clients pause as long
        if (thinkMs > 0 && next < n) await new Promise((resolve) => setTimeout(resolve, thinkMs));
      }
    };
    await Promise.all(Array.from({ length: Math.min(c, n) }, worker));
    const failed = records.filter((r) => !r.ok);
    const response = await fetch("api/live/predict", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ concurrency: c, think_ms: thinkMs, records }) });
    const body = await response.json();
    if (!response.ok) { showError((body.error && body.error.message) || response.statusText); countError(); return; }
    if (failed.length) body.notice = failed.length + " request(s) failed (" + failed[0].error + "); " + body.notice;
    state.load = body;
    window.lab.load = body;
    await refresh();
  } finally {
    button.disabled = false;
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
  if (!lesson.live) {
    // Every lesson points at the one place where prediction meets measurement.
    const p = document.createElement("p"); p.className = "machine-link";
    const a = document.createElement("a"); a.href = "?lesson=live"; a.id = "machine-link";
    a.textContent = state.live ? "Measure the real engine on your machine, against the simulator's prediction →"
                               : "Your machine: prediction against measurement, under servelab serve →";
    a.addEventListener("click", (e) => { e.preventDefault(); openLesson("live", {}); });
    p.appendChild(a); $("prose").appendChild(p);
  }
  for (const a of $("nav").children) a.classList.toggle("active", a.dataset.lesson === lesson.id);
  buildControls(lesson, values);
  renderMachineProfile(lesson);
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
  if (lesson.live && state.live) state.liveTimer = setInterval(refresh, 2000);
}

async function main() {
  const [catalog, health, setup] = await Promise.all(["api/catalog", "api/health", "api/live/setup"].map((u) => fetch(u).then((r) => r.json())));
  state.catalog = catalog;
  state.live = health.live;
  state.setup = setup;
  buildNav();
  const query = new URLSearchParams(location.search);
  const values = Object.fromEntries(query.entries());
  openLesson(values.lesson || LESSONS[0].id, values);
}

main();
