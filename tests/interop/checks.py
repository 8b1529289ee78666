"""What every interop client checks on the daemon's side: the workspace, the worker
processes, the audit. Used by the Python clients; the Node clients run the same checks
(checks.mjs). Reads its setting from the environment the driver (`run`) gives:
AIRLOCK_WORKSPACE, AIRLOCK_DAEMON_PID."""

import json
import os
import time


class Failed(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failed(what)


def workspace_file(rel):
    """The content of a workspace file, or None if it does not exist."""
    try:
        with open(os.path.join(os.environ["AIRLOCK_WORKSPACE"], rel)) as f:
            return f.read()
    except FileNotFoundError:
        return None


def cmdlines():
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[int(pid)] = f.read().split(b"\0")
            except OSError:
                pass
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def sleepers(seconds):
    """Processes running `sleep SECONDS` (each test call sleeps a value of its own)."""
    want = [b"sleep", str(seconds).encode()]
    return [p for p, c in cmdlines().items() if c[:2] == want]


def wait_until(what, cond, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise Failed(f"not within {timeout}s: {what}")


def events(audit_text):
    return json.loads(audit_text)


def unique_seconds(slot):
    """A sleep length no other call (of this run or another program) is likely to use:
    between 3.5 and 4.5 s, under slow_write's 5 s timeout."""
    return round(3.5 + ((os.getpid() * 7 + slot * 131) % 997) / 1000, 3)


def last_call(audit_text, tool):
    """The kinds of the audit events of the newest call of `tool`, and its worker pid."""
    evs = events(audit_text)
    calls = [e["job"] for e in evs if e["tool"] == tool]
    check(calls, f"no {tool} call in the audit")
    mine = [e for e in evs if e["job"] == calls[-1]]
    pids = [e["detail"]["pid"] for e in mine if e["kind"] == "start" and "pid" in (e.get("detail") or {})]
    return [e["kind"] for e in mine], (pids[0] if pids else None)


def worker_gone(seconds, pid, within=2.0):
    """The slow_write worker that sleeps `seconds` (and its shell, `pid`) is gone within
    `within` seconds."""
    wait_until(f"the worker sleeping {seconds}s is killed", lambda: not sleepers(seconds), within)
    if pid:
        wait_until(f"worker pid {pid} is gone", lambda: not alive(pid), within)


# The kinds that can end a call's audit sequence (README, "The audit log").
ENDS = ("commit", "rollback", "done", "error", "cancel")


def not_published(kinds, out_rel):
    """A cancelled call: it never committed, the audit says why, and its output is absent."""
    check("commit" not in kinds, f"a cancelled call committed: {kinds}")
    check(
        any(k in kinds for k in ("cancel", "rollback", "timeout")),
        f"the audit does not say the call was stopped: {kinds}",
    )
    check(workspace_file(out_rel) is None, f"{out_rel} was published by a cancelled call")
