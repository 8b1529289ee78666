// What every interop client checks on the daemon's side (the Node twin of checks.py): the
// workspace, the worker processes, the audit, and the step report. Settings come from the
// environment `run` gives: AIRLOCK_BIN, AIRLOCK_SOCKET, AIRLOCK_WORKSPACE, AIRLOCK_DAEMON_PID.
import fs from "node:fs";
import net from "node:net";
import path from "node:path";

export class Failed extends Error {}

export function check(cond, what) {
  if (!cond) throw new Failed(what);
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export function workspaceFile(rel) {
  try {
    return fs.readFileSync(path.join(process.env.AIRLOCK_WORKSPACE, rel), "utf8");
  } catch (e) {
    if (e.code === "ENOENT") return null;
    throw e;
  }
}

/** Processes running `sleep SECONDS` (each test call sleeps a value of its own). */
export function sleepers(seconds) {
  const out = [];
  for (const pid of fs.readdirSync("/proc")) {
    if (!/^\d+$/.test(pid)) continue;
    let argv;
    try {
      argv = fs.readFileSync(`/proc/${pid}/cmdline`, "latin1").split("\0");
    } catch {
      continue;
    }
    if (argv[0] === "sleep" && argv[1] === String(seconds)) out.push(Number(pid));
  }
  return out;
}

export function alive(pid) {
  try {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, "latin1");
    return stat.split(") ").pop()[0] !== "Z";
  } catch {
    return false;
  }
}

export async function waitUntil(what, cond, timeoutMs) {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    if (cond()) return;
    await sleep(50);
  }
  throw new Failed(`not within ${timeoutMs / 1000}s: ${what}`);
}

export async function waitSpawned(seconds, timeoutMs = 10000) {
  await waitUntil(`a worker sleeping ${seconds}s runs`, () => sleepers(seconds).length > 0, timeoutMs);
}

/** A sleep length no other call is likely to use: 3.5-4.5 s, under slow_write's 5 s timeout. */
export function uniqueSeconds(slot) {
  return Math.round((3.5 + ((process.pid * 7 + slot * 131) % 997) / 1000) * 1000) / 1000;
}

/** The audit kinds of the newest call (job) of `tool`, and its worker pid (from `start`). */
export function lastCall(auditText, tool) {
  const evs = JSON.parse(auditText);
  const jobs = evs.filter((e) => e.tool === tool).map((e) => e.job);
  check(jobs.length > 0, `no ${tool} call in the audit`);
  const mine = evs.filter((e) => e.job === jobs[jobs.length - 1]);
  const start = mine.find((e) => e.kind === "start" && e.detail && e.detail.pid);
  return { kinds: mine.map((e) => e.kind), pid: start ? start.detail.pid : null };
}

/** The kinds that can end a call's audit sequence (README, "The audit log"). */
export const ENDS = ["commit", "rollback", "done", "error", "cancel"];

export async function workerGone(seconds, pid, withinMs = 2000) {
  await waitUntil(`the worker sleeping ${seconds}s is killed`, () => sleepers(seconds).length === 0, withinMs);
  if (pid) await waitUntil(`worker pid ${pid} is gone`, () => !alive(pid), withinMs);
}

/** A cancelled call: it never committed, the audit says why, and its output is absent. */
export function notPublished(kinds, outRel) {
  check(!kinds.includes("commit"), `a cancelled call committed: ${kinds}`);
  check(
    kinds.some((k) => ["cancel", "rollback", "timeout"].includes(k)),
    `the audit does not say the call was stopped: ${kinds}`,
  );
  check(workspaceFile(outRel) === null, `${outRel} was published by a cancelled call`);
}

/** The audit as the daemon serves it, read over a connection of the check's own (raw
 * JSON-RPC, 2025 era): for checking what a CLI client did without more runs of it. */
export function daemonAudit() {
  return new Promise((resolve, reject) => {
    const sock = net.connect(process.env.AIRLOCK_SOCKET);
    let buf = "";
    const send = (m) => sock.write(JSON.stringify({ jsonrpc: "2.0", ...m }) + "\n");
    sock.on("error", reject);
    sock.on("data", (d) => {
      buf += d;
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        const m = JSON.parse(buf.slice(0, i));
        buf = buf.slice(i + 1);
        if (m.id === 1) {
          send({ method: "notifications/initialized" });
          send({ id: 2, method: "resources/read", params: { uri: "airlock://audit/events" } });
        } else if (m.id === 2) {
          sock.end();
          if (m.error) reject(new Failed(`audit read: ${JSON.stringify(m.error)}`));
          else resolve(m.result.contents[0].text);
        }
      }
    });
    send({ id: 1, method: "initialize", params: { protocolVersion: "2025-11-25", capabilities: {}, clientInfo: { name: "interop-check", version: "0" } } });
  });
}

/** Runs `scenario(report)`, printing one JSON line per step, and exits non-zero on failure. */
export async function runSteps(scenario) {
  let t = Date.now();
  const report = (step, detail) => {
    const now = Date.now();
    console.log(JSON.stringify({ step, ok: true, ms: now - t, detail }));
    t = now;
  };
  try {
    await scenario(report);
    process.exit(0);
  } catch (e) {
    console.log(JSON.stringify({ step: "FAILED", ok: false, ms: 0, detail: `${e.name}: ${e.message}` }));
    console.error(e && e.stack);
    process.exit(1);
  }
}
