// Clusters: health and GPUs total and free by model, and the GPU map of the one chosen.
import * as api from './api.js';
import { clear, h } from './dom.js';
import { GpuMapView, legend, nodeInfo } from './gpumap.js';

let chosen = '';

function clusterRow(cluster) {
  const models = cluster.models.map((m) => `${m.model}: ${m.free} free of ${m.total}`).join('; ');
  return h('tr', { dataset: { cluster: cluster.name } },
    h('th', { scope: 'row' }, cluster.name),
    h('td', {}, h('span', { class: `health-${cluster.health}` }, cluster.health),
      cluster.reason ? h('div', { class: 'note' }, cluster.reason) : null),
    h('td', {}, cluster.connected ? 'yes' : 'no'),
    h('td', { class: 'num' }, cluster.last_seen_seconds === null ? '' : `${cluster.last_seen_seconds.toFixed(1)} s ago`),
    h('td', { class: 'num' }, String(cluster.running_jobs)),
    h('td', { class: 'num' }, String(cluster.models.reduce((n, m) => n + m.total, 0))),
    h('td', { class: 'num' }, String(cluster.models.reduce((n, m) => n + m.free, 0))),
    h('td', {}, models));
}

export function render(main) {
  let disposed = false;
  let timer = 0;
  const error = h('p', { class: 'error', role: 'alert' });
  const tbody = h('tbody', { id: 'clusters-body' });
  const picker = h('select', { id: 'map-cluster', name: 'cluster' });
  const info = h('p', { id: 'map-node', 'aria-live': 'polite' });
  const mapNote = h('p', { class: 'note', id: 'map-note' });
  const view = new GpuMapView((row) => nodeInfo(info, row));
  picker.addEventListener('change', () => {
    chosen = picker.value;
    view.selected = -1;
    nodeInfo(info, null);
    loadMap();
  });
  main.append(
    h('h1', {}, 'Clusters'), error,
    h('table', { id: 'clusters' },
      h('caption', { class: 'visually-hidden' }, 'Member clusters'),
      h('thead', {}, h('tr', {}, ['Cluster', 'Health', 'Connected', 'Last seen', 'Running jobs',
        'GPUs', 'Free GPUs', 'By model'].map((t) => h('th', { scope: 'col' }, t)))),
      tbody),
    h('h2', { id: 'map-title' }, 'GPU map'),
    h('div', { class: 'filters' }, h('label', { for: 'map-cluster' }, 'Cluster', picker)),
    legend(), mapNote, view.element, info);

  async function loadMap() {
    if (!chosen) return;
    try {
      const map = await api.get(`/v1/clusters/${encodeURIComponent(chosen)}/gpus`);
      if (disposed || map.cluster !== chosen) return;
      mapNote.textContent = `${map.health}. ${map.message}`;
      view.show(map);
      if (view.selected >= 0) nodeInfo(info, view.rows[view.selected]);
    } catch (failure) {
      if (!disposed) mapNote.textContent = `Could not read the GPU map: ${failure.message}`;
    }
  }

  async function load() {
    try {
      const body = await api.get('/v1/clusters');
      if (disposed) return;
      error.textContent = '';
      clear(tbody).append(...body.items.map(clusterRow));
      const names = body.items.map((c) => c.name);
      if (!names.includes(chosen)) chosen = names[0] || '';
      const shown = [...picker.options].map((o) => o.value);
      if (shown.join() !== names.join()) {
        clear(picker).append(...names.map((n) => h('option', { value: n }, n)));
      }
      picker.value = chosen;
      await loadMap();
    } catch (failure) {
      if (!disposed) error.textContent = `Could not read the clusters: ${failure.message}`;
    }
  }

  load();
  const ticker = setInterval(load, 5000);
  return {
    onEvent(name) {
      if ((name === 'job' || name === 'resync') && !timer) {
        timer = setTimeout(() => { timer = 0; loadMap(); }, 1000);
      }
    },
    dispose() {
      disposed = true;
      clearInterval(ticker);
      clearTimeout(timer);
      view.dispose();
    },
  };
}
