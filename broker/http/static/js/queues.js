// Queues: per GPU model, GPUs used within the guarantee and borrowed beyond it as bars, the
// guarantee, the limit and the fair share marked; pending and running jobs, dominant share.
import * as api from './api.js';
import { clear, h } from './dom.js';

function bar(usage) {
  const guaranteed = usage.guaranteed || 0;
  const used = usage.inUse || 0;
  const share = usage.fairShare || 0;
  // the fair share may be the whole fleet (nobody else asks): it does not set the scale
  const scale = 1.1 * Math.max(1, used, guaranteed, usage.limit ?? 0);
  const pct = (n) => `${Math.min(100, (100 * n) / scale)}%`;
  const within = Math.min(used, guaranteed);
  const borrowed = Math.max(0, used - guaranteed);
  const track = h('div', { class: 'bar', 'aria-hidden': 'true' });
  const usedEl = h('div', { class: 'used' });
  usedEl.style.width = pct(within);
  const borrowedEl = h('div', { class: 'borrowed' });
  borrowedEl.style.left = pct(within);
  borrowedEl.style.width = pct(borrowed);
  const guarantee = h('div', { class: 'mark', title: `guaranteed ${guaranteed}` });
  guarantee.style.left = `calc(${pct(guaranteed)} - 1px)`;
  const fair = h('div', { class: 'mark share', title: `fair share ${share.toFixed(1)}` });
  fair.style.left = `calc(${pct(share)} - 1px)`;
  track.append(usedEl, borrowedEl, guarantee, fair);
  const limit = usage.limit === null || usage.limit === undefined ? 'no limit' : `limit ${usage.limit}`;
  const words = `${used} in use: ${within} within the guarantee of ${guaranteed}, ${borrowed} borrowed; ` +
    `${limit}; fair share ${share.toFixed(1)}`;
  return h('div', { class: 'bar-row', dataset: { model: usage.model } },
    h('div', {}, h('strong', {}, usage.model), h('div', { class: 'bar-text' }, words)),
    track);
}

function card(queue) {
  const s = queue.status;
  const id = `queue-${queue.name}`;
  return h('section', { class: 'panel queue', 'aria-labelledby': id, dataset: { queue: queue.name } },
    h('h2', { id }, queue.name),
    h('dl', { class: 'facts' },
      ...[
        ['Tenant', queue.spec.tenant], ['Cohort', queue.spec.cohort], ['Weight', String(queue.spec.weight)],
        ['Pending jobs', String(s.pendingJobs)], ['Running jobs', String(s.runningJobs)],
        ['Dominant share', `${(100 * s.dominantShare).toFixed(1)} %`],
        ['Preempted', String(s.preemptions)],
        ['Declared', queue.declared ? `yes (${queue.source})` : 'no (open queue)'],
      ].flatMap(([k, v]) => [h('dt', {}, k), h('dd', {}, v)])),
    s.gpus.length ? s.gpus.map(bar) : h('p', { class: 'note' }, 'No GPUs in use, none guaranteed.'),
    queue.warnings.map((w) => h('p', { class: 'error' }, w)));
}

// A tenant's allotment: what the fleet admin lets its queues claim together (its tenant-admin
// is bound by it), and what they claim now, per GPU model: claimed/allotted, '-' unbounded.
function allotment(share) {
  const a = share.allotment;
  const id = `allotment-${share.tenant}`;
  const bound = (n) => (n === null || n === undefined ? '-' : String(n));
  const rows = share.uses.map((u) => h('tr', { dataset: { model: u.model } },
    h('td', {}, u.model),
    h('td', {}, `${u.guaranteed}/${u.allottedGuaranteed}`),
    h('td', {}, `${bound(u.limit)}/${bound(u.allottedLimit)}`)));
  return h('section', { class: 'panel allotment', 'aria-labelledby': id, dataset: { tenant: share.tenant } },
    h('h2', { id }, `Allotment of ${share.tenant}`),
    h('dl', { class: 'facts' },
      ...[
        ['Set by', share.declared ? 'the fleet admin' : 'its queues in the queues file'],
        ['Highest weight', String(a.maxWeight)],
        ['Highest priority class', a.maxPriorityClass || 'the default'],
        ['Cohorts', a.cohorts.join(', ') || 'none'],
      ].flatMap(([k, v]) => [h('dt', {}, k), h('dd', {}, v)])),
    h('table', {},
      h('thead', {}, h('tr', {},
        h('th', {}, 'Model'), h('th', {}, 'Guaranteed: claimed/allotted'),
        h('th', {}, 'Limits: claimed/allotted'))),
      h('tbody', {}, rows)),
    share.warnings.map((w) => h('p', { class: 'error' }, w)));
}

export function render(main, ctx) {
  let disposed = false;
  let timer = 0;
  const list = h('div', { id: 'queues' });
  const error = h('p', { class: 'error', role: 'alert' });
  main.append(
    h('h1', {}, 'Queues'),
    h('div', { class: 'legend', 'aria-hidden': 'true' },
      h('span', {}, h('span', { class: 'swatch sw-whole' }), 'in use within the guarantee'),
      h('span', {}, h('span', { class: 'swatch sw-borrowed' }), 'borrowed'),
      h('span', {}, h('span', { class: 'swatch sw-guaranteed' }), 'guaranteed'),
      h('span', {}, h('span', { class: 'swatch sw-share' }), 'fair share')),
    error, list);

  async function load() {
    try {
      const body = await api.get('/v1/queues');
      if (disposed) return;
      error.textContent = '';
      clear(list).append(
        ...(body.warnings || []).map((w) => h('p', { class: 'note' }, w)),
        h('div', { class: 'columns' }, body.items.map(card)),
        ...((body.allotments || []).length
          ? [h('h2', {}, 'Allotments'), h('div', { class: 'columns' }, body.allotments.map(allotment))]
          : []));
      list.dataset.loaded = String(Date.now());
    } catch (failure) {
      if (!disposed) error.textContent = `Could not read the queues: ${failure.message}`;
    }
  }

  load();
  const ticker = setInterval(load, 5000);
  return {
    onEvent(name) {
      // jobs moving change usage: read again, at most once a second
      if ((name === 'job' || name === 'resync') && !timer) {
        timer = setTimeout(() => { timer = 0; load(); }, 1000);
      }
    },
    dispose() {
      disposed = true;
      clearInterval(ticker);
      clearTimeout(timer);
    },
  };
}
