// The MCP Inspector CLI against airlock: `node inspector_client.mjs MAJOR ERA`, MAJOR 2
// (Inspector 2.x, run under Node 22, ERA legacy|auto|modern via --protocol-era) or 0
// (Inspector 0.15, Node 20, 2025 era only). Each step is one run of the CLI, configured as
// README's client section shows (a config file whose server runs `airlock connect
// --socket PATH`). The CLI has no cancel and no request timeout of its own (its config's
// requestTimeout is not used by --cli), so the in-flight cancel is Ctrl-C (SIGINT to its
// process group, as a terminal sends it) and the client-side timeout is timeout(1)'s
// SIGTERM. Prints one JSON line per step; the last step kills the daemon.
import { spawn } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import Ajv2020 from "ajv/dist/2020.js";
import {
  ENDS,
  check, daemonAudit, lastCall, notPublished, runSteps, sleep, uniqueSeconds, waitSpawned, workerGone,
  workspaceFile,
} from "./checks.mjs";

const [major, era] = process.argv.slice(2);
const here = path.dirname(new URL(import.meta.url).pathname);
const AUDIT = "airlock://audit/events";
const config = path.join(process.env.HOME, "inspector.json");
fs.writeFileSync(
  config,
  JSON.stringify({
    mcpServers: {
      airlock: {
        command: process.env.AIRLOCK_BIN,
        args: ["connect", "--socket", process.env.AIRLOCK_SOCKET],
      },
    },
  }),
);

function cliArgs(method, extra) {
  if (major === "2") {
    return [path.join(here, "node_modules/inspector-2/clients/launcher/build/index.js"), "--cli",
      "--config", config, "--server", "airlock", "--protocol-era", era, "--format", "json", "-q",
      "--method", method, ...extra];
  }
  return [path.join(here, "node_modules/inspector-0/cli/build/cli.js"), "--cli",
    "--config", config, "--server", "airlock", "--method", method, ...extra];
}

function toolArgs(args) {
  if (Object.keys(args).length === 0) return [];
  if (major === "2") return ["--tool-args-json", JSON.stringify(args)];
  return ["--tool-arg", ...Object.entries(args).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`)];
}

/** Starts one CLI run in a process group of its own; `done` resolves with its outcome. */
function start(method, extra = []) {
  const child = spawn(process.execPath, cliArgs(method, extra), {
    stdio: ["ignore", "pipe", "pipe"],
    detached: true,
  });
  let out = "";
  let err = "";
  child.stdout.on("data", (d) => (out += d));
  child.stderr.on("data", (d) => (err += d));
  const done = new Promise((resolve) =>
    child.on("close", (code, signal) => {
      let json = null;
      try {
        json = JSON.parse(out);
      } catch {}
      resolve({ code, signal, out, err, json, at: Date.now() });
    }),
  );
  return { child, done };
}

async function run(method, extra) {
  const r = await start(method, extra).done;
  check(r.code === 0, `inspector ${method} exited ${r.code}: ${r.err.slice(-400)} ${r.out.slice(-400)}`);
  check(r.json, `inspector ${method}: no JSON on stdout: ${r.out.slice(0, 400)}`);
  // Inspector 2 --format json wraps the result: {"result": ...}.
  return major === "2" ? r.json.result : r.json;
}

const tool = (name, args) => run("tools/call", ["--tool-name", name, ...toolArgs(args)]);
const auditText = async () => (await run("resources/read", ["--uri", AUDIT])).contents[0].text;

async function settled() {
  const deadline = Date.now() + 3000;
  for (;;) {
    const { kinds } = lastCall(await daemonAudit(), "slow_write");
    if (ENDS.includes(kinds[kinds.length - 1]) || Date.now() > deadline) return kinds;
    await sleep(100);
  }
}

/** A slow_write stopped by `signal` to the CLI's process group once its worker runs. */
async function stopped(slot, sid, out, signal) {
  const secs = uniqueSeconds(slot);
  const run = start("tools/call", ["--tool-name", "slow_write", ...toolArgs({ session: sid, seconds: secs, out })]);
  await waitSpawned(secs, 60000);
  process.kill(-run.child.pid, signal);
  const r = await run.done;
  const { pid } = lastCall(await daemonAudit(), "slow_write");
  await workerGone(secs, pid, 3000);
  const kinds = await settled();
  notPublished(kinds, out);
  return `exit ${r.code ?? r.signal}; worker killed, audit ${kinds}`;
}

/** Which era the daemon saw this client speak, from its wire log. */
function eraOnTheWire() {
  const log = fs.readFileSync(process.env.AIRLOCK_DAEMON_LOG, "utf8");
  const modern = log.includes('"io.modelcontextprotocol/protocolVersion":"2026-07-28"');
  const legacy = log.includes('"method":"initialize"');
  return modern && !legacy ? "2026-07-28" : legacy && !modern ? "2025" : `mixed (modern ${modern}, initialize ${legacy})`;
}

async function scenario(report) {
  const tag = `inspector${major}-${era}`;
  const listed = await run("tools/list", []);
  const tools = Object.fromEntries(listed.tools.map((t) => [t.name, t]));
  const expected = era === "modern" || era === "auto" ? "2026-07-28" : "2025";
  check(eraOnTheWire() === expected, `the wire shows era ${eraOnTheWire()}, expected ${expected}`);
  report("initialize", `era ${expected} on the wire`);

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
  check(v({ session: "s", text: "x", out: "o" }) && !v({ session: "s", out: "o" }), "write_text schema");
  report("tools/list", `${listed.tools.length} tools, schemas valid (Draft 2020-12, Ajv)`);

  const sid = `${tag}-s`;
  let r = await tool("session_create", { id: sid, state: { k: [1, "x"] } });
  check(!r.isError, `session_create: ${JSON.stringify(r)}`);
  const text = `hello from ${tag}`;
  r = await tool("write_text", { session: sid, text, out: `${tag}.txt` });
  check(!r.isError && workspaceFile(`${tag}.txt`) === text, `write_text: ${JSON.stringify(r)}`);
  report("write call", `${tag}.txt published`);

  r = await tool("cat", { path: `${tag}.txt` });
  check(r.content.map((b) => b.text || "").join("").includes(text), `cat: ${JSON.stringify(r)}`);
  report("read call", "cat returns the published text");

  const s0 = (await tool("session_get", { session: sid })).structuredContent;
  for (let i = 0; i < 2; i++) check(!(await tool("counter", { session: sid, by: 2 })).isError, "counter");
  const s1 = (await tool("session_get", { session: sid })).structuredContent;
  check(s1.state.counter === 4 && s1.state.k.length === 2, `state: ${JSON.stringify(s1)}`);
  check(s1.version === s0.version + 2, `versions ${s0.version} -> ${s1.version}`);
  report("state round trip", `version ${s0.version} -> ${s1.version}, counter 4 (one CLI run each)`);

  const evs = JSON.parse(await auditText());
  check(evs.some((e) => e.kind === "commit" && e.tool === "write_text"), "no commit of write_text in the audit");
  report("audit resource", `${evs.length} events, write_text committed`);

  report("in-flight cancel", `Ctrl-C: ${await stopped(1, sid, `${tag}-cancelled.txt`, "SIGINT")}`);
  report("client timeout", `timeout(1) SIGTERM: ${await stopped(2, sid, `${tag}-timeout.txt`, "SIGTERM")}`);

  // A protocol error that reaches the daemon (the Inspector 2 checks tool names itself):
  // a resource that does not exist, -32002 in the 2025 era and -32602 in 2026-07-28.
  r = await start("resources/read", ["--uri", "airlock://nope"]).done;
  const code = expected === "2025" ? -32002 : -32602;
  const wire = fs.readFileSync(process.env.AIRLOCK_DAEMON_LOG, "utf8");
  check(r.code !== 0, `resources/read of no resource exited 0: ${r.out}`);
  check(wire.includes(`"error":{"code":${code},`), `no ${code} error on the wire`);
  check((await run("tools/list", [])).tools.length === listed.tools.length, "no tools/list after the error");
  report("protocol error", `no such resource -> ${code}, CLI exit ${r.code}; the daemon serves on`);

  report("client killed", `SIGKILL: ${await stopped(3, sid, `${tag}-killed.txt`, "SIGKILL")}`);

  const secs = uniqueSeconds(4);
  const doomed = start("tools/call", ["--tool-name", "slow_write", ...toolArgs({ session: sid, seconds: secs, out: `${tag}-d.txt` })]);
  await waitSpawned(secs, 60000);
  const killedAt = Date.now();
  process.kill(Number(process.env.AIRLOCK_DAEMON_PID), "SIGKILL");
  const res = await Promise.race([doomed.done, sleep(10000).then(() => null)]);
  check(res, "the CLI did not end within 10 s of the daemon's death");
  check(res.code !== 0, `the CLI succeeded although the daemon died: ${res.out}`);
  const dt = (res.at - killedAt) / 1000;
  check(dt < 2, `the CLI failed ${dt}s after the daemon died`);
  report("daemon killed", `exit ${res.code} after ${dt.toFixed(2)}s`);
}

await runSteps(scenario);
