// A small YAML writer for showing a job's spec (block style, keys in their order).

const PLAIN = /^[A-Za-z0-9_./][A-Za-z0-9_./ :-]*$/;
const RESERVED = new Set(['true', 'false', 'null', 'yes', 'no', 'on', 'off', '~', '']);

function scalar(value) {
  if (value === null || value === undefined) return 'null';
  if (typeof value === 'number' || typeof value === 'boolean') return String(value);
  const text = String(value);
  const risky = !PLAIN.test(text) || RESERVED.has(text.toLowerCase()) ||
    /^[0-9.+-]/.test(text) || text.includes(': ') || text.endsWith(':') || text.endsWith(' ');
  return risky ? JSON.stringify(text) : text;
}

function isEmpty(value) {
  return (Array.isArray(value) && value.length === 0) ||
    (value && typeof value === 'object' && !Array.isArray(value) && Object.keys(value).length === 0);
}

function lines(value, indent) {
  const pad = '  '.repeat(indent);
  const out = [];
  if (Array.isArray(value)) {
    for (const item of value) {
      if (item && typeof item === 'object' && !isEmpty(item)) {
        const inner = lines(item, indent + 1);
        out.push(`${pad}- ${inner[0].trimStart()}`, ...inner.slice(1));
      } else {
        out.push(`${pad}- ${isEmpty(item) ? JSON.stringify(item) : scalar(item)}`);
      }
    }
    return out;
  }
  for (const [key, item] of Object.entries(value)) {
    const name = scalar(key);
    if (item && typeof item === 'object' && !isEmpty(item)) {
      out.push(`${pad}${name}:`, ...lines(item, indent + 1));
    } else {
      out.push(`${pad}${name}: ${isEmpty(item) ? JSON.stringify(item) : scalar(item)}`);
    }
  }
  return out;
}

export function toYaml(value) {
  if (value === null || typeof value !== 'object') return `${scalar(value)}\n`;
  return `${lines(value, 0).join('\n')}\n`;
}
