// Node: global-agent makes the http/https modules (not fetch) use GLOBAL_AGENT_HTTP_PROXY.
// Needs `npm install global-agent`.
process.env.GLOBAL_AGENT_HTTP_PROXY ??= process.env.PROXY ?? 'http://127.0.0.1:8080';
require('global-agent/bootstrap');
const http = require('http');

const TARGET = process.env.TARGET ?? 'http://127.0.0.1:9000/hello';
http.get(TARGET, { headers: { 'X-Endpoint-Id': 'demo' } }, (res) => {
  console.log(`node global-agent http.get: ${res.statusCode}`);
  res.resume();
}).on('error', (e) => { console.log(`node global-agent http.get: error ${e.message}`); process.exitCode = 1; });
