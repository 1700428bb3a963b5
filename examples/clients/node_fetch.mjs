// Node: built-in fetch (ignores HTTP(S)_PROXY before Node 24), undici ProxyAgent and
// EnvHttpProxyAgent. Needs `npm install undici` (v7 for Node 20) next to this file or
// in NODE_PATH-reachable node_modules.
import { ProxyAgent, EnvHttpProxyAgent, fetch as undiciFetch } from 'undici';

const PROXY = process.env.PROXY ?? 'http://127.0.0.1:8080';
const TARGET = process.env.TARGET ?? 'http://127.0.0.1:9000/hello';
const HOST = PROXY.replace(/^http:\/\//, '');
const headers = { 'X-Endpoint-Id': 'demo' };
const which = process.argv[2] ?? 'all';

async function show(label, res) {
  console.log(`${label}: ${res.status} ${res.headers.get('x-sluice-reason') ?? ''}`.trim());
}

if (which === 'all' || which === 'builtin') {
  // HTTP_PROXY is set by run.sh: Node 20's fetch sends straight to TARGET anyway
  // (unless NODE_USE_ENV_PROXY=1 on Node >= 24).
  await show('node built-in fetch + HTTP_PROXY env', await fetch(TARGET, { headers }));
}
if (which === 'all' || which === 'proxyagent') {
  await show('node undici ProxyAgent', await undiciFetch(TARGET, { headers, dispatcher: new ProxyAgent(PROXY) }));
  await show('node undici ProxyAgent demo:x@', await undiciFetch(TARGET, { dispatcher: new ProxyAgent(`http://demo:x@${HOST}`) }));
  await show('node undici ProxyAgent nobody@ (no password)', await undiciFetch(TARGET, { dispatcher: new ProxyAgent(`http://nobody@${HOST}`) }));
}
if (which === 'all' || which === 'envagent') {
  // Reads HTTP_PROXY / HTTPS_PROXY / NO_PROXY.
  await show('node undici EnvHttpProxyAgent', await undiciFetch(TARGET, { headers, dispatcher: new EnvHttpProxyAgent() }));
}
