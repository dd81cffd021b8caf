// The GPU map on a canvas: every node a strip of GPU cells (whole, shared, free, other),
// strips wrapped into columns, so 1,000 nodes of 8 GPUs are 8,000 rectangles drawn in a few
// milliseconds. Hover or the arrow keys pick a node; what it holds is told in words beside.
import { clear, h } from './dom.js';

const NAMES = { W: 'whole', S: 'shared', F: 'free', O: 'other' };

export function rowsOf(map) {
  const rows = map.nodes.map((n) => ({ ...n, named: true }));
  for (const group of map.others) {
    for (let i = 0; i < group.count; i += 1) {
      rows.push({ name: null, model: group.model, cells: group.cells, jobs: [], named: false });
    }
  }
  return rows;
}

function colours() {
  const css = getComputedStyle(document.documentElement);
  const get = (name) => css.getPropertyValue(name).trim();
  return { W: get('--whole'), S: get('--shared'), F: get('--free'), O: get('--other'), ink: get('--ink') };
}

export function describeCells(cells) {
  const runs = [];
  for (let i = 0; i < cells.length; i += 1) {
    const last = runs[runs.length - 1];
    if (last && last.kind === cells[i]) last.to = i;
    else runs.push({ kind: cells[i], from: i, to: i });
  }
  return runs.map((r) => `${r.from === r.to ? `GPU ${r.from}` : `GPUs ${r.from}–${r.to}`} ${NAMES[r.kind]}`).join(', ');
}

export function counts(rows) {
  const out = { W: 0, S: 0, F: 0, O: 0 };
  for (const row of rows) for (const c of row.cells) out[c] = (out[c] || 0) + 1;
  return out;
}

export class GpuMapView {
  constructor(onPick) {
    this.onPick = onPick;
    this.rows = [];
    this.selected = -1;
    this.canvas = h('canvas', { class: 'gpumap', id: 'gpumap', tabindex: 0, role: 'img' });
    this.tip = h('div', { class: 'tip', hidden: true });
    this.element = h('div', { class: 'gpumap-wrap' }, this.canvas, this.tip);
    this.canvas.addEventListener('mousemove', (e) => this.hover(e));
    this.canvas.addEventListener('mouseleave', () => { this.tip.hidden = true; });
    this.canvas.addEventListener('click', (e) => this.pick(this.indexAt(e)));
    this.canvas.addEventListener('keydown', (e) => this.key(e));
    this.resize = () => this.draw();
    window.addEventListener('resize', this.resize);
  }

  dispose() {
    window.removeEventListener('resize', this.resize);
  }

  show(map) {
    this.map = map;
    this.rows = rowsOf(map);
    if (this.selected >= this.rows.length) this.selected = -1;
    const c = counts(this.rows);
    this.canvas.setAttribute('aria-label',
      `GPU map of ${map.cluster}: ${this.rows.length} nodes; GPUs ${c.W} whole, ${c.S} shared, ` +
      `${c.F} free, ${c.O} other. Arrow keys move between nodes.`);
    this.draw();
  }

  layout() {
    const width = Math.max(200, this.canvas.clientWidth || 800);
    const n = this.rows.length;
    const gpus = Math.max(1, ...this.rows.map((r) => r.cells.length));
    const cell = n > 400 ? 5 : n > 100 ? 7 : n > 24 ? 10 : 16;
    const gap = 1;
    const stripGap = Math.max(4, cell);
    const strip = gpus * (cell + gap) - gap + stripGap;
    const columns = Math.max(1, Math.floor((width + stripGap) / strip));
    const lines = Math.max(1, Math.ceil(n / columns));
    const lineHeight = cell + Math.max(2, Math.floor(cell / 2));
    return { width, cell, gap, strip, columns, lines, lineHeight, height: lines * lineHeight + 4 };
  }

  draw() {
    const canvas = this.canvas;
    const box = this.layout(); // reads the width: a layout, not the drawing's cost
    const started = performance.now();
    this.box = box;
    const ratio = window.devicePixelRatio || 1;
    canvas.style.height = `${box.height}px`;
    canvas.width = Math.round(box.width * ratio);
    canvas.height = Math.round(box.height * ratio);
    const g = canvas.getContext('2d');
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, box.width, box.height);
    if (!this.paint) this.paint = colours();
    const paint = this.paint;
    // one path per kind of cell, filled once: four fills however many nodes
    const paths = { W: new Path2D(), S: new Path2D(), F: new Path2D(), O: new Path2D() };
    const step = box.cell + box.gap;
    const rows = this.rows;
    for (let index = 0; index < rows.length; index += 1) {
      const cells = rows[index].cells;
      const x0 = (index % box.columns) * box.strip;
      const y0 = Math.floor(index / box.columns) * box.lineHeight + 2;
      for (let i = 0; i < cells.length; i += 1) {
        const path = paths[cells[i]];
        if (path) path.rect(x0 + i * step, y0, box.cell, box.cell);
      }
    }
    for (const kind of ['W', 'S', 'F', 'O']) {
      g.fillStyle = paint[kind];
      g.fill(paths[kind]);
    }
    if (this.selected >= 0) {
      const row = this.rows[this.selected];
      const x0 = (this.selected % box.columns) * box.strip;
      const y0 = Math.floor(this.selected / box.columns) * box.lineHeight + 2;
      g.strokeStyle = paint.ink;
      g.lineWidth = 2;
      g.strokeRect(x0 - 1.5, y0 - 1.5, row.cells.length * (box.cell + box.gap) + 2, box.cell + 3);
    }
    canvas.dataset.rows = String(this.rows.length);
    canvas.dataset.drawMs = (performance.now() - started).toFixed(1);
  }

  indexAt(event) {
    if (!this.box) return -1;
    const rect = this.canvas.getBoundingClientRect();
    const x = event.clientX - rect.left;
    const y = event.clientY - rect.top - 2;
    const column = Math.floor(x / this.box.strip);
    const line = Math.floor(y / this.box.lineHeight);
    if (column >= this.box.columns || line < 0) return -1;
    const index = line * this.box.columns + column;
    return index < this.rows.length ? index : -1;
  }

  label(row) {
    const name = row.named ? row.name : 'a node without gpufed pods (name not reported)';
    return `${name} · ${row.model}\n${describeCells(row.cells)}` +
      (row.jobs.length ? `\njobs: ${row.jobs.join(', ')}` : '');
  }

  hover(event) {
    const index = this.indexAt(event);
    if (index < 0) {
      this.tip.hidden = true;
      return;
    }
    const rect = this.canvas.getBoundingClientRect();
    this.tip.textContent = this.label(this.rows[index]);
    this.tip.style.left = `${event.clientX - rect.left + 12}px`;
    this.tip.style.top = `${event.clientY - rect.top + 12}px`;
    this.tip.hidden = false;
  }

  pick(index) {
    if (index < 0) return;
    this.selected = index;
    this.draw();
    this.onPick(this.rows[index], index);
  }

  key(event) {
    if (!this.rows.length || !this.box) return;
    const moves = { ArrowRight: 1, ArrowLeft: -1, ArrowDown: this.box.columns, ArrowUp: -this.box.columns,
      Home: -Infinity, End: Infinity };
    if (!(event.key in moves)) return;
    event.preventDefault();
    const step = moves[event.key];
    let index = this.selected < 0 ? 0 : this.selected + (Number.isFinite(step) ? step : 0);
    if (step === -Infinity) index = 0;
    if (step === Infinity) index = this.rows.length - 1;
    this.pick(Math.min(this.rows.length - 1, Math.max(0, index)));
  }
}

export function legend() {
  return h('div', { class: 'legend' },
    Object.entries({ whole: 'whole GPU (a gpufed pod)', shared: 'shared (milli-GPU pods)',
      free: 'free', other: 'other (not schedulable or held outside gpufed)' })
      .map(([k, v]) => h('span', {}, h('span', { class: `swatch sw-${k}`, 'aria-hidden': 'true' }), v)));
}

export function nodeInfo(target, row) {
  clear(target);
  if (!row) return;
  target.append(h('span', {},
    h('strong', {}, row.named ? row.name : 'A node without gpufed pods'), ` (${row.model}): `,
    describeCells(row.cells),
    row.named ? null : ' — the agent reports how many GPUs such nodes have free, not their names.',
    row.jobs.length ? h('span', {}, '. Jobs: ',
      row.jobs.map((id, i) => [i ? ', ' : '', h('a', { href: `#/jobs/${encodeURIComponent(id)}` }, id)])) : null));
}
