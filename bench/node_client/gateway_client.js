#!/usr/bin/env node
// A Node.js client of the dspark gateway over the repository's protos (@grpc/grpc-js and
// @grpc/proto-loader), the way a JavaScript author calls it: the protos are loaded at run time
// with `protos/` as the include root, 64-bit integers read as JavaScript numbers.
//
// It checks what such a client relies on and prints one JSON object on stdout:
//   {"ok": bool, "reason": str, "checks": {name: bool}, "seed": number, "tokens": [...]}
// checks: a sampled generation streams to a final message; the seed the gateway drew is a
// safe integer (exact in a double); replaying that seed gives the same tokens; the x-request-id
// metadata names the request in every message and in the trailers; a bad request is
// INVALID_ARGUMENT and its trailers carry a request id too.
// With --early-cancel it instead cancels a call in the tick that starts it and reports the
// verifier's open sessions (Verifier.Info) until they reach zero: what such a cancel costs.
//
// Usage: node gateway_client.js --target 127.0.0.1:50050 --protos /path/to/repo/protos
//        [--prompt TEXT] [--max-tokens N] [--timeout-s S] [--early-cancel --verifier HOST:PORT]
// Exit status 0 when every check passed, 1 otherwise, 2 for a usage error.
'use strict';

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const LOADER_OPTIONS = {keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true};

function parseArgs(argv) {
  const args = {prompt: 'Hello from Node.js', maxTokens: 8, timeoutS: 60, earlyCancel: false};
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const value = () => {
      if (i + 1 >= argv.length) throw new Error(`${flag} needs a value`);
      return argv[++i];
    };
    if (flag === '--target') args.target = value();
    else if (flag === '--verifier') args.verifier = value();
    else if (flag === '--protos') args.protos = value();
    else if (flag === '--prompt') args.prompt = value();
    else if (flag === '--max-tokens') args.maxTokens = Number(value());
    else if (flag === '--timeout-s') args.timeoutS = Number(value());
    else if (flag === '--early-cancel') args.earlyCancel = true;
    else throw new Error(`unknown argument ${flag}`);
  }
  if (!args.target || !args.protos) throw new Error('--target and --protos are required');
  if (args.earlyCancel && !args.verifier) throw new Error('--early-cancel needs --verifier');
  return args;
}

function load(protos, file) {
  const definition = protoLoader.loadSync(file, {...LOADER_OPTIONS, includeDirs: [protos]});
  return grpc.loadPackageDefinition(definition).dspark.v1;
}

// One Generate to its end: {messages, tokens, final, trailers (x-request-id values), error}.
function generate(client, request, requestId, timeoutS) {
  return new Promise((resolve) => {
    const metadata = new grpc.Metadata();
    if (requestId) metadata.set('x-request-id', requestId);
    const out = {messages: [], tokens: [], final: null, trailers: [], error: null};
    const call = client.Generate(request, metadata, {deadline: Date.now() + timeoutS * 1000});
    call.on('data', (m) => {
      out.messages.push(m);
      out.tokens.push(...m.token_ids);
      if (m.finished) out.final = m;
    });
    call.on('error', (e) => { out.error = e; });
    call.on('status', (s) => {
      out.trailers = s.metadata.get('x-request-id');
      resolve(out);
    });
  });
}

async function checks(args) {
  const v1 = load(args.protos, 'dspark_proto/v1/gateway.proto');
  const client = new v1.Gateway(args.target, grpc.credentials.createInsecure(),
                                {'grpc.keepalive_time_ms': 10000, 'grpc.keepalive_permit_without_calls': 1});
  const request = {prompt: args.prompt, max_tokens: args.maxTokens, temperature: 0.9, ignore_eos: true,
                   spec: 'SPEC_MODE_ALWAYS'};
  const id = `node-${process.pid}`;
  const drawn = await generate(client, request, id, args.timeoutS);
  if (drawn.error) return {ok: false, reason: `Generate failed: ${drawn.error.code} ${drawn.error.details}`};
  const seed = drawn.final ? drawn.final.seed : NaN;
  const replay = await generate(client, {...request, seed}, `${id}-replay`, args.timeoutS);
  const bad = await generate(client, {...request, max_tokens: 0}, '', args.timeoutS);
  client.close();
  const result = {
    streamed_to_a_final_message: drawn.final !== null && drawn.tokens.length === args.maxTokens,
    drawn_seed_is_a_safe_integer: Number.isSafeInteger(seed) && seed > 0,
    replayed_seed_gives_the_same_tokens: !replay.error && replay.final !== null && replay.final.seed === seed &&
        JSON.stringify(replay.tokens) === JSON.stringify(drawn.tokens),
    x_request_id_in_messages_and_trailers: drawn.messages.every((m) => m.request_id === id) &&
        drawn.trailers.length === 1 && drawn.trailers[0] === id,
    bad_request_is_invalid_argument_with_an_id: bad.error !== null &&
        bad.error.code === grpc.status.INVALID_ARGUMENT && bad.trailers.length === 1 && bad.trailers[0].length > 0,
  };
  const failed = Object.keys(result).filter((k) => !result[k]);
  return {ok: failed.length === 0, reason: failed.length ? `failed: ${failed.join(', ')}` : 'all checks passed',
          checks: result, seed, tokens: drawn.tokens, bad_request_error: bad.error && bad.error.details};
}

function openSessions(verifier) {
  return new Promise((resolve, reject) => {
    verifier.Info({}, {deadline: Date.now() + 5000}, (e, r) => (e ? reject(e) : resolve(r.open_sessions)));
  });
}

// Cancel a Generate in the tick that starts it, then watch the verifier's open sessions.
async function earlyCancel(args) {
  const gatewayPkg = load(args.protos, 'dspark_proto/v1/gateway.proto');
  const verifierPkg = load(args.protos, 'dspark_proto/v1/verifier.proto');
  const client = new gatewayPkg.Gateway(args.target, grpc.credentials.createInsecure());
  const verifier = new verifierPkg.Verifier(args.verifier, grpc.credentials.createInsecure());
  await new Promise((resolve, reject) => client.waitForReady(Date.now() + 10000, (e) => (e ? reject(e) : resolve())));
  const t0 = Date.now();
  const call = client.Generate({prompt: args.prompt, max_tokens: args.maxTokens, ignore_eos: true,
                                spec: 'SPEC_MODE_ALWAYS'}, {deadline: Date.now() + args.timeoutS * 1000});
  call.on('error', () => {});
  call.on('data', () => {});
  call.cancel();
  const seen = [];
  let open = 1;
  while (Date.now() - t0 < args.timeoutS * 1000) {
    open = await openSessions(verifier);
    seen.push([Date.now() - t0, open]);
    if (open === 0 && seen.length > 1) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  client.close();
  verifier.close();
  const held = seen.filter(([, n]) => n > 0);
  return {ok: open === 0, reason: `verifier sessions held for ${held.length ? held[held.length - 1][0] : 0} ms`,
          open_sessions: seen};
}

async function main() {
  let args;
  try {
    args = parseArgs(process.argv.slice(2));
  } catch (e) {
    process.stderr.write(`gateway_client.js: ${e.message}\n`);
    return 2;
  }
  const result = await (args.earlyCancel ? earlyCancel(args) : checks(args));
  process.stdout.write(JSON.stringify(result) + '\n');
  return result.ok ? 0 : 1;
}

main().then((code) => process.exit(code), (e) => {
  process.stdout.write(JSON.stringify({ok: false, reason: `${e.name}: ${e.message}`}) + '\n');
  process.exit(1);
});
