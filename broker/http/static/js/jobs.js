// Jobs: a page of GET /v1/jobs (filters by state, queue, cluster and text, and the order,
// newest or oldest first, on the broker; the column buttons sort the page shown), kept
// current by the event stream.
import * as api from './api.js';
import { clear, duration, h, rowOf, STATES, stateBadge, timeEl } from './dom.js';

const filters = { state: '', queue: '', cluster: '', text: '', sort: 'newest', limit: '50' };
const SEARCH_DELAY_MS = 250; // typing pauses this long before the broker is asked
const ASCII_UPPER = /[A-Z]/g;
const sorting = { key: '', dir: 1 };

const COLUMNS = [
  { key: 'name', label: 'Name' },
  { key: 'queue', label: 'Queue' },
  { key: 'tenant', label: 'Tenant' },
  { key: 'state', label: 'State' },
  { key: 'cluster', label: 'Cluster' },
  { key: 'gpus', label: 'GPUs', num: true },
  { key: 'submitted', label: 'Submitted' },
  { key: 'waited', label: 'Waited', num: true },
  { key: 'ran', label: 'Ran', num: true },
];

// ASCII case only, as the broker folds it (names and ids are DNS labels)
const fold = (text) => text.replace(ASCII_UPPER, (c) => c.toLowerCase());

// the broker's filters, for a job the event stream brings
function matchesServer(record) {
  const text = fold(filters.text);
  return (!filters.state || record.status.state === filters.state) &&
    (!filters.queue || record.job.spec.queue === filters.queue) &&
    (!filters.cluster || record.status.cluster === filters.cluster) &&
    (!text || fold(record.job.metadata.name).includes(text) || fold(record.id).includes(text));
}

function select(id, label, options, value, onChange) {
  const el = h('select', { id, name: id });
  for (const [optionValue, text] of [['', 'All'], ...options.map((o) => [o, o])]) {
    el.append(h('option', { value: optionValue, selected: optionValue === value }, text));
  }
  el.addEventListener('change', () => onChange(el.value));
  return h('label', { for: id }, label, el);
}

export function render(main, ctx) {
  const records = new Map(); // the page shown, in the broker's order (newest first)
  const rowEls = new Map();
  const tokens = [null]; // the continue token of each page seen
  let pageIndex = 0;
  let next = null;
  let loading = null;
  let frame = 0;
  let typing = 0;
  let disposed = false;

  const tbody = h('tbody', { id: 'jobs-body' });
  const count = h('p', { class: 'note', id: 'jobs-count' });
  const error = h('p', { class: 'error', role: 'alert' });
  const prev = h('button', { type: 'button', id: 'jobs-prev' }, 'Previous page');
  const nextButton = h('button', { type: 'button', id: 'jobs-next' }, 'Next page');
  const pageLabel = h('span', { 'aria-live': 'polite' });
  const headers = COLUMNS.map((column) => {
    const button = h('button', { type: 'button', 'data-sort': column.key }, column.label);
    const th = h('th', { scope: 'col', class: column.num ? 'num' : '' }, button);
    button.addEventListener('click', () => {
      sorting.dir = sorting.key === column.key ? -sorting.dir : 1;
      sorting.key = column.key;
      schedule();
    });
    return th;
  });
  const filterBar = h('form', { class: 'filters', role: 'search', 'aria-label': 'Filter jobs' });
  filterBar.addEventListener('submit', (event) => event.preventDefault());

  function reload(first = true) {
    if (first) {
      pageIndex = 0;
      tokens.length = 1;
    }
    const asked = api.get('/v1/jobs', {
      query: {
        state: filters.state, queue: filters.queue, cluster: filters.cluster,
        q: filters.text, sort: filters.sort, limit: filters.limit, continue: tokens[pageIndex],
      },
    }).then((body) => {
      if (disposed || asked !== loading) return;
      records.clear();
      for (const record of body.items) records.set(record.id, record);
      next = body.metadata?.continue || null;
      error.textContent = '';
      schedule();
    }).catch((failure) => {
      if (!disposed) error.textContent = `Could not read the jobs: ${failure.message}`;
    });
    loading = asked;
    return asked;
  }

  function buildFilters(queues, clusters) {
    clear(filterBar);
    const search = h('input', {
      id: 'jobs-text', name: 'text', type: 'search', value: filters.text,
      placeholder: 'name or id', maxlength: '200',
    });
    search.addEventListener('input', () => {
      clearTimeout(typing);
      typing = setTimeout(() => {
        filters.text = search.value;
        reload();
      }, SEARCH_DELAY_MS);
    });
    const order = h('select', { id: 'jobs-sort', name: 'sort' },
      [['newest', 'Newest first'], ['oldest', 'Oldest first']].map(([value, text]) =>
        h('option', { value, selected: value === filters.sort }, text)));
    order.addEventListener('change', () => {
      filters.sort = order.value;
      reload();
    });
    const sizes = h('select', { id: 'jobs-limit', name: 'limit' },
      ['25', '50', '100', '500'].map((n) => h('option', { value: n, selected: n === filters.limit }, n)));
    sizes.addEventListener('change', () => {
      filters.limit = sizes.value;
      reload();
    });
    const withValue = (names, value) => (value && !names.includes(value) ? [...names, value] : names);
    filterBar.append(
      select('jobs-state', 'State', STATES, filters.state, (v) => { filters.state = v; reload(); }),
      select('jobs-queue', 'Queue', withValue(queues, filters.queue), filters.queue,
        (v) => { filters.queue = v; reload(); }),
      select('jobs-cluster', 'Cluster', withValue(clusters, filters.cluster), filters.cluster,
        (v) => { filters.cluster = v; reload(); }),
      h('label', { for: 'jobs-text' }, 'Search name or id', search),
      h('label', { for: 'jobs-sort' }, 'Order', order),
      h('label', { for: 'jobs-limit' }, 'Per page', sizes),
    );
  }

  function schedule() {
    if (!frame) frame = requestAnimationFrame(draw);
  }

  function cells(row) {
    return [
      h('a', { href: `#/jobs/${encodeURIComponent(row.id)}` }, row.name),
      row.queue, row.tenant, stateBadge(row.state), row.cluster, String(row.gpus),
      timeEl(row.submitted), duration(row.waited), duration(row.ran),
    ];
  }

  function textsOf(row) {
    return [row.name, row.queue, row.tenant, row.state, row.cluster, String(row.gpus),
      row.submitted, duration(row.waited), duration(row.ran)];
  }

  function draw() {
    frame = 0;
    if (disposed) return;
    const now = Date.now();
    let rows = [...records.values()].map((r) => rowOf(r, now));
    if (sorting.key) {
      const key = sorting.key;
      rows = rows.slice().sort((a, b) => {
        const x = a[key] ?? -1;
        const y = b[key] ?? -1;
        return (x < y ? -1 : x > y ? 1 : 0) * sorting.dir;
      });
    }
    headers.forEach((th, i) => {
      const key = COLUMNS[i].key;
      if (key === sorting.key) th.setAttribute('aria-sort', sorting.dir > 0 ? 'ascending' : 'descending');
      else th.removeAttribute('aria-sort');
    });
    const wanted = new Set(rows.map((row) => row.id));
    for (const [id, tr] of rowEls) {
      if (!wanted.has(id)) {
        tr.remove();
        rowEls.delete(id);
      }
    }
    let before = tbody.firstChild;
    for (const row of rows) {
      let tr = rowEls.get(row.id);
      if (!tr) {
        tr = h('tr', { dataset: { jobId: row.id } },
          COLUMNS.map((column) => h('td', { class: column.num ? 'num' : '' })));
        rowEls.set(row.id, tr);
      }
      // only the cells whose text changed are replaced: a focused link keeps its focus
      const texts = textsOf(row);
      cells(row).forEach((cell, i) => {
        const td = tr.children[i];
        if (td.dataset.text !== texts[i]) {
          clear(td).append(cell);
          td.dataset.text = texts[i];
        }
      });
      tr.dataset.state = row.state;
      if (tr !== before) tbody.insertBefore(tr, before);
      before = tr.nextSibling;
    }
    count.textContent = `${rows.length} job${rows.length === 1 ? '' : 's'} on this page` +
      (ctx.connected ? ', updated live' : '');
    prev.disabled = pageIndex === 0;
    nextButton.disabled = !next;
    pageLabel.textContent = `Page ${pageIndex + 1}`;
  }

  prev.addEventListener('click', () => {
    if (pageIndex === 0) return;
    pageIndex -= 1;
    reload(false);
  });
  nextButton.addEventListener('click', () => {
    if (!next) return;
    pageIndex += 1;
    tokens[pageIndex] = next;
    reload(false);
  });

  main.append(
    h('h1', {}, 'Jobs'),
    filterBar,
    error,
    h('table', { class: 'jobs', id: 'jobs-table' },
      h('caption', { class: 'visually-hidden' }, 'Jobs in the order chosen; column buttons sort this page'),
      h('thead', {}, h('tr', {}, headers)),
      tbody),
    count,
    h('div', { class: 'pager' }, prev, pageLabel, nextButton),
  );
  buildFilters([], []);
  Promise.all([
    api.get('/v1/queues').then((b) => b.items.map((q) => q.name)).catch(() => []),
    api.get('/v1/clusters').then((b) => b.items.map((c) => c.name)).catch(() => []),
  ]).then(([queues, clusters]) => {
    if (!disposed) buildFilters(queues, clusters);
  });
  reload();
  const ticker = setInterval(schedule, 1000); // waited and ran grow while a job is live

  return {
    onEvent(name, data) {
      if (name === 'resync') {
        reload(false);
        return;
      }
      if (name !== 'job') return;
      if (records.has(data.id)) {
        if (matchesServer(data)) records.set(data.id, data);
        else records.delete(data.id);
      } else if (filters.sort === 'newest' && pageIndex === 0 && matchesServer(data)) {
        const newest = records.values().next().value;
        if (!newest || Date.parse(data.created) >= Date.parse(newest.created)) {
          const entries = [[data.id, data], ...records];
          records.clear();
          for (const [id, record] of entries) records.set(id, record);
        }
      } else if (filters.sort === 'oldest' && !next && matchesServer(data) &&
        records.size < Number(filters.limit)) {
        records.set(data.id, data); // the last page: a new job comes last
      }
      schedule();
    },
    dispose() {
      disposed = true;
      clearInterval(ticker);
      clearTimeout(typing);
      if (frame) cancelAnimationFrame(frame);
    },
  };
}
