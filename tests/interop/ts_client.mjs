// The official TypeScript SDK (@modelcontextprotocol/sdk, its `Client` over
// `StdioClientTransport`) against airlock, through `airlock connect --socket PATH`. The SDK
// speaks the 2025 era only (its newest version is 2025-11-25), so it has one mode. Prints
// one JSON line per step; the last step kills the daemon.
//
// `node ts_client.mjs victim SECONDS OUT SESSION` is the client killed mid-call.
import { spawn } from "node:child_process";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import Ajv2020 from "ajv/dist/2020.js";
import {
  ENDS,
  Failed, check, lastCall, notPublished, runSteps, sleep, uniqueSeconds, waitSpawned, workerGone,
  workspaceFile,
} from "./checks.mjs";

const AUDIT = "airlock://audit/events";

async function connect() {
  const transport = new StdioClientTransport({
    command: process.env.AIRLOCK_BIN,
    args: ["connect", "--socket", process.env.AIRLOCK_SOCKET],
    stderr: "inherit",
  });
  const client = new Client({ name: "airlock-interop-ts", version: "0" });
  await client.connect(transport);
  return client;
}

const call = (c, name, args, opts) => c.callTool({ name, arguments: args }, undefined, opts);
const auditText = async (c) => (await c.readResource({ uri: AUDIT })).contents[0].text;

/** The audit kinds of the newest slow_write once it has ended. */
async function settled(c) {
  const deadline = Date.now() + 3000;
  for (;;) {
    const { kinds } = lastCall(await auditText(c), "slow_write");
    if (ENDS.includes(kinds[kinds.length - 1]) || Date.now() > deadline) {
      return kinds;
    }
    await sleep(50);
  }
}

async function scenario(report) {
  const tag = "ts-sdk";
  let c = await connect();
  const version = c.getServerVersion();
  check(version && version.name === "airlock", `serverInfo ${JSON.stringify(version)}`);
  report("initialize", `server ${version.name} ${version.version}`);

  const tools = Object.fromEntries((await c.listTools()).tools.map((t) => [t.name, t]));
  for (const need of ["session_create", "session_get", "write_text", "cat", "counter", "slow_write"]) {
    check(tools[need], `tools/list lacks ${need}`);
  }
  const ajv = new Ajv2020({ strict: false });
  for (const [name, t] of Object.entries(tools)) {
    for (const key of ["inputSchema", "outputSchema"]) {
      if (t[key]) check(ajv.validateSchema(t[key]), `${name}.${key}: ${ajv.errorsText(ajv.errors)}`);
    }
  }
  const v = ajv.compile(tools.write_text.inputSchema);
  check(v({ session: "s", text: "x", out: "o" }), "a good call fails the schema");
  check(!v({ session: "s", out: "o" }), "a call without text passes the schema");
  check(!v({ session: "s", text: 1, out: "o" }), "text=1 passes the schema");
  report("tools/list", `${Object.keys(tools).length} tools, schemas valid (Draft 2020-12, Ajv)`);

  const sid = `${tag}-s`;
  let r = await call(c, "session_create", { id: sid, state: { k: [1, "x"] } });
  check(!r.isError, `session_create: ${JSON.stringify(r)}`);
  const text = `hello from ${tag}`;
  r = await call(c, "write_text", { session: sid, text, out: `${tag}.txt` });
  check(!r.isError, `write_text: ${JSON.stringify(r)}`);
  check(workspaceFile(`${tag}.txt`) === text, "write_text did not publish its file");
  report("write call", `${tag}.txt published`);

  r = await call(c, "cat", { path: `${tag}.txt` });
  check(r.content.map((b) => b.text || "").join("").includes(text), `cat: ${JSON.stringify(r)}`);
  report("read call", "cat returns the published text");

  const s0 = (await call(c, "session_get", { session: sid })).structuredContent;
  check(JSON.stringify(s0.state) === '{"k":[1,"x"]}', `initial state ${JSON.stringify(s0)}`);
  for (let i = 0; i < 2; i++) {
    r = await call(c, "counter", { session: sid, by: 2 });
    check(!r.isError, `counter: ${JSON.stringify(r)}`);
  }
  const s1 = (await call(c, "session_get", { session: sid })).structuredContent;
  check(s1.state.counter === 4 && s1.state.k.length === 2, `state after two counters: ${JSON.stringify(s1)}`);
  check(s1.version === s0.version + 2, `versions ${s0.version} -> ${s1.version}`);
  report("state round trip", `version ${s0.version} -> ${s1.version}, counter 4`);

  const uris = (await c.listResources()).resources.map((x) => x.uri);
  check(uris.includes(AUDIT), `resources/list: ${uris}`);
  const evs = JSON.parse(await auditText(c));
  check(evs.some((e) => e.kind === "commit" && e.tool === "write_text"), "no commit of write_text in the audit");
  report("audit resource", `${evs.length} events, write_text committed`);

  // An in-flight cancel: AbortSignal, which the SDK turns into notifications/cancelled.
  let secs = uniqueSeconds(1);
  let out = `${tag}-cancelled.txt`;
  const abort = new AbortController();
  const pending = call(c, "slow_write", { session: sid, seconds: secs, out }, { signal: abort.signal });
  await waitSpawned(secs);
  abort.abort("interop cancel");
  let err = await pending.then(() => null, (e) => e);
  check(err, "slow_write completed although cancelled");
  let { pid } = lastCall(await auditText(c), "slow_write");
  await workerGone(secs, pid);
  let kinds = await settled(c);
  notPublished(kinds, out);
  const s2 = (await call(c, "session_get", { session: sid })).structuredContent;
  check(s2.version === s1.version, `a cancelled call moved the version: ${JSON.stringify(s2)}`);
  report("in-flight cancel", `${err.name}; worker killed, audit ${kinds}`);

  // A client-side timeout (the request option), also sent as notifications/cancelled.
  secs = uniqueSeconds(2);
  out = `${tag}-timeout.txt`;
  err = await call(c, "slow_write", { session: sid, seconds: secs, out }, { timeout: 1000 }).then(
    () => null,
    (e) => e,
  );
  check(err, "slow_write completed despite a 1 s timeout");
  ({ pid } = lastCall(await auditText(c), "slow_write"));
  await workerGone(secs, pid);
  kinds = await settled(c);
  notPublished(kinds, out);
  report("client timeout", `code ${err.code}; worker killed, audit ${kinds}`);

  // A protocol error: an unknown tool is -32602; the connection keeps serving.
  err = await call(c, "no_such_tool", {}).then((res) => res, (e) => e);
  check(err && err.code === -32602, `unknown tool: ${err && (err.message || JSON.stringify(err))}`);
  check((await c.listTools()).tools.length === Object.keys(tools).length, "no tools/list after the error");
  report("protocol error", "unknown tool -> -32602, connection still serves");
  await c.close();

  // A client killed mid-call: its calls are cancelled, nothing is published.
  secs = uniqueSeconds(3);
  out = `${tag}-killed.txt`;
  const victim = spawn(process.execPath, [new URL(import.meta.url).pathname, "victim", String(secs), out, sid], {
    stdio: ["ignore", "ignore", "inherit"],
  });
  await waitSpawned(secs, 60000); // a new Node process: slow on a loaded machine
  victim.kill("SIGKILL");
  c = await connect();
  ({ pid } = lastCall(await auditText(c), "slow_write"));
  await workerGone(secs, pid, 3000);
  kinds = await settled(c);
  notPublished(kinds, out);
  report("client killed", `worker killed, audit ${kinds}`);

  // The daemon killed mid-call: the client gets an error within 2 s.
  secs = uniqueSeconds(4);
  const doomed = call(c, "slow_write", { session: sid, seconds: secs, out: `${tag}-d.txt` }).then(
    () => ({ completed: true }),
    (e) => ({ at: Date.now(), error: String(e.message || e) }),
  );
  await waitSpawned(secs);
  const killedAt = Date.now();
  process.kill(Number(process.env.AIRLOCK_DAEMON_PID), "SIGKILL");
  const res = await Promise.race([doomed, sleep(10000).then(() => ({ hung: true }))]);
  check(res.at, `the call did not fail: ${JSON.stringify(res)}`);
  const dt = (res.at - killedAt) / 1000;
  check(dt < 2, `the error came ${dt}s after the daemon died`);
  report("daemon killed", `error after ${dt.toFixed(2)}s: ${res.error.slice(0, 80)}`);
}

if (process.argv[2] === "victim") {
  const [secs, out, sid] = process.argv.slice(3);
  const c = await connect();
  await call(c, "slow_write", { session: sid, seconds: Number(secs), out }).catch(() => {});
  throw new Failed("the victim was not killed");
} else {
  await runSteps(scenario);
}
