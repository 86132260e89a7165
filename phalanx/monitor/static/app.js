// phalanx's dashboard page: polls the controller's api/state and draws its groups, their
// ranks, a timeline of their recent calls and the pools; fetches a group's stacks on demand.
//
// How it works:
// - The token comes from this page's own URL's fragment (#token=..., which the browser never
//   sends to any server) and goes in the X-Phalanx-Token header of every request this page
//   makes: never in a cookie (a browser sends a cookie to every port of the host, so other
//   servers on the machine would receive it) nor in a URL. The server takes it from that
//   header only; a page of another origin cannot set the header (it needs a CORS preflight,
//   which the server refuses) and does not know the token.
// - What acts on the ranks (their stacks) is a POST.
// - One request at a time: the next poll is scheduled (setTimeout) only once the previous
//   one has answered or failed, POLL_MS later; a request that hangs is aborted after
//   REQUEST_TIMEOUT_MS, so a stuck server shows up as "disconnected" instead of a frozen page.
// - Each group's section is built once and then updated in place, keyed by group name, by
//   rank, and by (call, rank) for the timeline's rects: the stacks panel keeps its content
//   and open state across updates, and the rect under the mouse keeps its tooltip.
// - Every piece of text from the JSON goes in through textContent or an attribute, never
//   through innerHTML: group names, methods and error texts are the user's.
"use strict";

const POLL_MS = 1000;
const REQUEST_TIMEOUT_MS = 5000;
const STACKS_TIMEOUT_MS = 30000; // collecting every rank's stacks takes a second or two
const WINDOW_S = 30; // the timeline shows the last 30 s of controller time
const TICKS_S = [-30, -20, -10, 0];

const SVG_NS = "http://www.w3.org/2000/svg";
const LANE_H = 14; // px per rank in the timeline
const LANE_GAP = 3;
const LABEL_W = 58; // room for "rank 12" left of the lanes
const AXIS_H = 16; // room for the tick labels below the lanes
const MIN_RECT_W = 2; // a 1 ms call still shows
const NONE = "\u2014"; // what a cell shows for a null

const TOKEN_HEADER = "X-Phalanx-Token";
const token = new URLSearchParams(window.location.hash.slice(1)).get("token") ?? "";

/** A URL of this dashboard's API, relative to the page, with `params` (never the token). */
function apiUrl(path, params = {}) {
  const query = new URLSearchParams(params).toString();
  return query ? `${path}?${query}` : path;
}

/**
 * Ask the API for a JSON document (`method` GET or POST, the token in its header), aborted
 * after `timeoutMs`. Rejects with an Error whose message says what went wrong: the server's
 * own {"error": ...} text when it sent one.
 */
async function getJson(url, timeoutMs, method = "GET") {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), timeoutMs);
  try {
    let response;
    try {
      response = await fetch(url, {
        method, cache: "no-store", credentials: "omit", signal: abort.signal,
        headers: { [TOKEN_HEADER]: token },
      });
    } catch (err) {
      throw new Error(abort.signal.aborted ? `no answer in ${timeoutMs / 1000} s`
        : `cannot reach the controller (${err.message ?? err})`);
    }
    if (!response.ok) {
      let detail = response.statusText;
      try {
        const body = await response.json();
        if (body && typeof body.error === "string") detail = body.error;
      } catch {
        // not JSON: the status line says enough
      }
      const hint = response.status === 401 || response.status === 403
        ? " (open the URL phalanx gave, with its #token=)" : "";
      throw new Error(`HTTP ${response.status} ${detail}${hint}`);
    }
    return await response.json();
  } finally {
    clearTimeout(timer);
  }
}

// -- small DOM helpers ----------------------------------------------------------------------

/** An HTML element with a class and text (both optional). */
function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

/** An SVG element with attributes. */
function svgEl(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  return node;
}

/** Set textContent only when it changed (no needless layout, selections survive). */
function setText(node, text) {
  const value = text === undefined || text === null ? "" : String(text);
  if (node.textContent !== value) node.textContent = value;
}

function formatAgo(seconds) {
  if (seconds === null || seconds === undefined) return NONE;
  if (seconds < 10) return `${seconds.toFixed(1)} s ago`;
  if (seconds < 120) return `${Math.round(seconds)} s ago`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min ago`;
  return `${Math.round(seconds / 3600)} h ago`;
}

function formatDuration(seconds) {
  if (seconds < 1) return `${(seconds * 1000).toFixed(1)} ms`;
  return `${seconds.toFixed(2)} s`;
}

function formatBytes(n) {
  if (n === null || n === undefined) return "?";
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  if (n < 1024 ** 3) return `${(n / 1024 ** 2).toFixed(1)} MiB`;
  return `${(n / 1024 ** 3).toFixed(2)} GiB`;
}

function formatClock(epochSeconds) {
  return new Date(epochSeconds * 1000).toLocaleTimeString();
}

// -- one group's section --------------------------------------------------------------------

// The rank table's columns: [key (the cells' class), heading].
const RANK_COLUMNS = [
  ["rank", "rank"], ["state", "state"], ["node", "node"], ["pid", "pid"], ["restarts", "restarts"],
  ["inflight", "in flight"], ["seen", "last seen"], ["exit-cause", "exit"],
];

/** A group's section, built once, updated in place by `update(group, now)`. */
class GroupView {
  constructor(name) {
    this.name = name;
    this.rows = new Map(); // rank -> {tr, cells}
    this.rects = new Map(); // "callId:rank" -> rect
    this.errorSeen = new Map(); // "callId:rank" -> controller time an error was first seen
    this.stacksInFlight = false;
    this.closed = false;

    this.section = el("section", "group");
    this.section.dataset.group = name;

    const head = el("div", "group-head");
    this.title = el("h2", "group-name", name);
    this.status = el("span", "badge");
    this.meta = el("span", "group-meta");
    this.counts = el("span", "group-counts");
    this.stacksButton = el("button", "stacks", "stacks");
    this.stacksButton.type = "button";
    this.stacksButton.title = "fetch every live rank's thread stacks";
    this.stacksButton.addEventListener("click", () => this.fetchStacks());
    head.append(this.title, this.status, this.meta, this.counts, this.stacksButton);

    const table = el("table", "ranks");
    const headRow = el("tr");
    for (const [key, heading] of RANK_COLUMNS) headRow.append(el("th", key, heading));
    table.append(el("thead"));
    table.tHead.append(headRow);
    this.tbody = el("tbody");
    table.append(this.tbody);

    this.svg = svgEl("svg", { class: "timeline", role: "img" });
    this.svg.append(svgEl("title"));
    this.svg.firstChild.textContent = `calls of ${name}, the last ${WINDOW_S} s`;
    this.axis = svgEl("g", { class: "axis" });
    this.lanes = svgEl("g", { class: "lanes" });
    this.callsLayer = svgEl("g", { class: "calls" });
    this.svg.append(this.axis, this.lanes, this.callsLayer);
    const timeline = el("div", "timeline-box");
    timeline.append(this.svg);

    this.stacksPanel = el("details", "stacks-panel");
    this.stacksPanel.hidden = true;
    this.stacksSummary = el("summary", null, "stacks");
    this.stacksBody = el("div", "stacks-body");
    this.stacksPanel.append(this.stacksSummary, this.stacksBody);

    this.section.append(head, table, timeline, this.stacksPanel);
  }

  update(group, now) {
    setText(this.status, group.closed ? "closed" : "running");
    this.status.className = `badge ${group.closed ? "closed" : "running"}`;
    this.section.dataset.closed = String(Boolean(group.closed));
    this.closed = Boolean(group.closed);
    // A closed group has no rank to ask (the server answers 404).
    this.stacksButton.disabled = this.closed || this.stacksInFlight;
    const target = group.target && group.target !== group.name ? ` \u00b7 ${group.target}` : "";
    setText(this.meta, `${group.backend}${target} \u00b7 world size ${group.world_size}`);
    const counts = group.counts ?? {};
    setText(this.counts, ["calls", "errors", "deaths", "restarts"]
      .map((key) => `${key} ${counts[key] ?? 0}`).join(" \u00b7 "));
    this.counts.classList.toggle("bad", (counts.errors ?? 0) > 0 || (counts.deaths ?? 0) > 0);
    const ranks = group.ranks ?? [];
    this.updateRanks(ranks);
    this.updateTimeline(ranks.map((r) => r.rank), group.calls ?? [], now);
  }

  updateRanks(ranks) {
    const seen = new Set();
    ranks.forEach((info, index) => {
      seen.add(info.rank);
      let row = this.rows.get(info.rank);
      if (!row) {
        const tr = el("tr", "rank");
        const cells = {};
        for (const [key] of RANK_COLUMNS) {
          cells[key] = el("td", key);
          tr.append(cells[key]);
        }
        cells.badge = el("span", "badge");
        cells.state.append(cells.badge);
        row = { tr, cells };
        this.rows.set(info.rank, row);
      }
      const { tr, cells } = row;
      // Rows follow the state's order (rank order), wherever a new rank lands.
      if (this.tbody.children[index] !== tr) this.tbody.insertBefore(tr, this.tbody.children[index] ?? null);
      tr.dataset.rank = String(info.rank);
      tr.dataset.state = String(info.state);
      setText(cells.rank, info.rank);
      setText(cells.badge, info.state);
      cells.badge.className = `badge state-${info.state}`;
      setText(cells.node, info.node ?? NONE);
      setText(cells.pid, info.pid ?? NONE);
      setText(cells.restarts, info.restarts ?? NONE);
      setText(cells.inflight, info.calls_in_flight ?? NONE);
      setText(cells.seen, info.state === "dead" ? NONE : formatAgo(info.last_seen));
      // Empty while the rank lives: the cell is the exit's cause and nothing else.
      const exit = info.exit ?? null;
      const cause = cells["exit-cause"];
      setText(cause, exit ? exit.cause ?? `exit code ${exit.exitcode}` : "");
      cause.title = exit && exit.exitcode !== null && exit.exitcode !== undefined
        ? `exit code ${exit.exitcode}` : "";
    });
    for (const [rank, row] of this.rows) {
      if (!seen.has(rank)) {
        row.tr.remove();
        this.rows.delete(rank);
      }
    }
  }

  updateTimeline(rankList, calls, now) {
    const width = Math.max(360, Math.floor(this.svg.parentElement?.clientWidth || 900));
    const plotW = width - LABEL_W - 8;
    const lanesH = Math.max(1, rankList.length) * (LANE_H + LANE_GAP);
    const height = lanesH + AXIS_H;
    this.svg.setAttribute("width", String(width));
    this.svg.setAttribute("height", String(height));
    this.svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const start = now - WINDOW_S;
    const x = (t) => LABEL_W + ((t - start) / WINDOW_S) * plotW;
    const laneOf = new Map(rankList.map((rank, i) => [rank, i]));
    const laneY = (i) => i * (LANE_H + LANE_GAP);

    // The lanes and the axis are cheap and nothing hovers on them: drawn afresh.
    this.lanes.replaceChildren();
    rankList.forEach((rank, i) => {
      this.lanes.append(svgEl("rect", {
        class: "lane", x: LABEL_W, y: laneY(i), width: plotW, height: LANE_H,
      }));
      const label = svgEl("text", {
        class: "lane-label", x: LABEL_W - 6, y: laneY(i) + LANE_H - 3, "text-anchor": "end",
      });
      label.textContent = `rank ${rank}`;
      this.lanes.append(label);
    });
    this.axis.replaceChildren();
    for (const tick of TICKS_S) {
      const tx = LABEL_W + ((tick + WINDOW_S) / WINDOW_S) * plotW;
      this.axis.append(svgEl("line", { class: "tick", x1: tx, x2: tx, y1: 0, y2: lanesH }));
      const label = svgEl("text", {
        class: "tick-label", x: tx, y: height - 3,
        "text-anchor": tick === 0 ? "end" : tick === -WINDOW_S ? "start" : "middle",
      });
      label.textContent = tick === 0 ? "now" : `${tick} s`;
      this.axis.append(label);
    }

    // The calls' rects: one per (call, rank), kept and updated in place.
    const live = new Set();
    for (const call of calls) {
      const begin = call.sent ?? call.queued;
      if (begin === null || begin === undefined) continue;
      const done = call.done ?? {};
      const errors = call.errors ?? {};
      for (const rank of call.ranks ?? []) {
        const lane = laneOf.get(rank);
        if (lane === undefined) continue;
        const key = `${call.id}:${rank}`;
        const error = errors[String(rank)] ?? null;
        let end = done[String(rank)] ?? null;
        if (end === null && error !== null) {
          // An error with no time of its own: it arrived no later than the first state
          // that showed it.
          if (!this.errorSeen.has(key)) this.errorSeen.set(key, now);
          end = this.errorSeen.get(key);
        }
        const inFlight = end === null;
        const stop = inFlight ? now : end;
        if (stop < start) continue; // scrolled out of the window
        live.add(key);
        let rect = this.rects.get(key);
        if (!rect) {
          rect = svgEl("rect", { height: LANE_H });
          rect.append(svgEl("title"));
          this.rects.set(key, rect);
          this.callsLayer.append(rect);
        }
        const x0 = x(Math.max(begin, start));
        const x1 = x(Math.min(stop, now));
        rect.setAttribute("x", x0.toFixed(1));
        rect.setAttribute("y", String(laneY(lane)));
        rect.setAttribute("width", Math.max(MIN_RECT_W, x1 - x0).toFixed(1));
        rect.setAttribute("data-rank", String(rank));
        rect.setAttribute("data-call", String(call.id));
        rect.setAttribute("data-method", String(call.method));
        rect.setAttribute("class",
          `call${error !== null ? " error" : ""}${inFlight ? " inflight" : ""}`);
        const lines = [
          `${call.method}() \u00b7 call ${call.id} \u00b7 rank ${rank}`,
          inFlight ? `in flight for ${formatDuration(now - begin)}`
            : `took ${formatDuration(end - begin)}`,
          `sent ${formatBytes(call.bytes_in)} \u00b7 answers ${formatBytes(call.bytes_out)}`,
        ];
        if (call.sent === null || call.sent === undefined) lines.push("queued, not sent yet");
        if (error !== null) lines.push(`error: ${error}`);
        setText(rect.firstChild, lines.join("\n"));
      }
    }
    for (const [key, rect] of this.rects) {
      if (!live.has(key)) {
        rect.remove();
        this.rects.delete(key);
        this.errorSeen.delete(key);
      }
    }
  }

  async fetchStacks() {
    if (this.stacksInFlight || this.closed) return;
    this.stacksInFlight = true;
    this.stacksButton.disabled = true;
    this.stacksPanel.hidden = false;
    this.stacksPanel.open = true;
    this.section.dataset.stacks = "loading";
    setText(this.stacksSummary, "stacks: collecting\u2026");
    try {
      const answer = await getJson(apiUrl("api/stacks", { group: this.name }),
        STACKS_TIMEOUT_MS, "POST");
      const stacks = answer.stacks ?? {};
      const ranks = Object.keys(stacks).sort((a, b) => Number(a) - Number(b));
      const parts = [];
      for (const rank of ranks) {
        const block = el("div", "stack-block");
        block.append(el("h3", null, `rank ${rank}`));
        const pre = el("pre", "stack", stacks[rank]);
        pre.dataset.rank = rank;
        block.append(pre);
        parts.push(block);
      }
      if (parts.length === 0) parts.push(el("p", "empty", "No live rank to ask."));
      this.stacksBody.replaceChildren(...parts);
      setText(this.stacksSummary,
        `stacks of ${ranks.length} rank${ranks.length === 1 ? "" : "s"}, ` +
        `collected ${new Date().toLocaleTimeString()}`);
      this.section.dataset.stacks = "shown";
    } catch (err) {
      this.stacksBody.replaceChildren(el("p", "error-text", err.message));
      setText(this.stacksSummary, "stacks: failed");
      this.section.dataset.stacks = "failed";
    } finally {
      this.stacksInFlight = false;
      this.stacksButton.disabled = this.closed;
    }
  }
}

// -- the whole page -------------------------------------------------------------------------

const views = new Map(); // group name -> GroupView

function renderHeader(state) {
  const parts = [`${state.host ?? "?"} \u00b7 pid ${state.pid ?? "?"}`];
  if (state.version) parts.push(`v${state.version}`);
  setText(document.getElementById("controller"), parts.join(" \u00b7 "));
  setText(document.getElementById("updated"), `updated ${formatClock(state.time)}`);
  document.title = `phalanx \u00b7 ${state.host ?? ""}`;
}

function renderGroups(state) {
  const container = document.getElementById("groups");
  const groups = state.groups ?? [];
  const names = new Set();
  groups.forEach((group, index) => {
    names.add(group.name);
    let view = views.get(group.name);
    if (!view) {
      view = new GroupView(group.name);
      views.set(group.name, view);
    }
    if (container.children[index] !== view.section) {
      container.insertBefore(view.section, container.children[index] ?? null);
    }
    view.update(group, state.time);
  });
  for (const [name, view] of views) {
    if (!names.has(name)) {
      view.section.remove();
      views.delete(name);
    }
  }
  document.getElementById("no-groups").hidden = groups.length > 0;
}

function renderPools(state) {
  const pools = state.pools ?? [];
  const section = document.getElementById("pools");
  section.hidden = pools.length === 0;
  const rows = pools.map((pool) => {
    const tr = el("tr", "pool");
    tr.dataset.pool = String(pool.name);
    for (const value of [pool.name, pool.backend, pool.slots, pool.free,
      (pool.groups ?? []).join(", ")]) {
      tr.append(el("td", null, value));
    }
    return tr;
  });
  section.querySelector("tbody").replaceChildren(...rows);
}

function setConnected(connected, reason) {
  const banner = document.getElementById("banner");
  document.body.dataset.connected = String(connected);
  banner.hidden = connected;
  if (!connected) setText(banner, `disconnected: ${reason} \u2014 retrying every ${POLL_MS / 1000} s`);
}

let updates = 0;

async function poll() {
  let state;
  try {
    state = await getJson(apiUrl("api/state"), REQUEST_TIMEOUT_MS);
    setConnected(true);
  } catch (err) {
    setConnected(false, err.message);
    setTimeout(poll, POLL_MS);
    return;
  }
  try {
    renderHeader(state);
    renderGroups(state);
    renderPools(state);
    updates += 1;
    // For whoever watches the page (the browser tests): how many states were drawn.
    document.body.dataset.updates = String(updates);
  } catch (err) {
    // A state this page cannot draw is this page's bug, not a lost connection: say so
    // where it shows, and keep polling (the next state may draw).
    const banner = document.getElementById("banner");
    banner.hidden = false;
    setText(banner, `could not draw the state: ${err}`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

if (token) {
  poll();
} else {
  // Nothing to ask without it: say where it is.
  const banner = document.getElementById("banner");
  document.body.dataset.connected = "false";
  banner.hidden = false;
  setText(banner, "This page needs its token: open the URL px.dashboard() printed " +
    "(http://HOST:PORT/#token=...).");
}
