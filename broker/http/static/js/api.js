// The broker's JSON API with the signed-in token, and its event stream.
//
// The token lives in sessionStorage (this tab only, gone when it closes) and goes in the
// Authorization header, never in a URL: the stream too is read with fetch(), not
// EventSource (which cannot send a header).

const KEY = 'gpufed.token';

export class ApiError extends Error {
  constructor(status, problem) {
    super(problem?.detail || problem?.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

export function token() {
  return sessionStorage.getItem(KEY);
}

export function keepToken(value) {
  sessionStorage.setItem(KEY, value);
}

export function forgetToken() {
  sessionStorage.removeItem(KEY);
}

let onUnauthorized = () => {};

export function whenUnauthorized(callback) {
  onUnauthorized = callback;
}

function headers(extra = {}) {
  const out = { Accept: 'application/json', ...extra };
  const value = token();
  if (value) out.Authorization = `Bearer ${value}`;
  return out;
}

export async function call(method, path, { query, signal, quiet } = {}) {
  let url = path;
  if (query) {
    const params = new URLSearchParams();
    for (const [key, value] of Object.entries(query)) {
      if (value !== undefined && value !== null && value !== '') params.set(key, value);
    }
    const text = params.toString();
    if (text) url += `?${text}`;
  }
  const response = await fetch(url, { method, headers: headers(), signal, cache: 'no-store' });
  let body = null;
  const type = response.headers.get('Content-Type') || '';
  if (type.includes('json')) body = await response.json();
  if (!response.ok) {
    if (response.status === 401 && !quiet) onUnauthorized(body?.detail);
    throw new ApiError(response.status, body);
  }
  return body;
}

export const get = (path, options) => call('GET', path, options);
export const remove = (path, options) => call('DELETE', path, options);

// Follow GET /v1/events: `onEvent(name, data)` for each event, `onState('live'|'down')`.
// Reconnects with a growing pause; every connect starts with a `hello` (read lists again).
export function follow(onEvent, onState) {
  let stopped = false;
  let controller = null;
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  async function once() {
    controller = new AbortController();
    const response = await fetch('/v1/events', {
      headers: headers({ Accept: 'text/event-stream' }),
      signal: controller.signal,
      cache: 'no-store',
    });
    if (response.status === 401) {
      stopped = true;
      onUnauthorized('the token was refused');
      return;
    }
    if (!response.ok || !response.body) throw new ApiError(response.status, null);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let at;
      while ((at = buffer.indexOf('\n\n')) >= 0) {
        const block = buffer.slice(0, at);
        buffer = buffer.slice(at + 2);
        let name = 'message';
        const data = [];
        for (const line of block.split('\n')) {
          if (line.startsWith(':')) continue; // a keepalive comment
          if (line.startsWith('event: ')) name = line.slice(7);
          else if (line.startsWith('data: ')) data.push(line.slice(6));
        }
        if (!data.length) continue;
        const payload = JSON.parse(data.join('\n'));
        if (name === 'hello') onState('live');
        if (name === 'bye') {
          stopped = true;
          onState('down');
          onUnauthorized(payload.reason);
          return;
        }
        onEvent(name, payload);
      }
    }
  }

  (async () => {
    let pause = 500;
    while (!stopped) {
      const started = Date.now();
      try {
        await once();
      } catch (error) {
        if (stopped) return;
      }
      if (stopped) return;
      onState('down');
      if (Date.now() - started > 10000) pause = 500; // it had been up: start again quickly
      await sleep(pause);
      pause = Math.min(pause * 2, 10000);
    }
  })();

  return () => {
    stopped = true;
    if (controller) controller.abort();
  };
}
