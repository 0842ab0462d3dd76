// The Clade dashboard: plain JavaScript, no build step (served from the binary).
// Every call goes to the control API with the session cookie and `X-Clade-Dashboard: 1`
// (the server's CSRF guard). The sandbox list is paged by the API (limit + nextToken);
// metrics are asked for the visible rows only.
'use strict';

const POLL_MS = 5000;
const HISTORY_S = 600; // seconds of metrics history kept per sandbox for the sparklines
const HISTORY_FETCHES = 4; // concurrent history requests when a page is shown

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v;
    else if (k.startsWith('data-')) e.setAttribute(k, v);
    else if (k === 'title') e.title = v;
    else e[k] = v;
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

class ApiError extends Error {}

async function api(method, path, body) {
  const headers = { 'X-Clade-Dashboard': '1' };
  const init = { method, headers, credentials: 'same-origin' };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  if (r.status === 401) {
    window.location.assign('/dashboard/login');
    throw new ApiError('the session ended: log in again');
  }
  if (!r.ok) {
    let msg = `${method} ${path}: HTTP ${r.status}`;
    try {
      const j = await r.json();
      if (j && j.message) msg = j.message;
    } catch (_) { /* not JSON */ }
    throw new ApiError(msg);
  }
  return r;
}

async function apiJson(method, path, body) {
  const r = await api(method, path, body);
  return r.status === 204 ? null : r.json();
}

function status(msg, isError) {
  const s = $('status');
  s.textContent = msg || '';
  s.classList.toggle('error', !!isError);
}

function age(iso) {
  const s = Math.max(0, Math.round((Date.now() - Date.parse(iso)) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

const mib = (bytes) => bytes / (1024 * 1024);

// ---- metrics history (visible rows only) ----

const history = new Map(); // id -> [{t, cpu, mem, memTotal}] oldest first

function addSamples(id, samples) {
  const h = history.get(id) || [];
  for (const m of samples) {
    const t = m.timestampUnix !== undefined ? m.timestampUnix * 1000 : Date.parse(m.timestamp);
    if (h.length && h[h.length - 1].t >= t) continue;
    h.push({ t, cpu: m.cpuUsedPct, mem: m.memUsed, memTotal: m.memTotal });
  }
  const cut = Date.now() - HISTORY_S * 1000;
  while (h.length && h[0].t < cut) h.shift();
  history.set(id, h);
}

async function fetchHistories(ids) {
  const start = Math.floor(Date.now() / 1000) - HISTORY_S;
  const todo = ids.filter((id) => !history.has(id));
  const worker = async () => {
    while (todo.length) {
      const id = todo.shift();
      try {
        const ms = await apiJson('GET', `/sandboxes/${encodeURIComponent(id)}/metrics?start=${start}`);
        addSamples(id, ms || []);
      } catch (_) {
        history.set(id, history.get(id) || []);
      }
    }
  };
  await Promise.all(Array.from({ length: HISTORY_FETCHES }, worker));
}

async function fetchLatest(ids) {
  if (!ids.length) return;
  const q = encodeURIComponent(ids.join(','));
  const j = await apiJson('GET', `/sandboxes/metrics?sandbox_ids=${q}`);
  for (const [id, m] of Object.entries((j && j.sandboxes) || {})) addSamples(id, [m]);
}

// A polyline chart of `values` (0..max) in a w x h box.
function chart(values, max, w, h, cls, labels) {
  const s = svg('svg', { width: w, height: h, viewBox: `0 0 ${w} ${h}`, class: cls });
  s.append(svg('rect', { x: 0.5, y: 0.5, width: w - 1, height: h - 1, class: 'frame' }));
  if (values.length) {
    const top = max > 0 ? max : 1;
    // One sample: a level line across, not an invisible point.
    const vs = values.length === 1 ? [values[0], values[0]] : values;
    const pts = vs.map((v, i) => {
      const x = 1 + (i * (w - 3)) / (vs.length - 1);
      const y = h - 2 - (Math.min(Math.max(v, 0), top) / top) * (h - 4);
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    const first = pts[0].split(',')[0];
    const last = pts[pts.length - 1].split(',')[0];
    s.append(svg('polygon', { points: `${first},${h - 1} ${pts.join(' ')} ${last},${h - 1}`, class: 'area' }));
    s.append(svg('polyline', { points: pts.join(' ') }));
  }
  if (labels) {
    const t = svg('text', { x: 4, y: 12 });
    t.textContent = labels;
    s.append(t);
  }
  return s;
}

// CPU charts are scaled to the highest use seen (at least 5 %): low use still has a shape;
// the number beside says how much it is.
function cpuScale(h) {
  return Math.max(5, ...h.map((p) => p.cpu * 1.2));
}

function cpuCell(id) {
  const h = history.get(id) || [];
  const last = h[h.length - 1];
  return el('div', { class: 'metric' },
    chart(h.map((p) => p.cpu), cpuScale(h), 80, 22, 'spark'),
    el('span', { class: 'num' }, last ? `${last.cpu.toFixed(1)}%` : '–'));
}

function memCell(id) {
  const h = history.get(id) || [];
  const last = h[h.length - 1];
  const max = last ? last.memTotal : 0;
  return el('div', { class: 'metric' },
    chart(h.map((p) => p.mem), max, 80, 22, 'spark'),
    el('span', { class: 'num' }, last ? `${mib(last.mem).toFixed(0)} / ${mib(last.memTotal).toFixed(0)} MiB` : '–'));
}

// ---- the sandbox list ----

const list = {
  tokens: [null], // page i starts after tokens[i]
  page: 0,
  nextToken: null,
  rows: [],
  busy: new Map(), // id -> what is being done ("pausing", ...)
  selected: null,
};

function listQuery() {
  const p = new URLSearchParams();
  p.set('limit', $('page-size').value);
  const st = $('state-filter').value;
  if (st) p.set('state', st);
  const tok = list.tokens[list.page];
  if (tok) p.set('nextToken', tok);
  return p.toString();
}

async function loadList() {
  const r = await api('GET', `/v2/sandboxes?${listQuery()}`);
  list.nextToken = r.headers.get('x-next-token');
  list.rows = await r.json();
  const ids = list.rows.filter((s) => s.state === 'running').map((s) => s.sandboxID);
  // Rows that left the page take their history with them.
  for (const id of [...history.keys()]) {
    if (!list.rows.some((s) => s.sandboxID === id) && id !== list.selected) history.delete(id);
  }
  renderList();
  await fetchHistories(ids);
  await fetchLatest(ids);
  renderList();
}

function actionButton(label, action, id, cls) {
  return el('button', { type: 'button', class: cls || '', 'data-action': action, 'data-id': id }, label);
}

function renderList() {
  const body = $('sandbox-rows');
  const rows = list.rows.map((s) => {
    const id = s.sandboxID;
    const busy = list.busy.get(id);
    const shown = busy || s.state;
    const stateCls = busy ? 'state-busy' : `state-${s.state}`;
    const acts = el('td', { class: 'actions' });
    if (!busy) {
      if (s.state === 'running') acts.append(actionButton('Pause', 'pause', id));
      if (s.state === 'paused') acts.append(actionButton('Resume', 'resume', id));
      if (s.state === 'running' || s.state === 'paused') acts.append(actionButton('Fork', 'fork', id));
      acts.append(actionButton('Logs', 'logs', id));
      acts.append(actionButton('Kill', 'kill', id, 'danger'));
    }
    const tr = el('tr', { 'data-id': id, class: list.selected === id ? 'selected' : '' },
      el('td', { class: 'id' }, el('a', { href: '#', 'data-action': 'logs', 'data-id': id }, id)),
      el('td', {}, el('span', { class: `state ${stateCls}`, 'data-state': shown }, shown)),
      el('td', { class: 'template' }, s.templateID),
      el('td', { title: s.startedAt }, age(s.startedAt)),
      el('td', {}, s.cpuCount),
      el('td', {}, s.state === 'running' ? cpuCell(id) : '–'),
      el('td', {}, s.state === 'running' ? memCell(id) : `${s.memoryMB} MiB`),
      acts);
    return tr;
  });
  body.replaceChildren(...rows);
  $('empty').hidden = list.rows.length > 0;
  $('prev').disabled = list.page === 0;
  $('next').disabled = !list.nextToken;
  $('page-label').textContent = `page ${list.page + 1}`;
  if (list.selected) renderCharts(list.selected);
}

async function act(action, id) {
  const ask = {
    pause: `Pause sandbox ${id}?`,
    resume: `Resume sandbox ${id}?`,
    fork: `Fork sandbox ${id} into a new sandbox?`,
    kill: `Kill sandbox ${id}? Its memory and files are gone for good.`,
  }[action];
  if (!ask || !window.confirm(ask)) return;
  const doing = { pause: 'pausing', resume: 'resuming', fork: 'forking', kill: 'killing' }[action];
  list.busy.set(id, doing);
  renderList();
  status(`${doing} ${id}…`);
  try {
    const path = `/sandboxes/${encodeURIComponent(id)}`;
    if (action === 'pause') await api('POST', `${path}/pause`, {});
    if (action === 'resume') await api('POST', `${path}/resume`, {});
    if (action === 'kill') await api('DELETE', path);
    let done = `${action}: ${id} done`;
    if (action === 'fork') {
      const out = await apiJson('POST', `${path}/fork`, {});
      const child = out && out[0] && out[0].sandbox && out[0].sandbox.sandboxID;
      done = `forked ${id} into ${child || 'a new sandbox'}`;
    }
    if (action === 'kill') {
      history.delete(id);
      if (list.selected === id) closeDetail();
    }
    status(done);
  } catch (e) {
    status(`${action} ${id} failed: ${e.message}`, true);
  } finally {
    list.busy.delete(id);
  }
  await refresh();
}

// ---- one sandbox: info, charts, logs ----

function renderCharts(id) {
  const h = history.get(id) || [];
  const last = h[h.length - 1];
  $('chart-cpu').replaceChildren(chart(h.map((p) => p.cpu), cpuScale(h), 360, 90, 'big',
    last ? `now ${last.cpu.toFixed(1)}% · ${h.length} samples` : 'no samples (not running?)'));
  $('chart-mem').replaceChildren(chart(h.map((p) => mib(p.mem)), last ? mib(last.memTotal) : 0, 360, 90, 'big',
    last ? `now ${mib(last.mem).toFixed(1)} of ${mib(last.memTotal).toFixed(0)} MiB` : 'no samples (not running?)'));
}

async function openDetail(id) {
  list.selected = id;
  $('detail').hidden = false;
  $('detail-id').textContent = id;
  renderList();
  try {
    const info = await apiJson('GET', `/sandboxes/${encodeURIComponent(id)}`);
    const dl = $('detail-info');
    const pairs = [
      ['State', info.state], ['Template', info.templateID], ['Started', info.startedAt],
      ['Ends', info.endAt], ['vCPUs', info.cpuCount], ['Memory', `${info.memoryMB} MiB`],
      ['On timeout', info.lifecycle ? info.lifecycle.onTimeout : ''],
      ['Metadata', JSON.stringify(info.metadata || {})],
    ];
    dl.replaceChildren(...pairs.flatMap(([k, v]) => [el('dt', {}, k), el('dd', {}, v)]));
  } catch (e) {
    status(`sandbox ${id}: ${e.message}`, true);
  }
  history.delete(id);
  await fetchHistories([id]);
  renderCharts(id);
  await loadLogs();
  $('detail').scrollIntoView({ block: 'nearest' });
}

function closeDetail() {
  list.selected = null;
  $('detail').hidden = true;
  renderList();
}

async function loadLogs() {
  const id = list.selected;
  if (!id) return;
  const p = new URLSearchParams({ direction: 'backward', limit: '200', level: $('log-level').value });
  const search = $('log-search').value;
  if (search) p.set('search', search);
  try {
    const j = await apiJson('GET', `/v2/sandboxes/${encodeURIComponent(id)}/logs?${p}`);
    const lines = ((j && j.logs) || []).slice().reverse();
    $('log-rows').replaceChildren(...lines.map((l) => el('tr', {},
      el('td', { class: 'time', title: l.timestamp }, (l.timestamp || '').replace('T', ' ').replace('Z', '')),
      el('td', {}, l.level),
      el('td', {}, (l.fields && l.fields.source) || ''),
      el('td', { class: 'msg' }, l.message))));
    $('logs-empty').hidden = lines.length > 0;
  } catch (e) {
    status(`logs of ${id}: ${e.message}`, true);
  }
}

// ---- templates and snapshots ----

async function loadTemplates() {
  const ts = await apiJson('GET', '/templates');
  $('template-rows').replaceChildren(...ts.map((t) => el('tr', { 'data-id': t.templateID },
    el('td', { class: 'id' }, t.templateID),
    el('td', {}, t.cpuCount),
    el('td', {}, `${t.memoryMB} MiB`),
    el('td', { title: t.createdAt }, `${age(t.createdAt)} ago`),
    el('td', {}, t.buildStatus))));
  $('templates-empty').hidden = ts.length > 0;
}

const snaps = { tokens: [null], page: 0, next: null };

async function loadSnapshots() {
  const p = new URLSearchParams({ limit: '50' });
  const tok = snaps.tokens[snaps.page];
  if (tok) p.set('nextToken', tok);
  const r = await api('GET', `/snapshots?${p}`);
  snaps.next = r.headers.get('x-next-token');
  const ss = await r.json();
  $('snapshot-rows').replaceChildren(...ss.map((s) => el('tr', {},
    el('td', { class: 'id' }, s.snapshotID),
    el('td', {}, (s.names || []).join(', ')))));
  $('snapshots-empty').hidden = ss.length > 0;
  $('snap-prev').disabled = snaps.page === 0;
  $('snap-next').disabled = !snaps.next;
  $('snap-page-label').textContent = `page ${snaps.page + 1}`;
}

// ---- nodes (when the service is a node of a cluster) ----

function nodeState(n) {
  if (!n.live) return 'lease ended';
  if (n.drained) return 'drained';
  if (n.draining) return 'draining';
  return n.takesSandboxes ? 'live' : 'live (gateway)';
}

async function loadNodes() {
  const ns = await apiJson('GET', '/nodes');
  $('node-rows').replaceChildren(...ns.map((n) => el('tr', { 'data-node': n.name },
    el('td', { class: 'id' }, n.name),
    el('td', {}, n.address),
    el('td', { class: 'node-state' }, nodeState(n)),
    el('td', {}, n.takesSandboxes ? `${n.usedVcpus} / ${n.vcpus}` : '-'),
    el('td', {}, n.takesSandboxes ? `${n.usedMemMib} / ${n.memMib} MiB` : '-'),
    el('td', {}, n.sandboxes),
    el('td', {}, (n.templates || []).join(', ')))));
}

// The nodes tab is shown only when the service is a node of a cluster.
async function showNodesTab() {
  const r = await fetch('/nodes', { headers: { 'X-Clade-Dashboard': '1' }, credentials: 'same-origin' });
  $('tab-nodes').hidden = !r.ok;
}

// ---- wiring ----

let tab = 'sandboxes';
let polling = false;

async function refresh() {
  if (polling) return;
  polling = true;
  try {
    if (tab === 'sandboxes') await loadList();
    if (tab === 'templates') await loadTemplates();
    if (tab === 'snapshots') await loadSnapshots();
    if (tab === 'nodes') await loadNodes();
    if (!$('status').classList.contains('error') && !$('status').textContent) status('');
  } catch (e) {
    status(e.message, true);
  } finally {
    polling = false;
  }
}

function showTab(name) {
  tab = name;
  for (const b of document.querySelectorAll('.tab')) b.classList.toggle('active', b.dataset.tab === name);
  for (const v of document.querySelectorAll('.view')) v.hidden = v.id !== `view-${name}`;
  refresh();
}

function resetPaging() {
  list.tokens = [null];
  list.page = 0;
  refresh();
}

document.addEventListener('DOMContentLoaded', () => {
  for (const b of document.querySelectorAll('.tab')) b.addEventListener('click', () => showTab(b.dataset.tab));
  $('refresh').addEventListener('click', refresh);
  $('state-filter').addEventListener('change', resetPaging);
  $('page-size').addEventListener('change', resetPaging);
  $('next').addEventListener('click', () => {
    if (!list.nextToken) return;
    list.tokens[list.page + 1] = list.nextToken;
    list.page += 1;
    refresh();
  });
  $('prev').addEventListener('click', () => {
    if (list.page > 0) list.page -= 1;
    refresh();
  });
  $('snap-next').addEventListener('click', () => {
    if (!snaps.next) return;
    snaps.tokens[snaps.page + 1] = snaps.next;
    snaps.page += 1;
    refresh();
  });
  $('snap-prev').addEventListener('click', () => {
    if (snaps.page > 0) snaps.page -= 1;
    refresh();
  });
  $('sandbox-rows').addEventListener('click', (ev) => {
    const t = ev.target.closest('[data-action]');
    if (!t) return;
    ev.preventDefault();
    const { action, id } = t.dataset;
    if (action === 'logs') openDetail(id);
    else act(action, id);
  });
  $('detail-close').addEventListener('click', closeDetail);
  $('log-refresh').addEventListener('click', loadLogs);
  $('log-level').addEventListener('change', loadLogs);
  $('log-search').addEventListener('change', loadLogs);
  showNodesTab().catch(() => {});
  refresh();
  setInterval(refresh, POLL_MS);
});
