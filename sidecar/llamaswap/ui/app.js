// The page at /ui: polls the admin server's /ui/state (a 304 when nothing changed) and
// /ui/timeline, and draws the GPU now, the queue, the timeline, the counters, the Batch API's
// batches and one request.
// Plain JavaScript, no build step, nothing from the network but this origin.
"use strict";

(function main() {
  const POLL_MS = 500;
  const TICK_MS = 250;
  const RETRY_MAX_MS = 3000;
  const DAY_MS = 86400000;
  const ZOOM_MIN_MS = 10000;
  const SVG = "http://www.w3.org/2000/svg";
  const BANDS = ["interactive", "normal", "batch"];
  const LANES = { top: 24, height: 44, gap: 10, labelWidth: 58, markHeight: 16 };

  const page = {
    doc: null, // the last /ui/state document
    etag: null,
    offsetMs: 0, // server clock - this clock, from the last state
    instance: null,
    entries: [], // timeline entries, oldest first
    lastSeq: 0,
    loadedSinceMs: null,
    zoomMs: 3600000,
    failures: 0,
    findId: null,
    findDoc: null,
    findSeq: -1,
  };

  const byId = (id) => document.getElementById(id);

  function escapeHtml(value) {
    return String(value).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", "\"": "&quot;", "'": "&#39;" })[c]);
  }

  function seconds(value) {
    if (value === null || value === undefined || Number.isNaN(value)) {
      return "–";
    }
    const s = Math.max(0, value);
    if (s < 10) {
      return `${s.toFixed(2)} s`;
    }
    if (s < 60) {
      return `${s.toFixed(1)} s`;
    }
    if (s < 3600) {
      return `${Math.floor(s / 60)} m ${String(Math.floor(s % 60)).padStart(2, "0")} s`;
    }
    return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} m`;
  }

  // An estimate the sidecar cannot tell is null: "unknown", never a time known to be wrong.
  const startIn = (value) => (value === null || value === undefined ? "unknown" : seconds(value));

  const score = (value) => (value === null || value === undefined ? "–" : Number(value).toFixed(2));
  const clock = (ms) => new Date(ms).toLocaleTimeString([], { hour12: false });
  const serverNow = () => Date.now() + page.offsetMs;
  const band = (name) => `<span class="band band-${escapeHtml(name)}">${escapeHtml(name)}</span>`;
  const model = (name) => escapeHtml(name === null || name === undefined ? "–" : name);
  // A GPU's resident models, comma-separated ("–": none known).
  const models = (names) => (names && names.length ? names.map(escapeHtml).join(", ") : "–");

  // A line of a batch runs with the x-request-id BATCH_ID:CUSTOM_ID: the batch it belongs to, or null.
  function batchOf(requestId) {
    const match = /^(batch_[A-Za-z0-9]+):(.*)$/.exec(requestId);
    return match ? { batch: match[1], line: match[2] } : null;
  }

  // A request id cell's content: the id, and a "batch" tag on a batch's line (its batch id cut
  // short, whole in the title and the Batches panel).
  function requestIdHtml(requestId) {
    const line = batchOf(requestId);
    if (!line) {
      return escapeHtml(requestId);
    }
    const short = line.batch.length > 14 ? `${line.batch.slice(0, 12)}…` : line.batch;
    return `<span title="${escapeHtml(requestId)}">${escapeHtml(short)}:${escapeHtml(line.line)}</span>` +
      `<span class="tag" title="line ${escapeHtml(line.line)} of ${escapeHtml(line.batch)}">batch</span>`;
  }

  // A Batch API line's progress (a row's `line`) as a note after its id: waiting, how often it
  // was stopped and the tokens it resumes from; running, its stops so far and its tokens now,
  // "stopping" first once a stop was asked of it. Nothing for a line never stopped (nor,
  // waiting, with no tokens kept) or another request.
  function lineNoteHtml(line, running) {
    const stopping = running && line && line.stopping === true;
    if (!line || !(line.stops || stopping || (line.tokens && !running))) {
      return "";
    }
    const tokens = `${line.tokens.toLocaleString()} token${line.tokens === 1 ? "" : "s"}${running ? "" : " kept"}`;
    const counted = line.stops ? `stopped ${line.stops}x, ${tokens}` : tokens;
    const text = stopping ? `stopping, ${counted}` : counted;
    const title = running ? "stopped for a higher band and resumed where it stopped" :
      "it resumes from the tokens kept when its part was stopped or its stream broke";
    return `<span class="line-note" title="${title}">${escapeHtml(text)}</span>`;
  }

  // -- fetching ---------------------------------------------------------------------------

  async function getJson(url) {
    const response = await fetch(url, { cache: "no-store" });
    if (!response.ok) {
      throw new Error(`${url}: HTTP ${response.status}`);
    }
    return response.json();
  }

  async function poll() {
    try {
      const headers = page.etag ? { "If-None-Match": page.etag } : {};
      const response = await fetch("/ui/state", { headers, cache: "no-store" });
      const serverMs = Number(response.headers.get("x-llamaswap-now-ms"));
      if (serverMs) {
        page.offsetMs = serverMs - Date.now();
      }
      if (response.status === 200) {
        const doc = await response.json();
        page.etag = response.headers.get("etag");
        accept(doc);
      } else if (response.status !== 304) {
        throw new Error(`/ui/state: HTTP ${response.status}`);
      }
      if (page.doc.timeline_seq !== page.lastSeq) {
        await loadTimeline();
      }
      if (page.findId !== null && page.findSeq !== page.doc.version) {
        await find(page.findId);
      }
      page.failures = 0;
      connection(true);
    } catch (error) {
      page.failures += 1;
      connection(false, error);
    }
    const delay = page.failures ? Math.min(RETRY_MAX_MS, POLL_MS * (1 + page.failures)) : POLL_MS;
    window.setTimeout(poll, delay);
  }

  function accept(doc) {
    if (doc.instance !== page.instance) {
      // A sidecar started (or restarted): its timeline is its own.
      page.instance = doc.instance;
      page.entries = [];
      page.lastSeq = 0;
      page.loadedSinceMs = null;
      renderTimeline();
    }
    page.doc = doc;
    byId("policy").textContent = `scheduler ${doc.policy}` + (doc.aging_divisor_s ? `, aging 1 point per ${doc.aging_divisor_s} s` : "");
    renderCounters(doc.counters);
    renderLive();
  }

  async function loadTimeline() {
    const sinceMs = serverNow() - page.zoomMs;
    const full = page.loadedSinceMs === null || sinceMs < page.loadedSinceMs;
    const url = full ? `/ui/timeline?since_ms=${Math.floor(sinceMs)}` : `/ui/timeline?after=${page.lastSeq}`;
    const doc = await getJson(url);
    if (doc.instance !== page.instance) {
      return; // the next state poll resets the page for the new sidecar
    }
    if (full) {
      page.entries = doc.entries;
      page.loadedSinceMs = sinceMs;
    } else {
      page.entries.push(...doc.entries.filter((entry) => entry.seq > page.lastSeq));
    }
    page.lastSeq = doc.last_seq;
    const oldest = serverNow() - DAY_MS;
    if (page.entries.length && page.entries[0].end_ms < oldest) {
      page.entries = page.entries.filter((entry) => entry.end_ms >= oldest);
    }
    renderTimeline();
  }

  function connection(online, error) {
    const node = byId("connection");
    node.className = `connection ${online ? "online" : "offline"}`;
    node.textContent = online ? "live" : "reconnecting…";
    node.title = error ? String(error) : "";
  }

  // -- Now and the queue ------------------------------------------------------------------

  function renderLive() {
    const doc = page.doc;
    if (!doc) {
      return;
    }
    const ageS = Math.max(0, (serverNow() - doc.as_of_ms) / 1000);
    const gpu = byId("gpu-state");
    gpu.textContent = doc.gpu;
    gpu.className = `gpu gpu-${doc.gpu}`;
    byId("loaded-model").textContent = (doc.resident_models || []).join(", ") || "none known";
    byId("slots").textContent = `${doc.slots_busy} / ${doc.slots_total}`;
    renderGpus(doc);
    renderIdle(doc, ageS);
    byId("waiting-total").textContent = doc.waiting_total.toLocaleString();
    renderRunning(doc);
    renderQueue(doc, ageS);
    renderBatches(doc);
    renderNowOnTimeline();
  }

  // The upstreams (GPUs) in the configured order; an older sidecar lists none: one, unnamed.
  const gpusOf = (doc) => (doc && doc.gpus && doc.gpus.length ? doc.gpus : [{ name: null }]);

  // Its models, each with its own busy / total slots (a pin for a pinned one), and the model held back.
  function residentModels(gpu) {
    const rows = (gpu.models || []).map((row) => `<span class="gpu-resident" data-model="${escapeHtml(row.model)}">` +
      `${escapeHtml(row.model)}${row.pinned ? " (pinned)" : ""} <b>${row.slots_busy} / ${row.slots}</b></span>`);
    const held = gpu.held_back ? ` <span class="gpu-held" title="the best waiting request holds it back: no new grants until it drains and is unloaded">holding back ${escapeHtml(gpu.held_back)}</span>` : "";
    return `<span class="gpu-model">${rows.length ? rows.join(", ") : models(gpu.resident_models)}</span>` +
      ` <span class="gpu-max">(${(gpu.resident_models || []).length} of ${gpu.max_loaded || 1})</span>${held}`;
  }

  // Each idle resident model: how long it has sat idle, and when it is unloaded for idleness (ttl).
  function renderIdle(doc, ageS) {
    const rows = doc.idle || [];
    const several = gpusOf(doc).length > 1;
    byId("idle-models").textContent = rows.length ? rows.map((row) => `${row.model}${several ? ` on ${row.upstream}` : ""} ` +
      `idle ${seconds(row.idle_s + ageS)}, ` +
      (row.unload_in_s === null ? "kept" : `unloaded in ${seconds(row.unload_in_s - ageS)}`)).join("; ") : "none";
  }

  function renderGpus(doc) {
    const gpus = gpusOf(doc);
    // The server says whether each GPU gets its own chip (per_gpu) and which show model by model (per_model).
    if (!doc.per_gpu) {
      byId("gpus").innerHTML = ""; // one GPU of one model: the facts above say it all
      return;
    }
    if (gpus.length > 1) {
      byId("loaded-model").textContent = `${gpus.length} GPUs`;
    }
    byId("gpus").innerHTML = gpus.map((gpu) => `<span class="chip" data-gpu="${escapeHtml(gpu.name)}" data-state="${escapeHtml(gpu.state || "")}">` +
      `<span class="gpu-${escapeHtml(gpu.state || "idle")}">${escapeHtml(gpu.name)}</span> ` +
      (gpu.per_model ? residentModels(gpu) : `<span class="gpu-model">${models(gpu.resident_models)}</span>`) +
      `<b class="gpu-slots">${gpu.slots_busy} / ${gpu.slots}</b></span>`).join("");
  }

  function renderRunning(doc) {
    const now = serverNow();
    const rows = doc.running.map((row) => {
      const elapsedS = (now - row.granted_ms) / 1000;
      const known = row.expected_end_ms !== null && row.expected_end_ms !== undefined;
      const late = now > row.expected_end_ms;
      return `<tr data-request-id="${escapeHtml(row.request_id)}">` +
        `<td class="id">${requestIdHtml(row.request_id)}${lineNoteHtml(row.line, true)}</td><td>${band(row.band)}</td>` +
        `<td class="num">${row.priority}</td><td class="num score">${score(row.score)}</td>` +
        `<td>${model(row.model)}</td><td class="gpu-name">${escapeHtml(row.upstream || "–")}</td>` +
        `<td class="num">${seconds(row.queue_wait_s)}</td>` +
        `<td class="num elapsed">${seconds(elapsedS)}</td>` +
        `<td class="num">${known ? `${clock(row.expected_end_ms)} ${late ? "(overdue)" : `(in ${seconds((row.expected_end_ms - now) / 1000)})`}` : "unknown"}</td></tr>`;
    });
    byId("running").tBodies[0].innerHTML = rows.length ? rows.join("") :
      `<tr><td class="empty" colspan="9">nothing holds the GPU</td></tr>`;
  }

  // When a waiting request is expected to start, from the server's instant: past it with no
  // newer state, it waits for work that outran its estimate (unknown), unless it was due at once.
  function startCell(row, now) {
    if (row.estimated_start_ms === null || row.estimated_start_ms === undefined) {
      return startIn(null);
    }
    const left = (row.estimated_start_ms - now) / 1000;
    return left > 0 || row.estimated_start_s === 0 ? seconds(left) : startIn(null);
  }

  function renderQueue(doc, ageS) {
    // The score and its aging term as the server sent them, grown at the rate it sent
    // (aging_per_s) for the time since: the page derives no scheduling term.
    const aging = (doc.aging_per_s || 0) * ageS;
    const now = serverNow();
    const rows = doc.waiting.map((row) => `<tr data-request-id="${escapeHtml(row.request_id)}" data-position="${row.position}">` +
      `<td class="num">${row.position}</td><td class="id">${requestIdHtml(row.request_id)}${lineNoteHtml(row.line, false)}</td>` +
      `<td>${band(row.band)}</td>` +
      `<td class="num">${row.priority}</td><td class="num score">${score(row.score + aging)}</td>` +
      `<td class="term">${score(row.terms.priority)}</td><td class="term">${score(row.terms.affinity)}</td>` +
      `<td class="term">${score(row.terms.aging + aging)}</td><td class="num">${seconds(row.waited_s + ageS)}</td>` +
      `<td class="num">${startCell(row, now)}</td><td>${model(row.model)}</td></tr>`);
    byId("queue").tBodies[0].innerHTML = rows.length ? rows.join("") :
      `<tr><td class="empty" colspan="11">nobody waits</td></tr>`;
    // Places kept for a client's retry (routing.retryGraceSeconds): not in the dispatch order.
    const kept = (doc.kept || []).map((row) => `<li class="kept" data-kept-id="${escapeHtml(row.request_id)}">` +
      `kept: <span class="id">${escapeHtml(row.request_id)}</span> ${band(row.band)} ${row.priority}, ` +
      `waited ${seconds(row.waited_s + ageS)}, client away ${seconds(row.away_s + ageS)}` +
      `${row.attempt === null ? "" : ` after try ${row.attempt}`}, kept ${seconds(Math.max(0, row.expires_in_s - ageS))} more` +
      `${row.model ? `, ${model(row.model)}` : ""}</li>`);
    byId("queue-kept").innerHTML = kept.join("");
    byId("queue-summary").textContent = `${doc.waiting_total.toLocaleString()} waiting, in dispatch order` +
      (kept.length ? `; ${kept.length} kept for a retry` : "");
    byId("band-counts").innerHTML = BANDS.map((name) => {
      const stats = doc.bands[name] || { depth: 0, oldest_wait_s: 0 };
      const oldest = stats.depth ? `, oldest ${seconds(stats.oldest_wait_s + ageS)}` : "";
      return `<span class="chip" data-band="${name}">${band(name)}<b>${stats.depth.toLocaleString()}</b>${oldest}</span>`;
    }).join("");
    const hidden = doc.waiting_total - doc.waiting.length;
    byId("queue-more").textContent = hidden > 0 ? `showing the first ${doc.waiting.length.toLocaleString()}; ${hidden.toLocaleString()} more wait (counts per band above)` : "";
  }

  // -- batches ----------------------------------------------------------------------------

  // Unix seconds as this browser's local time (with the date when it is not today).
  function when(unixS) {
    const date = new Date(unixS * 1000);
    const time = clock(unixS * 1000);
    return date.toDateString() === new Date(serverNow()).toDateString() ? time : `${date.toLocaleDateString()} ${time}`;
  }

  function finishCell(row) {
    if (row.ended_at !== null && row.ended_at !== undefined) {
      return `ended ${when(row.ended_at)}`;
    }
    if (row.estimated_finish_at === null || row.estimated_finish_at === undefined) {
      return "–";
    }
    const inS = row.estimated_finish_at - serverNow() / 1000;
    return `${when(row.estimated_finish_at)} ${inS > 0 ? `(in ${seconds(inS)})` : "(overdue)"}`;
  }

  // Bytes for people, in binary units as the configuration writes them.
  function size(bytes) {
    const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
    for (const [unit, factor] of units) {
      if (bytes >= factor) {
        return `${(bytes / factor).toFixed(1)} ${unit}`;
      }
    }
    return `${bytes} B`;
  }

  // The space the Batch API's files take: used, the quota (batches.maxStoredBytes), what is left.
  function storageText(storage) {
    const known = (value) => typeof value === "number";
    let text = `files: ${size(storage.used_bytes)} in ${storage.files}`;
    text += known(storage.max_bytes) ? ` of a ${size(storage.max_bytes)} quota` : " (no quota)";
    if (known(storage.left_bytes)) {
      text += `, ${size(storage.left_bytes)} left`;
    }
    return known(storage.disk_free_bytes) ? `${text}; disk: ${size(storage.disk_free_bytes)} free` : text;
  }

  function renderBatches(doc) {
    // An older sidecar sends no batches: no panel. null: the Batch API is off.
    const section = byId("batches-section");
    section.hidden = doc.batches === undefined;
    const off = doc.batches === null;
    byId("batches-off").hidden = !off;
    byId("batches-list").hidden = off;
    const storage = off ? null : doc.batches_storage;
    byId("batches-storage").hidden = !storage;
    byId("batches-storage").textContent = storage ? storageText(storage) : "";
    if (off || doc.batches === undefined) {
      byId("batches-summary").textContent = "";
      return;
    }
    const share = (part, total) => (total > 0 ? (100 * part) / total : 0);
    const rows = doc.batches.map((row) => {
      const failed = row.failed ? ` <span class="failed-count">${row.failed.toLocaleString()} failed</span>` : "";
      return `<tr data-batch-id="${escapeHtml(row.id)}" data-status="${escapeHtml(row.status)}">` +
        `<td class="id">${escapeHtml(row.id)}</td>` +
        `<td><span class="batch-status status-${escapeHtml(row.status)}">${escapeHtml(row.status.replace("_", " "))}</span></td>` +
        `<td><div class="progress" title="${row.completed} completed, ${row.failed} failed of ${row.total}">` +
        `<span class="completed" style="width: ${share(row.completed, row.total)}%"></span>` +
        `<span class="failed" style="width: ${share(row.failed, row.total)}%"></span></div></td>` +
        `<td class="num done">${row.completed.toLocaleString()} / ${row.total.toLocaleString()}${failed}</td>` +
        `<td class="num">${row.in_flight}</td><td class="num">${row.priority ?? "–"}</td>` +
        `<td>${row.in_progress_at === null || row.in_progress_at === undefined ? "–" : when(row.in_progress_at)}</td>` +
        `<td class="finish">${finishCell(row)}</td></tr>`;
    });
    byId("batches").tBodies[0].innerHTML = rows.length ? rows.join("") :
      `<tr><td class="empty" colspan="8">no batch in the last day</td></tr>`;
    const running = doc.batches.filter((row) => row.status === "in_progress").length;
    byId("batches-summary").textContent = `the last day's, newest first${running ? `; ${running} in progress` : ""}`;
  }

  // -- counters ---------------------------------------------------------------------------

  function counterCard(title, pairs, big) {
    const rows = pairs.map(([key, value]) => `<div class="row"><span>${key}</span><b>${escapeHtml(value)}</b></div>`).join("");
    return `<div class="counter"><h3>${escapeHtml(title)}</h3>${big !== undefined ? `<div class="big">${escapeHtml(big)}</div>` : ""}${rows}</div>`;
  }

  function renderCounters(counters) {
    const dispatched = BANDS.map((name) => [band(name), counters.dispatched[name] || 0]);
    const total = dispatched.reduce((sum, [, n]) => sum + n, 0);
    const reorders = Object.entries(counters.reorders);
    const outcomes = Object.entries(counters.outcomes).sort((a, b) => b[1] - a[1]);
    const settles = Object.entries(counters.settles);
    const estimate = counters.estimate;
    const ratio = (value) => (value === null ? "–" : `${value.toFixed(2)}×`);
    // Several GPUs: each one's grants, and its swaps and loads.
    const gpus = Object.entries(counters.upstreams || {});
    const perGpu = gpus.length > 1 ? [counterCard("Per GPU: grants / swaps / loads", gpus.map(([name, c]) =>
      [escapeHtml(name), `${c.dispatched} / ${c.swaps} / ${c.loads}`]))] : [];
    byId("counters").innerHTML = [
      counterCard("Dispatched", dispatched, total),
      counterCard("Reorders", reorders.length ? reorders.map(([k, v]) => [escapeHtml(k), v]) : [["none yet", ""]]),
      counterCard("Models", [["swaps", counters.swaps], ["loads", counters.loads],
        ...settles.map(([k, v]) => [`settles (${escapeHtml(k)})`, v])]),
      counterCard("Endings", outcomes.length ? outcomes.map(([k, v]) => [escapeHtml(k), v]) : [["none yet", ""]]),
      counterCard("Places kept for a retry", Object.entries(counters.kept_places || {}).length
        ? Object.entries(counters.kept_places).map(([k, v]) => [escapeHtml(k.replace("_", " ")), v]) : [["none yet", ""]]),
      counterCard("Wait: actual / estimated", [["median", ratio(estimate.median_ratio)],
        ["all waits", ratio(estimate.total_ratio)], ["grants with an estimate", estimate.samples]]),
      ...perGpu,
    ].join("");
  }

  // -- the timeline -----------------------------------------------------------------------

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs)) {
      node.setAttribute(key, value);
    }
    return node;
  }

  function timeScale() {
    const node = byId("timeline");
    const width = node.clientWidth || 1000;
    const end = serverNow();
    const start = end - page.zoomMs;
    const left = LANES.labelWidth;
    const x = (ms) => left + ((ms - start) / page.zoomMs) * (width - left - 6);
    return { node, width, start, end, x };
  }

  function tickStep(spanMs) {
    const steps = [1e3, 2e3, 5e3, 10e3, 15e3, 30e3, 60e3, 120e3, 300e3, 600e3, 900e3, 1800e3, 3600e3, 7200e3, 10800e3, 21600e3];
    return steps.find((step) => spanMs / step <= 8) || 21600e3;
  }

  // One timeline row per GPU: the row of a GPU by its name (an entry that names none, or one no
  // longer listed, goes on the first), and the marks' row under them.
  function timelineRows() {
    const gpus = gpusOf(page.doc);
    const index = new Map(gpus.map((gpu, i) => [gpu.name, i]));
    const top = (name) => LANES.top + (index.get(name) ?? 0) * (LANES.height + LANES.gap);
    const markTop = LANES.top + gpus.length * (LANES.height + LANES.gap);
    return { gpus, top, markTop, bottom: markTop + LANES.markHeight };
  }

  function renderTimeline() {
    const { node, width, start, end, x } = timeScale();
    const { gpus, top, markTop, bottom } = timelineRows();
    const markHeight = LANES.markHeight;
    node.style.height = `${bottom + 4}px`;
    node.replaceChildren();
    const defs = svg("defs", {});
    const hatch = svg("pattern", { id: "hatch", width: 5, height: 5, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" });
    hatch.appendChild(svg("rect", { width: 2, height: 5, fill: "#ffffff", "fill-opacity": 0.55 }));
    defs.appendChild(hatch);
    node.appendChild(defs);
    for (const gpu of gpus) {
      const gpuTop = top(gpu.name);
      node.appendChild(svg("rect", { class: "lane gpu-lane", x: LANES.labelWidth, y: gpuTop, width: width - LANES.labelWidth, height: LANES.height, "data-gpu": gpu.name ?? "" }));
      const gpuLabel = svg("text", { class: "lane-label", x: 4, y: gpuTop + LANES.height / 2 + 4 });
      // One GPU: "GPU" as before; several: each one's name (cut to fit, whole in its title).
      const name = gpus.length > 1 ? gpu.name : "GPU";
      gpuLabel.textContent = name.length > 8 ? `${name.slice(0, 7)}…` : name;
      const title = svg("title", {});
      title.textContent = name;
      gpuLabel.appendChild(title);
      node.appendChild(gpuLabel);
    }
    node.appendChild(svg("rect", { class: "lane", x: LANES.labelWidth, y: markTop, width: width - LANES.labelWidth, height: markHeight }));
    const markLabel = svg("text", { class: "lane-label", x: 4, y: markTop + 12 });
    markLabel.textContent = "no GPU";
    node.appendChild(markLabel);
    const step = tickStep(page.zoomMs);
    for (let tick = Math.ceil(start / step) * step; tick <= end; tick += step) {
      node.appendChild(svg("line", { class: "tick", x1: x(tick), x2: x(tick), y1: 14, y2: markTop + markHeight }));
      const label = svg("text", { class: "tick-label", x: x(tick) + 3, y: 11 });
      const format = step < 60e3 ? { second: "2-digit" } : {};
      label.textContent = new Date(tick).toLocaleTimeString([], { hour12: false, hour: "2-digit", minute: "2-digit", ...format });
      node.appendChild(label);
    }
    for (const entry of page.entries) {
      const entryStart = entry.start_ms === undefined || entry.start_ms === null ? entry.end_ms : entry.start_ms;
      if (entry.end_ms < start) {
        continue;
      }
      const gpuTop = top(entry.upstream);
      if (entry.kind === "grant") {
        const x1 = Math.max(x(entryStart), LANES.labelWidth);
        const bar = svg("rect", {
          class: `grant band-${entry.serial_band}`, x: x1, y: gpuTop + 2, width: Math.max(2, x(entry.end_ms) - x1),
          height: LANES.height - 4, "data-seq": entry.seq, "data-request-id": entry.request_id, "data-band": entry.serial_band,
          "data-gpu": entry.upstream ?? "",
        });
        node.appendChild(bar);
        if ((entry.swap || entry.load) && entry.first_byte_ms !== null) {
          const loadEnd = Math.min(entry.end_ms, entryStart + entry.first_byte_ms);
          node.appendChild(svg("rect", { class: "load", x: x1, y: gpuTop + 2, width: Math.max(1, x(loadEnd) - x1), height: LANES.height - 4 }));
        }
      } else if (entry.kind === "settle") {
        const x1 = Math.max(x(entryStart), LANES.labelWidth);
        node.appendChild(svg("rect", {
          class: "settle", x: x1, y: gpuTop + LANES.height - 12, width: Math.max(2, x(entry.end_ms) - x1), height: 10,
          "data-seq": entry.seq, "data-request-id": entry.request_id, "data-gpu": entry.upstream ?? "",
        }));
      } else {
        const at = x(entry.end_ms);
        node.appendChild(svg("rect", {
          class: `mark band-${entry.serial_band}`, x: at - 1.5, y: markTop + 1, width: 3, height: markHeight - 2,
          "data-seq": entry.seq, "data-request-id": entry.request_id, "data-outcome": entry.outcome,
        }));
      }
    }
    node.appendChild(svg("g", { id: "timeline-now" }));
    renderNowOnTimeline();
  }

  function renderNowOnTimeline() {
    const group = byId("timeline-now");
    if (!group || !page.doc) {
      return;
    }
    const { x, end } = timeScale();
    const { top, bottom } = timelineRows();
    group.replaceChildren();
    for (const row of page.doc.running) {
      const x1 = Math.max(x(row.granted_ms), LANES.labelWidth);
      group.appendChild(svg("rect", {
        class: `running band-${row.band}`, x: x1, y: top(row.upstream) + 2, width: Math.max(2, x(end) - x1), height: LANES.height - 4,
        "data-request-id": row.request_id, "data-gpu": row.upstream ?? "",
      }));
    }
    group.appendChild(svg("line", { class: "now", x1: x(end), x2: x(end), y1: 14, y2: bottom }));
  }

  function tooltipHtml(entry) {
    const line = (key, value) => `<div><span class="k">${key}</span>${value}</div>`;
    const ms = (value) => (value === null || value === undefined ? "–" : seconds(value / 1000));
    if (entry.kind === "settle") {
      return line("settle", escapeHtml(entry.reason)) + line("after", `<span class="id">${escapeHtml(entry.request_id)}</span>`) +
        line("result", escapeHtml(entry.result)) + line("took", ms(entry.settle_ms));
    }
    const overtook = (entry.overtook || []).map((o) => `<span class="id">${escapeHtml(o.request_id)}</span> (${escapeHtml(o.band)} ${o.priority})`);
    return line("request", `<span class="id">${escapeHtml(entry.request_id)}</span>`) +
      line("band", `${band(entry.serial_band)} priority ${entry.serial_priority}`) +
      line("score", score(entry.serial_score)) + line("model", model(entry.model)) +
      (entry.upstream ? line("GPU", escapeHtml(entry.upstream)) : "") +
      line("waited", ms(entry.serial_queue_wait_ms)) + line("ran", ms(entry.run_ms)) +
      line("outcome", escapeHtml(entry.outcome)) +
      (entry.swap || entry.load ? line("model load", entry.swap ? "swap" : "load") : "") +
      (entry.reordered_by && entry.reordered_by.length ? line("reordered by", escapeHtml(entry.reordered_by.join(", "))) : "") +
      (entry.evicted && entry.evicted.length ? line("evicted", entry.evicted.map((e) => `${model(e.model)} (${escapeHtml(e.reason)})`).join(", ")) : "") +
      (overtook.length ? line("overtook", overtook.join(", ")) : "");
  }

  function onTimelineHover(event) {
    const tip = byId("tooltip");
    const seq = event.target.getAttribute && event.target.getAttribute("data-seq");
    const entry = seq ? page.entries.find((e) => String(e.seq) === seq) : null;
    if (!entry) {
      tip.hidden = true;
      return;
    }
    tip.innerHTML = tooltipHtml(entry);
    tip.hidden = false;
    const wrap = byId("timeline-wrap").getBoundingClientRect();
    const left = Math.min(event.clientX - wrap.left + 12, wrap.width - tip.offsetWidth - 4);
    tip.style.left = `${Math.max(0, left)}px`;
    tip.style.top = `${event.clientY - wrap.top + 14}px`;
  }

  function onTimelineWheel(event) {
    // The wheel zooms between ZOOM_MIN_MS and a day; the window always ends now.
    event.preventDefault();
    const factor = event.deltaY < 0 ? 0.8 : 1.25;
    setZoom(Math.round(Math.min(DAY_MS, Math.max(ZOOM_MIN_MS, page.zoomMs * factor))));
  }

  function setZoom(ms) {
    page.zoomMs = ms;
    for (const button of byId("zoom").querySelectorAll("button")) {
      button.classList.toggle("active", Number(button.dataset.zoom) === ms);
    }
    if (page.loadedSinceMs !== null && serverNow() - ms < page.loadedSinceMs) {
      page.loadedSinceMs = null;
      page.lastSeq = -1; // the next poll loads the wider window
    }
    renderTimeline();
  }

  // -- find a request ---------------------------------------------------------------------

  async function find(requestId) {
    page.findId = requestId;
    page.findSeq = page.doc ? page.doc.version : -1;
    const response = await fetch(`/ui/request/${encodeURIComponent(requestId)}`, { cache: "no-store" });
    const result = byId("find-result");
    if (response.status === 404) {
      const error = await response.json();
      page.findDoc = null;
      result.innerHTML = `<p class="message">${escapeHtml(error.error.message)}</p>`;
      return;
    }
    if (!response.ok) {
      throw new Error(`/ui/request: HTTP ${response.status}`);
    }
    page.findDoc = await response.json();
    renderFind(page.findDoc);
  }

  function renderFind(doc) {
    const fields = [];
    const live = doc.status;
    if (live) {
      fields.push(["state", live.state], ["position", live.position], ["band", live.band], ["priority", live.priority],
        ["score", score(live.score)], ["waited", seconds(live.waited_s)], ["estimated start", startIn(live.estimated_start_s)]);
    }
    const records = doc.records.filter((r) => r.kind !== "settle");
    const record = records[records.length - 1];
    if (record) {
      if (!live) {
        fields.push(["state", "finished"]);
      }
      for (const [key, value] of Object.entries(record)) {
        if (!["seq", "kind", "event", "overtook", "request_id"].includes(key) && value !== null && !(Array.isArray(value) && !value.length)) {
          fields.push([key, Array.isArray(value) ? value.join(", ") : value]);
        }
      }
      if (record.overtook && record.overtook.length) {
        fields.push(["overtook", record.overtook.map((o) => o.request_id).join(", ")]);
      }
    }
    if (doc.overtaken_by && doc.overtaken_by.length) {
      fields.push(["overtaken by", doc.overtaken_by.map((o) => `${o.request_id} (${o.band})`).join(", ")]);
    }
    for (const settle of doc.records.filter((r) => r.kind === "settle")) {
      fields.push([`settle (${settle.reason})`, `${settle.result}, ${seconds(settle.settle_ms / 1000)}`]);
    }
    const trace = doc.trace_url ? `<a id="trace-link" href="${escapeHtml(doc.trace_url)}" target="_blank" rel="noopener">trace ${escapeHtml(doc.trace_id)}</a>` :
      (doc.trace_id ? `<span class="muted">trace ${escapeHtml(doc.trace_id)} (set ui.jaegerUrl for a link)</span>` : "");
    byId("find-result").innerHTML = `<div><span class="id">${escapeHtml(doc.request_id)}</span> ${trace}</div>` +
      `<div class="record" id="find-record">${fields.map(([k, v]) => `<div data-key="${escapeHtml(k)}"><span class="k">${escapeHtml(k)}</span><span class="v">${escapeHtml(v)}</span></div>`).join("")}</div>` +
      positionsChart(doc.positions);
  }

  function positionsChart(points) {
    if (!points || points.length < 1) {
      return "";
    }
    const width = Math.max(200, byId("find-result").clientWidth);
    const height = 70;
    const t0 = points[0][0];
    const t1 = Math.max(points[points.length - 1][0], serverNow());
    const most = Math.max(...points.map((p) => p[1]));
    const x = (t) => 30 + ((t - t0) / Math.max(1, t1 - t0)) * (width - 40);
    const y = (position) => 8 + ((position - 1) / Math.max(1, most - 1)) * (height - 20);
    let path = "";
    points.forEach(([t, position], index) => {
      if (index) {
        path += ` ${x(t)},${y(points[index - 1][1])}`;
      }
      path += ` ${x(t)},${y(position)}`;
    });
    path += ` ${x(t1)},${y(points[points.length - 1][1])}`;
    return `<svg id="positions" viewBox="0 0 ${width} ${height}"><text x="0" y="12">#1</text>` +
      `<text x="0" y="${height - 6}">#${most}</text><polyline points="${path.trim()}"></polyline></svg>` +
      `<div class="muted">position over time while watched (${points.length} change${points.length === 1 ? "" : "s"})</div>`;
  }

  function onPick(event) {
    const row = event.target.closest("[data-request-id]");
    if (row) {
      byId("find-input").value = row.getAttribute("data-request-id");
      find(row.getAttribute("data-request-id")).catch((error) => connection(false, error));
    }
  }

  // -- start ------------------------------------------------------------------------------

  byId("find-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const requestId = byId("find-input").value.trim();
    if (requestId) {
      find(requestId).catch((error) => connection(false, error));
    }
  });
  byId("zoom").addEventListener("click", (event) => {
    const zoom = event.target.getAttribute("data-zoom");
    if (zoom) {
      setZoom(Number(zoom));
    }
  });
  byId("timeline").addEventListener("mousemove", onTimelineHover);
  byId("timeline").addEventListener("wheel", onTimelineWheel, { passive: false });
  byId("timeline").addEventListener("mouseleave", () => {
    byId("tooltip").hidden = true;
  });
  byId("timeline").addEventListener("click", onPick);
  byId("queue").addEventListener("click", onPick);
  byId("running").addEventListener("click", onPick);
  window.addEventListener("resize", renderTimeline);
  window.setInterval(renderLive, TICK_MS);
  window.setInterval(renderTimeline, 5000);
  poll();
}());
