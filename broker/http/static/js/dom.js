// Small DOM helpers: elements built with text content only (never HTML strings), formats.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith('on') && typeof value === 'function') {
      el.addEventListener(key.slice(2), value);
    } else if (key === 'class') {
      el.className = value;
    } else if (key === 'dataset') {
      Object.assign(el.dataset, value);
    } else if (value === true) {
      el.setAttribute(key, '');
    } else {
      el.setAttribute(key, String(value));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

export function duration(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return '';
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(s % 60).padStart(2, '0')}s`;
  const hours = Math.floor(m / 60);
  if (hours < 48) return `${hours}h ${String(m % 60).padStart(2, '0')}m`;
  return `${Math.floor(hours / 24)}d ${hours % 24}h`;
}

export function when(iso) {
  if (!iso) return '';
  const date = new Date(iso);
  const pad = (n) => String(n).padStart(2, '0');
  return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
    `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
}

export function timeEl(iso) {
  return h('time', { datetime: iso }, when(iso));
}

export function stateBadge(state) {
  return h('span', { class: `state state-${state}` }, state);
}

export const TERMINAL = new Set(['Succeeded', 'Failed', 'Cancelled']);
export const STATES = ['Waiting', 'Queued', 'Dispatched', 'Running', 'Succeeded', 'Failed', 'Cancelled'];
// not placed yet: `why` says why (a Waiting job: the dependencies it waits for)
export const UNPLACED = new Set(['Waiting', 'Queued']);

// A job record as one row of the jobs table (the same columns the CLI shows and more).
export function rowOf(record, now = Date.now()) {
  const events = record.status.events || [];
  const first = (state) => events.find((e) => e.state === state);
  const created = Date.parse(record.created);
  const dispatched = first('Dispatched');
  const running = first('Running');
  const state = record.status.state;
  const end = TERMINAL.has(state) && events.length ? Date.parse(events[events.length - 1].time) : null;
  const waitedUntil = dispatched ? Date.parse(dispatched.time) : (end ?? now);
  const started = running ? Date.parse(running.time) : null;
  return {
    id: record.id,
    name: record.job.metadata.name,
    queue: record.job.spec.queue,
    tenant: record.tenant,
    state,
    cluster: record.status.cluster || '',
    gpus: gpusOf(record.job),
    submitted: record.created,
    waited: waitedUntil - created,
    ran: started === null ? null : (end ?? now) - started,
  };
}

export function gpusOf(job) {
  let total = 0;
  for (const task of job.spec.tasks || []) {
    let perPod = 0;
    for (const container of task.template?.spec?.containers || []) {
      const limit = container.resources?.limits?.['nvidia.com/gpu'];
      if (limit !== undefined) perPod += Number(limit) || 0;
    }
    total += perPod * (task.replicas ?? 1);
  }
  return total;
}
