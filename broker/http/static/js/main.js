// The console's shell: sign-in, the pages by hash (#/jobs, #/jobs/<id>, #/queues,
// #/clusters), and the one event stream that feeds whichever page is open.
import * as api from './api.js';
import { clear, h } from './dom.js';
import * as clustersPage from './clusters.js';
import * as jobPage from './job.js';
import * as jobsPage from './jobs.js';
import * as queuesPage from './queues.js';

const main = document.getElementById('main');
const nav = document.getElementById('nav');
const live = document.getElementById('live');
const who = document.getElementById('who');
const signout = document.getElementById('signout');
const template = document.querySelector('meta[name="gpufed-trace-url-template"]');

const ctx = {
  who: null,
  traceTemplate: template ? template.content : '',
  connected: false,
  // Cancel is offered for one's own jobs: a tenant's submitter or tenant-admin, or the admin
  canCancel(record) {
    const me = this.who;
    if (!me) return false;
    if (me.role === 'admin') return true;
    return ['submitter', 'tenant-admin'].includes(me.role) && me.tenant === record.tenant;
  },
};

let page = null;
let stopStream = null;

function show(state) {
  ctx.connected = state === 'live';
  live.textContent = state === 'live' ? 'Live' : 'Reconnecting…';
  live.className = `live ${state === 'live' ? 'on' : 'off'}`;
}

let hellos = 0;

function dispatch(name, data) {
  if (name === 'hello') {
    // a reconnect: what changed meanwhile was not sent, so the page reads its list again
    hellos += 1;
    if (hellos === 1) return;
    name = 'resync';
  }
  if (page && page.onEvent) page.onEvent(name, data);
}

function route() {
  if (!ctx.who) return;
  const hash = location.hash.startsWith('#/') ? location.hash : '#/jobs';
  const parts = hash.slice(2).split('/').map(decodeURIComponent);
  if (page && page.dispose) page.dispose();
  clear(main);
  let name = parts[0] || 'jobs';
  if (name === 'jobs' && parts[1]) {
    page = jobPage.render(main, ctx, parts[1]);
  } else if (name === 'queues') {
    page = queuesPage.render(main, ctx);
  } else if (name === 'clusters') {
    page = clustersPage.render(main, ctx);
  } else {
    name = 'jobs';
    page = jobsPage.render(main, ctx);
  }
  for (const link of nav.querySelectorAll('a')) {
    if (link.dataset.page === name) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
  const heading = main.querySelector('h1');
  if (heading) {
    heading.tabIndex = -1;
    heading.focus({ preventScroll: true });
    document.title = `${heading.textContent} · gpufed`;
  }
}

function signIn(message) {
  if (stopStream) stopStream();
  stopStream = null;
  if (page && page.dispose) page.dispose();
  page = null;
  ctx.who = null;
  api.forgetToken();
  nav.hidden = true;
  signout.hidden = true;
  who.textContent = '';
  live.textContent = '';
  clear(main);
  const input = h('input', {
    id: 'token', name: 'token', type: 'password', autocomplete: 'off', required: true,
    'aria-describedby': 'token-help',
  });
  const error = h('p', { class: 'error', role: 'alert' }, message || '');
  const form = h('form', { class: 'signin', 'aria-labelledby': 'signin-title' },
    h('h1', { id: 'signin-title' }, 'Sign in to gpufed'),
    h('label', { for: 'token' }, 'Access token'),
    input,
    h('p', { id: 'token-help', class: 'note' },
      'The bearer token from the broker\'s tokens file. It is kept in this tab only ' +
      '(session storage) and sent in the Authorization header.'),
    h('button', { type: 'submit', class: 'primary' }, 'Sign in'),
    error);
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    api.keepToken(input.value.trim());
    try {
      await start();
    } catch (failure) {
      api.forgetToken();
      error.textContent = failure.status === 401
        ? 'That token is not known to the broker (or has expired).'
        : `Sign-in failed: ${failure.message}`;
      input.focus();
    }
  });
  main.append(form);
  document.title = 'Sign in · gpufed';
  input.focus();
}

async function start() {
  ctx.who = await api.get('/v1/whoami', { quiet: true });
  nav.hidden = false;
  signout.hidden = false;
  who.textContent = ctx.who.tenant ? `${ctx.who.role} of ${ctx.who.tenant}` : ctx.who.role;
  show('down');
  hellos = 0;
  stopStream = api.follow(dispatch, show);
  route();
}

api.whenUnauthorized((reason) => signIn(reason ? `Signed out: ${reason}.` : 'Please sign in.'));
signout.addEventListener('click', () => signIn('Signed out.'));
// the skip link moves the focus to the page, not the hash (the hash names the page)
document.getElementById('skip').addEventListener('click', (event) => {
  event.preventDefault();
  main.focus();
});
window.addEventListener('hashchange', route);

if (api.token()) {
  start().catch(() => signIn('Please sign in again.'));
} else {
  signIn();
}
