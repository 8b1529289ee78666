// What every interop client checks on the daemon's side (the Node twin of checks.py): the
// workspace, the worker processes, the audit, and the step report. Settings come from the
// environment `run` gives: AIRLOCK_BIN, AIRLOCK_SOCKET, AIRLOCK_WORKSPACE, AIRLOCK_DAEMON_PID.
import fs from "node:fs";
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

/** The audit kinds of the newest call of `tool`, and its worker pid. */
export function lastCall(auditText, tool) {
  const evs = JSON.parse(auditText);
  const calls = evs.filter((e) => e.tool === tool).map((e) => e.call);
  check(calls.length > 0, `no ${tool} call in the audit`);
  const mine = evs.filter((e) => e.call === calls[calls.length - 1]);
  const spawned = mine.find((e) => e.kind === "spawned");
  return { kinds: mine.map((e) => e.kind), pid: spawned ? spawned.detail.pid : null };
}

export async function workerGone(seconds, pid, withinMs = 2000) {
  await waitUntil(`the worker sleeping ${seconds}s is killed`, () => sleepers(seconds).length === 0, withinMs);
  if (pid) await waitUntil(`worker pid ${pid} is gone`, () => !alive(pid), withinMs);
}

/** A cancelled call: it never committed, the audit says why, and its output is absent. */
export function notPublished(kinds, outRel) {
  check(!kinds.includes("commit"), `a cancelled call committed: ${kinds}`);
  check(
    kinds.some((k) => ["cancelled", "rollback", "timeout"].includes(k)),
    `the audit does not say the call was stopped: ${kinds}`,
  );
  check(workspaceFile(outRel) === null, `${outRel} was published by a cancelled call`);
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
