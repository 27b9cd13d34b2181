// A grpc-js client of the planner's Chat stream: the worked example of docs/clients.md,
// and the Node side of tests/polyglot/test_node_client.py.
//
//   node client.js conformance|idle|oversized
//
// Settings come from the environment: PLANNER_ADDRESS (host:port, plaintext), TOKEN (a
// bearer token), PROTO_PATH (the API's proto roots, joined with the path delimiter),
// and for "idle" HOLD_S (seconds the stream stays idle) and KEEPALIVE_MS (the client's
// keepalive interval; 0 for none), for "oversized" SIZE_BYTES. Every step prints one JSON line on stdout; the last
// line is {"done": true, ...}. A failed expectation exits 1 with the reason on stderr.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const env = process.env;
const roots = (env.PROTO_PATH || '').split(path.delimiter).filter(Boolean);
const definition = protoLoader.loadSync('ballet/planner/v1/planner_service.proto', {
  includeDirs: roots,
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});
const api = grpc.loadPackageDefinition(definition).ballet.planner.v1;

// google.rpc.Status and ErrorInfo for the grpc-status-details-bin trailer and for the
// Any details of an error reply.
const rpcTypes = new protobuf.Root();
rpcTypes.resolvePath = (_origin, target) => {
  for (const root of roots) {
    const candidate = path.join(root, target);
    try {
      require('fs').accessSync(candidate);
      return candidate;
    } catch (_) {
      // not under this root
    }
  }
  return target;
};
rpcTypes.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto']);
const Status = rpcTypes.lookupType('google.rpc.Status');
const ErrorInfo = rpcTypes.lookupType('google.rpc.ErrorInfo');
const ERROR_INFO_URL = 'type.googleapis.com/google.rpc.ErrorInfo';

const started = Date.now();

function say(step, fields = {}) {
  const atMs = Date.now() - started;
  process.stdout.write(JSON.stringify({ step, ...fields, at_ms: atMs }) + '\n');
}

function fail(message) {
  process.stderr.write(`FAILED: ${message}\n`);
  process.exit(1);
}

function expect(condition, message) {
  if (!condition) fail(message);
}

// The ErrorInfo among the Any details of a google.rpc.Status (AIP-193).
function errorInfo(details) {
  const info = (details || []).find((any) => any.type_url === ERROR_INFO_URL);
  if (!info) return null;
  return ErrorInfo.decode(info.value);
}

// How a stream ended with an error: code, message, and the ErrorInfo of the
// grpc-status-details-bin trailer.
function streamError(error) {
  const raw = error.metadata ? error.metadata.get('grpc-status-details-bin') : [];
  let info = null;
  if (raw.length) {
    const status = Status.decode(raw[0]);
    info = errorInfo(status.details.map((d) => ({ type_url: d.type_url, value: d.value })));
  }
  return { code: grpc.status[error.code], message: error.details, reason: info && info.reason };
}

function client(options = {}) {
  return new api.PlannerService(env.PLANNER_ADDRESS, grpc.credentials.createInsecure(), options);
}

function metadata(token = env.TOKEN) {
  const md = new grpc.Metadata();
  md.set('authorization', `Bearer ${token}`);
  return md;
}

// One Chat stream: next(kind) waits for the next response (of that event kind; other
// kinds on the way are kept in `seen`), ended() for the end of the stream.
class Stream {
  constructor(stub, token = env.TOKEN) {
    this.call = stub.Chat(metadata(token));
    this.queue = [];
    this.waiters = [];
    this.seen = [];
    this.end = new Promise((resolve) => {
      this.call.on('status', (status) => resolve({ code: grpc.status[status.code] }));
      this.call.on('error', (error) => resolve(streamError(error)));
    });
    this.call.on('data', (response) => {
      this.queue.push(response);
      this.wake();
    });
    this.end.then((how) => {
      this.closed = how;
      this.wake();
    });
  }

  // Until the next response or the end of the stream, at most `ms`; the timer is
  // cleared so that no wait keeps Node running after the last step.
  wait(ms) {
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      this.waiters.push(() => {
        clearTimeout(timer);
        resolve();
      });
    });
  }

  wake() {
    for (const waiter of this.waiters.splice(0)) waiter();
  }

  write(request) {
    this.call.write(request);
  }

  async next(kind, limitMs = 15000) {
    const deadline = Date.now() + limitMs;
    for (;;) {
      while (this.queue.length) {
        const response = this.queue.shift();
        this.seen.push(response.event);
        if (response.event === 'error' && kind !== 'error') {
          const info = errorInfo(response.error.details);
          fail(`error reply ${info && info.reason}: ${response.error.message}`);
        }
        if (!kind || response.event === kind) return response;
      }
      if (this.closed) fail(`the stream ended ${JSON.stringify(this.closed)} before ${kind}`);
      const left = deadline - Date.now();
      if (left <= 0) fail(`no ${kind} within ${limitMs} ms`);
      await this.wait(left);
    }
  }

  // The next response, or how the stream ended if it ends first.
  async replyOrEnd(limitMs = 15000) {
    const deadline = Date.now() + limitMs;
    while (!this.queue.length && !this.closed && Date.now() < deadline) {
      await this.wait(deadline - Date.now());
    }
    if (this.queue.length) return this.queue.shift();
    expect(this.closed, `no response and no end within ${limitMs} ms`);
    return this.closed;
  }

  async ended(limitMs = 15000) {
    const deadline = Date.now() + limitMs;
    while (!this.closed && Date.now() < deadline) {
      await this.wait(deadline - Date.now());
    }
    const how = this.closed;
    expect(how, `the stream did not end within ${limitMs} ms`);
    return how;
  }
}

async function turn(stream, text, requestId) {
  stream.write({ request_id: requestId, send_message: { text } });
  const accepted = await stream.next('message_accepted');
  let ended;
  do {
    ended = await stream.next('turn_ended', 30000);
  } while (ended.turn_id !== accepted.turn_id);
  return { accepted, ended };
}

async function conformance() {
  const stub = client();
  // Open a new session; the reply echoes the request_id.
  let stream = new Stream(stub);
  stream.write({ request_id: 'open-1', open: { project_id: 'demo', title: 'node' } });
  const opened = await stream.next('session_opened');
  expect(opened.request_id === 'open-1', 'session_opened echoes the request_id');
  const sessionId = opened.session_id;
  say('opened', { session_id: sessionId });

  // A turn with a tool call, then one with text.
  const tools = await turn(stream, 'show me the items', 'send-1');
  expect(tools.ended.turn_ended.reason === 'TURN_END_REASON_COMPLETED', 'the turn completes');
  const afterFirst = Number(tools.ended.sequence);
  const text = await turn(stream, 'hello', 'send-2');
  expect(text.ended.turn_ended.reason === 'TURN_END_REASON_COMPLETED', 'the turn completes');
  say('turns', { kinds: [...new Set(stream.seen)], accepted_request_id: tools.accepted.request_id });

  // An error reply: a google.rpc.Status whose ErrorInfo names the reason; the stream
  // lives on.
  stream.write({ request_id: 'too-long', send_message: { text: 'a'.repeat(32 * 1024 + 1) } });
  const reply = await stream.next('error');
  const info = errorInfo(reply.error.details);
  expect(reply.request_id === 'too-long', 'the error reply echoes the request_id');
  say('error_reply', {
    code: reply.error.code,
    reason: info && info.reason,
    domain: info && info.domain,
  });

  // Cancel a running turn.
  stream.write({ request_id: 'slow', send_message: { text: 'a slow one please' } });
  const started = await stream.next('turn_started');
  // While it runs, a message sent with on_busy ENQUEUE waits behind it as a queued turn,
  // and runs once the cancelled turn has ended (docs/clients.md, "Messages while a turn
  // runs").
  stream.write({
    request_id: 'queued',
    send_message: { text: 'hello again', on_busy: 'ON_BUSY_ENQUEUE' },
  });
  const queued = await stream.next('message_queued');
  stream.write({ request_id: 'cancel', cancel_turn: { turn_id: started.turn_id } });
  let cancelled;
  do {
    cancelled = await stream.next('turn_ended');
  } while (cancelled.turn_id !== started.turn_id);
  say('cancelled', { reason: cancelled.turn_ended.reason });
  let answered;
  do {
    answered = await stream.next('turn_ended', 30000);
  } while (answered.turn_id !== queued.turn_id);
  say('queued', {
    request_id: queued.request_id,
    behind_the_running_turn: queued.message_queued.behind_turn_id === started.turn_id,
    reason: answered.turn_ended.reason,
  });

  // Disconnect, then resume by sequence: what came after the first turn is replayed.
  stream.call.cancel();
  const gone = await stream.ended();
  say('disconnected', gone);
  stream = new Stream(stub);
  stream.write({
    request_id: 'resume',
    open: { session_id: sessionId, after_sequence: String(afterFirst) },
  });
  await stream.next('session_opened');
  const replayed = [];
  for (;;) {
    const event = await stream.next();
    replayed.push(Number(event.sequence));
    if (event.event === 'turn_ended' && event.turn_id === started.turn_id) break;
  }
  say('resumed', { after_sequence: afterFirst, first: replayed[0], count: replayed.length });

  // Half-close: the planner ends the stream OK.
  stream.call.end();
  say('half_closed', await stream.ended());

  // Opening a session that does not exist: an error reply (a google.rpc.Status in the
  // response) or the end of the stream (its ErrorInfo in grpc-status-details-bin).
  stream = new Stream(stub);
  stream.write({ request_id: 'missing', open: { session_id: 'no-such-session' } });
  const first = await stream.replyOrEnd();
  if (first.event === 'error') {
    const missing = errorInfo(first.error.details);
    say('open_refused', {
      as: 'error reply',
      code: grpc.status[first.error.code],
      reason: missing && missing.reason,
    });
    stream.call.end();
    await stream.ended();
  } else {
    say('open_refused', { as: 'stream end', ...first });
  }
  // An error that ends the stream (a token that is none): the ErrorInfo comes in
  // grpc-status-details-bin.
  stream = new Stream(stub, 'not-a-token');
  stream.write({ request_id: 'open-2', open: { project_id: 'demo' } });
  say('stream_error', await stream.ended());
  stub.close();
  say('done', { done: true });
}

async function idle() {
  const keepaliveMs = Number(env.KEEPALIVE_MS || 0);
  const options = keepaliveMs
    ? {
        'grpc.keepalive_time_ms': keepaliveMs,
        'grpc.keepalive_timeout_ms': 5000,
        'grpc.keepalive_permit_without_calls': 1,
      }
    : {};
  const stub = client(options);
  const stream = new Stream(stub);
  stream.write({ request_id: 'open', open: { project_id: 'demo', title: 'idle' } });
  await stream.next('session_opened');
  say('opened', { keepalive_ms: keepaliveMs });
  const holdMs = Number(env.HOLD_S) * 1000;
  const until = Date.now() + holdMs;
  let heartbeats = 0;
  // Nothing is sent for HOLD_S; whatever arrives must be a heartbeat, and the stream
  // must not end.
  while (Date.now() < until) {
    await stream.wait(Math.max(0, until - Date.now()));
    if (stream.closed) fail(`the idle stream ended ${JSON.stringify(stream.closed)}`);
    while (stream.queue.length) {
      const response = stream.queue.shift();
      expect(response.event === 'heartbeat', `an idle stream got ${response.event}`);
      heartbeats += 1;
    }
  }
  say('held', { seconds: holdMs / 1000, heartbeats });
  // Still a working stream: a turn, then a clean end.
  const done = await turn(stream, 'hello', 'after-idle');
  expect(done.ended.turn_ended.reason === 'TURN_END_REASON_COMPLETED', 'the turn completes');
  stream.call.end();
  say('half_closed', await stream.ended());
  stub.close();
  say('done', { done: true, heartbeats });
}

// A request far over the planner's bound but under the transport's limit (SIZE_BYTES of
// text): an error reply, and the stream goes on.
async function oversized() {
  const stub = client();
  const stream = new Stream(stub);
  stream.write({ request_id: 'open', open: { project_id: 'demo', title: 'big' } });
  await stream.next('session_opened');
  stream.write({ request_id: 'big', send_message: { text: 'x'.repeat(Number(env.SIZE_BYTES)) } });
  const reply = await stream.replyOrEnd(30000);
  expect(reply.event === 'error', `no error reply but ${JSON.stringify(reply)}`);
  const info = errorInfo(reply.error.details);
  say('refused', { as: 'error reply', reason: info && info.reason });
  const done = await turn(stream, 'hello', 'after-big');
  expect(done.ended.turn_ended.reason === 'TURN_END_REASON_COMPLETED', 'the turn completes');
  stream.call.end();
  say('half_closed', await stream.ended());
  stub.close();
  say('done', { done: true });
}

const scenarios = { conformance, idle, oversized };
const scenario = scenarios[process.argv[2]];
if (!scenario) fail(`usage: node client.js ${Object.keys(scenarios).join('|')}`);
scenario().catch((error) => fail(error.stack || String(error)));
