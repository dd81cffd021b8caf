// A job: its facts, why it waits (per cluster), its pods (node, GPU indices), the timeline
// of its events, its spec as YAML, the link to its trace, and Cancel for one's own jobs.
import * as api from './api.js';
import { clear, duration, h, rowOf, stateBadge, TERMINAL, timeEl, UNPLACED, when } from './dom.js';
import { toYaml } from './yaml.js';

function traceLink(ctx, record) {
  if (!record.traceId) return h('span', { class: 'note' }, 'no trace id');
  if (!ctx.traceTemplate) {
    return h('span', { class: 'note' }, `trace ${record.traceId} (no --trace-url-template)`);
  }
  const url = ctx.traceTemplate.split('{trace_id}').join(encodeURIComponent(record.traceId));
  return h('a', { href: url, id: 'trace-link', target: '_blank', rel: 'noopener noreferrer' },
    `Trace ${record.traceId}`);
}

function gpusText(pod) {
  if (!pod.gpus || !pod.gpus.length) return '';
  return pod.gpus.map((g) => (g.milli >= 1000 ? `${g.index}` : `${g.index} (${g.milli}m)`)).join(', ');
}

function podsTable(record) {
  const pods = record.status.pods || [];
  if (!pods.length) return h('p', { class: 'note' }, 'No pods yet.');
  return h('table', { id: 'pods' },
    h('caption', { class: 'visually-hidden' }, 'Pods'),
    h('thead', {}, h('tr', {}, ['Pod', 'Task', 'Node', 'GPU indices', 'Phase', 'Reason']
      .map((t) => h('th', { scope: 'col' }, t)))),
    h('tbody', {}, pods.map((pod) => h('tr', {},
      h('td', {}, pod.name), h('td', {}, pod.task), h('td', {}, pod.node),
      h('td', {}, gpusText(pod)), h('td', {}, pod.phase), h('td', {}, pod.reason || '')))));
}

function timeline(record) {
  const events = record.status.events || [];
  return h('ol', { class: 'timeline', id: 'timeline', 'aria-label': 'Events, oldest first' },
    events.map((event) => h('li', { dataset: { state: event.state } },
      timeEl(event.time), stateBadge(event.state), ' ',
      h('strong', {}, event.reason),
      event.cluster ? ` on ${event.cluster}` : '',
      event.message ? h('div', { class: 'note' }, event.message) : null)));
}

// A queued job's place in line and its estimated start (`position`, `eta` of why).
function inLine(why) {
  const place = why.position;
  if (!place && !why.eta && !why.etaReason) return null;
  return h('dl', { class: 'facts', id: 'position' },
    place ? [
      h('dt', {}, 'Position in its queue'), h('dd', {}, String(place.inQueue)),
      h('dt', {}, 'Among jobs wanting ' + ((place.models || []).join(', ') || 'no GPU model')),
      h('dd', {}, `${place.competing} (${place.gpusAhead} GPUs ahead)`),
    ] : null,
    h('dt', {}, 'Estimated start'),
    h('dd', {}, why.eta ? timeEl(why.eta) : `unknown: ${why.etaReason}`));
}

function whyPanel(why) {
  if (!why) return null;
  const rows = why.clusters || [];
  return h('section', { class: 'panel', id: 'why', 'aria-labelledby': 'why-title' },
    h('h2', { id: 'why-title' }, 'Why it waits'),
    h('p', {}, why.message),
    inLine(why),
    rows.length ? h('table', {},
      h('thead', {}, h('tr', {}, h('th', { scope: 'col' }, 'Cluster'), h('th', { scope: 'col' }, 'Reasons'))),
      h('tbody', {}, rows.map((c) => h('tr', {},
        h('td', {}, c.cluster),
        h('td', {}, c.reasons.map((r, i) => h('div', {}, h('code', {}, c.codes[i]), ' ', r)))))))
      : null);
}

export function render(main, ctx, jobId) {
  let record = null;
  let why = null;
  let disposed = false;
  let whyAsked = 0;
  let confirming = false;
  const body = h('div', { id: 'job' });
  const heading = h('h1', {}, `Job ${jobId}`);
  const status = h('p', { role: 'status', id: 'job-status' });
  main.append(h('p', {}, h('a', { href: '#/jobs' }, '← Jobs')), heading, status, body);

  async function askWhy() {
    if (!record || !UNPLACED.has(record.status.state)) {
      why = null;
      return;
    }
    whyAsked = Date.now();
    try {
      why = await api.get(`/v1/jobs/${encodeURIComponent(jobId)}/why`);
    } catch {
      why = null;
    }
  }

  async function cancel() {
    status.textContent = 'Cancelling…';
    try {
      record = await api.remove(`/v1/jobs/${encodeURIComponent(jobId)}`);
      status.textContent = record.status.cancelRequested && !TERMINAL.has(record.status.state)
        ? 'Cancel requested: its agent is deleting the pods.'
        : `Job ${record.status.state}.`;
    } catch (failure) {
      status.textContent = `Cancel failed: ${failure.message}`;
    }
    confirming = false;
    draw();
    document.getElementById('job-actions')?.querySelector('button, a')?.focus();
  }

  function actions() {
    const out = h('div', { class: 'actions', id: 'job-actions' });
    const live = !TERMINAL.has(record.status.state);
    if (live && ctx.canCancel(record)) {
      if (!confirming) {
        out.append(h('button', {
          type: 'button', class: 'danger', id: 'cancel',
          onclick: () => { confirming = true; draw(); document.getElementById('cancel-yes').focus(); },
        }, 'Cancel job…'));
      } else {
        out.append(
          h('span', { id: 'cancel-question' }, `Cancel ${record.job.metadata.name}? Its pods are deleted.`),
          h('button', { type: 'button', class: 'danger primary', id: 'cancel-yes', onclick: cancel,
            'aria-describedby': 'cancel-question' }, 'Yes, cancel it'),
          h('button', { type: 'button', id: 'cancel-no',
            onclick: () => { confirming = false; draw(); document.getElementById('cancel').focus(); } },
          'Keep it'));
      }
    }
    out.append(traceLink(ctx, record));
    return out;
  }

  function draw() {
    if (disposed || !record) return;
    const row = rowOf(record);
    heading.textContent = `Job ${row.name}`;
    document.title = `${row.name} · gpufed`;
    clear(body).append(
      h('p', {}, stateBadge(row.state),
        record.status.cancelRequested && !TERMINAL.has(row.state) ? ' cancel requested' : ''),
      actions(),
      h('div', { class: 'columns' },
        h('section', { class: 'panel', 'aria-labelledby': 'facts-title' },
          h('h2', { id: 'facts-title' }, 'Facts'),
          h('dl', { class: 'facts' },
            ...[
              ['Id', record.id], ['Tenant', record.tenant], ['Queue', row.queue],
              ['Cluster', row.cluster || '—'], ['GPUs', String(row.gpus)],
              ['Submitted', when(row.submitted)], ['Waited', duration(row.waited)],
              ['Ran', duration(row.ran) || '—'], ['Attempts', String(record.status.attempts)],
            ].flatMap(([k, v]) => [h('dt', {}, k), h('dd', {}, v)]))),
        whyPanel(why),
        h('section', { class: 'panel', 'aria-labelledby': 'timeline-title' },
          h('h2', { id: 'timeline-title' }, 'Timeline'), timeline(record))),
      h('h2', {}, 'Pods'), podsTable(record),
      h('h2', { id: 'spec-title' }, 'Spec'),
      h('pre', { class: 'yaml', id: 'spec', tabindex: 0, 'aria-labelledby': 'spec-title' },
        toYaml(record.job)));
  }

  (async () => {
    try {
      record = await api.get(`/v1/jobs/${encodeURIComponent(jobId)}`);
    } catch (failure) {
      status.textContent = failure.status === 404 ? `No job ${jobId}.` : failure.message;
      return;
    }
    await askWhy();
    draw();
  })();
  // waited and ran grow, and a queued job's reasons change with each cycle: every 5 s,
  // unless the focus is inside (a redraw would take it away)
  let ticks = 0;
  const ticker = setInterval(async () => {
    ticks += 1;
    if (confirming || body.contains(document.activeElement)) return;
    const queued = UNPLACED.has(record?.status.state);
    // every second while a queued job's reasons are not known yet (no cycle planned it)
    if (ticks % 5 && !(queued && !why?.reasons?.length)) return;
    if (queued) await askWhy();
    draw();
  }, 1000);

  return {
    async onEvent(name, data) {
      if (name === 'resync' || (name === 'job' && data.id === jobId)) {
        if (name === 'job') record = data;
        if (record && TERMINAL.has(record.status.state)) status.textContent = '';
        else record = await api.get(`/v1/jobs/${encodeURIComponent(jobId)}`).catch(() => record);
        const unplaced = UNPLACED.has(record?.status.state);
        if (unplaced && Date.now() - whyAsked > 1000) await askWhy();
        else if (!unplaced) why = null;
        draw();
      }
    },
    dispose() {
      disposed = true;
      clearInterval(ticker);
    },
  };
}
