// swarmd dashboard: polls /api/v1/state and draws it. Plain DOM and SVG, no library, no build step.
"use strict";

const REFRESH_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 120) return `${Math.round(seconds)} s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function bytes(count) {
  if (count === null || count === undefined) return "-";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let value = count, unit = 0;
  while (value >= 1000 && unit < units.length - 1) { value /= 1000; unit += 1; }
  return `${value.toFixed(value < 10 && unit ? 1 : 0)} ${units[unit]}`;
}

function clock(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString();
}

function loadColour(load) {  // 0: pale green, 1: deep red
  const hue = 120 - 120 * Math.max(0, Math.min(1, load));
  return `hsl(${hue}, 70%, ${78 - 30 * load}%)`;
}

function drawBanner(state) {
  const banner = document.getElementById("banner");
  banner.className = "banner " + (state.swarm.reachable ? "ok" : "bad");
  banner.textContent = state.swarm.reachable ? `swarm reachable: ${state.swarm.message}` : state.swarm.message;
  document.getElementById("updated").textContent =
    state.swarm.last_refresh_at ? `refreshed ${clock(state.swarm.last_refresh_at)}` : "";
  const cost = state.cost.per_peer_per_refresh;
  document.getElementById("cost").textContent = cost === null ? "-" : cost.toFixed(2);
}

function drawPeers(state) {
  const body = document.querySelector("#peers tbody");
  body.replaceChildren(...state.peers.map(peer => el("tr", {"data-peer-id": peer.peer_id, "data-state": peer.state},
    el("td", {title: peer.peer_id}, peer.peer_id.slice(0, 12)),
    el("td", {}, peer.address),
    el("td", {class: "state"}, peer.state),
    el("td", {}, peer.reachability),
    el("td", {}, peer.version || "-"),
    el("td", {class: "num"}, duration(peer.uptime_s)),
    el("td", {class: "num", title: peer.experts.join(", ")}, peer.experts.length),
    el("td", {class: "num"}, peer.requests_per_s.toFixed(1)),
    el("td", {class: "num"}, peer.requests_served),
    el("td", {class: "num", title: peer.error || ""}, peer.failures_seen === null ? "-" : peer.failures_seen),
    el("td", {class: "num"}, `${bytes(peer.bytes_received)} / ${bytes(peer.bytes_sent)}`),
    el("td", {}, peer.budget || "-"))));
  const online = state.peers.filter(peer => peer.state === "online").length;
  document.getElementById("peer-count").textContent = `(${online} online of ${state.peers.length})`;
}

function drawExperts(state) {
  const box = document.getElementById("experts");
  const prefixes = Object.keys(state.experts);
  if (!prefixes.length) { box.replaceChildren(el("p", {class: "empty"}, "no experts served")); return; }
  box.replaceChildren(...prefixes.map(prefix => {
    const family = state.experts[prefix];
    const byUid = new Map(family.cells.map(cell => [cell.uid, cell]));
    const grid = family.grid.length ? family.grid : [family.cells.length];
    const rows = grid.length > 1 ? grid[0] : 1;
    const columns = grid.length > 1 ? grid.slice(1).reduce((a, b) => a * b, 1) : grid[0];
    const uids = [];
    const walk = (prefixUid, dims) => {
      if (!dims.length) { uids.push(prefixUid); return; }
      for (let i = 0; i < dims[0]; i++) walk(`${prefixUid}.${i}`, dims.slice(1));
    };
    walk(prefix, grid);
    const known = new Set(uids);
    for (const cell of family.cells) if (!known.has(cell.uid)) uids.push(cell.uid);  // uids off the grid
    const cells = uids.map(uid => {
      const cell = byUid.get(uid);
      if (!cell) return el("div", {class: "cell empty", title: `${uid}: not served`, "data-empty-uid": uid}, "");
      const hosts = cell.hosts.map(host => `${host.peer_id.slice(0, 12)} ${host.address}`).join("\n");
      const node = el("div", {class: "cell", "data-uid": uid, "data-replicas": cell.replicas,
        title: `${uid}: ${cell.requests} requests\n${hosts}`}, cell.replicas > 1 ? `×${cell.replicas}` : "");
      node.style.background = loadColour(cell.load);
      return node;
    });
    const gridBox = el("div", {class: "grid", "data-prefix": prefix}, ...cells);
    gridBox.style.gridTemplateColumns = `repeat(${Math.max(1, Math.min(columns, 24))}, 34px)`;
    return el("div", {style: "display:inline-block"},
      el("div", {class: "grid-title"}, `${prefix} (${family.cells.length} served, ${(family.kinds || []).join(", ") || "kind ?"}, grid ${grid.join("×")}, ` +
        `${rows > 1 ? rows + " rows" : "1 row"})`), gridBox);
  }));
}

function plot(points, key, label, kind) {
  const width = 420, height = 140, pad = 30;
  const box = svg("svg", {class: `plot plot-${kind}`, width, height, viewBox: `0 0 ${width} ${height}`});
  const title = svg("text", {x: pad, y: 12});
  title.textContent = label;
  box.append(title);
  const values = points.map(p => p[key]).filter(v => typeof v === "number");
  if (!values.length) return box;
  const t0 = points[0].time, t1 = points[points.length - 1].time;
  const low = Math.min(...values), high = Math.max(...values);
  const span = high - low || Math.abs(high) || 1;
  const x = t => pad + (t1 > t0 ? (t - t0) / (t1 - t0) : 0.5) * (width - 2 * pad);
  const y = v => height - pad + 10 - ((v - low) / span) * (height - pad - 20);
  const path = points.map((p, i) => `${i ? "L" : "M"}${x(p.time).toFixed(1)},${y(p[key]).toFixed(1)}`).join(" ");
  box.append(svg("path", {class: "line", d: path}));
  for (const p of points) box.append(svg("circle", {cx: x(p.time).toFixed(1), cy: y(p[key]).toFixed(1), r: 2}));
  for (const [value, at] of [[high, y(high)], [low, y(low)]]) {
    const tick = svg("text", {x: 2, y: at + 3});
    tick.textContent = value.toPrecision(3);
    box.append(tick);
  }
  const span_s = svg("text", {x: width - pad - 60, y: height - 4});
  span_s.textContent = `${duration(t1 - t0)} shown`;
  box.append(span_s);
  return box;
}

function drawRuns(state) {
  const box = document.getElementById("runs");
  if (!state.runs.length) { box.replaceChildren(el("p", {class: "empty"}, "no training run")); return; }
  box.replaceChildren(...state.runs.map(run => {
    const trainers = Object.entries(run.latest).map(([peer, p]) =>
      el("li", {}, `${peer.slice(0, 12)}: step ${p.step}, loss ${p.loss.toFixed(3)}, ` +
        `${p.samples_per_s.toFixed(0)} samples/s, epoch ${p.epoch}`));
    const groups = run.recent_groups.map(group => el("li", {}, `${group.length} trainers: ${group.join(", ")}`));
    const avg = run.averaging;
    const r = run.rounds || {};
    const rounds = r.algorithm === "diloco" ?
      `outer step ${r.outer_step ?? "-"}: last round ${r.round_members ?? "-"} member(s) (${r.round_started ?? "-"}), ` +
      `grace window ${r.grace_window === null || r.grace_window === undefined ? "-" : r.grace_window.toFixed(3) + " s"}, ` +
      `${r.late_contributions ?? 0} late contribution(s), goodput ${r.utilization ?? "-"}, ` +
      `joiners contribute within ${r.joiner_first_contribution ?? "-"} outer step(s), ` +
      `outer hashes ${r.hashes_agree === false ? "DIFFER" : "agree"}` : "";
    const averaging = `averaging: ${avg.rounds} round(s) taken part in, ${avg.failures} failed` +
      (avg.mean_seconds === null ? "" : `, ${avg.mean_seconds.toFixed(2)} s each on average`);
    return el("div", {class: "run", "data-run-id": run.run_id},
      el("h3", {}, `${run.run_id}: epoch ${run.epoch ?? "-"}, ${run.trainers} trainer(s), ` +
        `${run.samples ?? "-"}/${run.target_batch_size ?? "-"} samples, ${run.samples_per_s ?? "-"} samples/s`),
      el("div", {class: "plots"}, plot(run.history, "loss", "training loss", "loss"),
        plot(run.history, "samples_per_s", "samples/s (all trainers)", "rate")),
      el("p", {}, "trainers:"), el("ul", {}, ...trainers), el("p", {class: "averaging"}, averaging),
      ...(rounds ? [el("p", {class: "rounds"}, rounds)] : []),
      el("p", {}, groups.length ? "recent averaging groups:" : "no averaging group yet"), el("ul", {}, ...groups));
  }));
}

const BAD = new Set(["peer_unreachable", "peer_left", "peer_expired", "averaging_failed", "swarm_unreachable"]);

function drawEvents(state) {
  const list = document.getElementById("events");
  const events = state.events.slice().reverse();
  if (!events.length) { list.replaceChildren(el("li", {class: "empty"}, "nothing happened yet")); return; }
  list.replaceChildren(...events.map(event => el("li",
    {class: BAD.has(event.kind) ? "bad" : "good", "data-kind": event.kind, "data-peer-id": event.peer_id},
    `${clock(event.time)} ${event.message}`)));
}

async function refresh() {
  try {
    const response = await fetch("/api/v1/state", {cache: "no-store"});
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const state = await response.json();
    drawBanner(state);
    drawPeers(state);
    drawExperts(state);
    drawRuns(state);
    drawEvents(state);
    document.body.dataset.refreshes = state.swarm.refreshes;
  } catch (error) {
    const banner = document.getElementById("banner");
    banner.className = "banner bad";
    banner.textContent = `dashboard unreachable (${error.message}); retrying`;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
