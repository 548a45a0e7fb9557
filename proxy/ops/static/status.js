// prefixpin status page: upstream, slots, and per session a chart of TTFT and cached
// tokens by turn. Plain DOM and SVG, no build step. Refreshes every 2 s.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function chart(turns) {
  const width = 560, height = 160, pad = 34;
  const root = svg("svg", { width, height, class: "chart", role: "img",
                            "aria-label": "TTFT and cached tokens by turn" });
  if (!turns.length) return root;
  const ttfts = turns.map(t => t.ttft_ms || 0);
  const prompts = turns.map(t => t.prompt_tokens || 0);
  const maxTtft = Math.max(1, ...ttfts), maxTokens = Math.max(1, ...prompts);
  const step = (width - 2 * pad) / turns.length;
  const y = (value, max) => height - pad - (value / max) * (height - 2 * pad);
  turns.forEach((turn, i) => {
    const x = pad + i * step;
    root.appendChild(svg("rect", { class: "ttft", x: x + 2, width: Math.max(2, step - 4),
      y: y(ttfts[i], maxTtft), height: height - pad - y(ttfts[i], maxTtft),
      fill: "#9ec5fe" }));
  });
  const line = (values, color, cls) => {
    const points = values.map((v, i) => `${pad + (i + 0.5) * step},${y(v, maxTokens)}`);
    root.appendChild(svg("polyline", { class: cls, points: points.join(" "), fill: "none",
                                       stroke: color, "stroke-width": 2 }));
  };
  line(prompts, "#98a2b3", "prompt");
  line(turns.map(t => t.cached_tokens || 0), "#067647", "cached");
  const label = (x, yy, text, anchor) => {
    const t = svg("text", { x, y: yy, "text-anchor": anchor });
    t.textContent = text;
    root.appendChild(t);
  };
  label(4, pad - 6, `${Math.round(maxTtft)} ms`, "start");
  label(width - 4, pad - 6, `${maxTokens} tok`, "end");
  label(pad, height - 8, "turn 1", "start");
  label(width - pad, height - 8, `turn ${turns.length}`, "end");
  return root;
}

function renderSessions(namespaces) {
  const box = document.getElementById("sessions");
  box.replaceChildren();
  const names = Object.keys(namespaces);
  if (!names.length) box.appendChild(el("p", { class: "muted" }, "no sessions yet"));
  for (const ns of names) {
    box.appendChild(el("div", { class: "namespace" }, `namespace ${ns}`));
    for (const s of namespaces[ns]) {
      const card = el("div", { class: "session", "data-session": s.id });
      card.appendChild(el("div", { class: "title" },
        `${s.key || "(no key)"} · ${s.id} · ${s.api ?? "openai"} · ${s.kind} · ` +
        `slot ${s.slot ?? "–"} · ` +
        `${s.committed_tokens} committed tokens · ${s.last_decision}`));
      card.appendChild(el("div", { class: "reason" }, s.last_reason || ""));
      card.appendChild(chart(s.turns || []));
      box.appendChild(card);
    }
  }
}

function renderSlots(slots) {
  const body = document.querySelector("#slots tbody");
  body.replaceChildren();
  for (const slot of slots) {
    const row = el("tr");
    for (const v of [slot.slot, slot.session ?? "–", slot.kind ?? "–", slot.tokens,
                     slot.busy ? "yes" : "no"]) row.appendChild(el("td", {}, String(v)));
    body.appendChild(row);
  }
}

async function refresh() {
  try {
    const [health, sessions] = await Promise.all([
      fetch("/healthz").then(r => r.json()), fetch("/sessions").then(r => r.json())]);
    const up = health.upstream || {};
    const text = document.getElementById("upstream");
    text.textContent = `${up.engine || "engine"} ${up.label || ""} · ${up.status} · ` +
      `${up.model || ""} · ${up.slots ?? "?"} slots · affinity ${sessions.affinity ? "on" : "off"}`;
    text.className = up.status === "ok" ? "ok" : "warn";
    renderSlots(sessions.slots || []);
    renderSessions(sessions.namespaces || {});
    document.body.dataset.loaded = "true";
  } catch (err) {
    document.getElementById("upstream").textContent = `cannot reach prefixpin: ${err}`;
  }
}

refresh();
setInterval(refresh, 2000);
