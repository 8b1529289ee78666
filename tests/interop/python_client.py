"""The official Python SDK (`mcp`) against airlock, in one of its modes:

  auto        Client(mode="auto"): server/discover, then the 2026-07-28 era
  legacy      Client(mode="legacy"): the initialize handshake (2025-11-25)
  2026-07-28  Client(mode="2026-07-28"): that era without the probe
  session     ClientSession over stdio_client, initialize by hand

It launches `airlock connect --socket PATH` as a stdio server, as any user's config would,
and prints one JSON line per step: {"step", "ok", "ms", "detail"}. The driver (`run`) gives
AIRLOCK_BIN, AIRLOCK_SOCKET, AIRLOCK_WORKSPACE and AIRLOCK_DAEMON_PID. The last step kills
the daemon.

`python_client.py victim MODE SECONDS OUT` is the client killed mid-call: it starts a
slow_write and waits to be killed.
"""

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager

import anyio
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from mcp import Client, ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from checks import (
    ENDS,
    Failed,
    check,
    last_call,
    not_published,
    sleepers,
    unique_seconds,
    wait_until,
    worker_gone,
    workspace_file,
)

AUDIT = "airlock://audit/events"


def params():
    return StdioServerParameters(
        command=os.environ["AIRLOCK_BIN"],
        args=["connect", "--socket", os.environ["AIRLOCK_SOCKET"]],
    )


@asynccontextmanager
async def connect(mode):
    if mode == "session":
        async with stdio_client(params()) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                yield s
    else:
        async with Client(params(), mode=mode, cache=None) as c:
            yield c


def version_of(c):
    return getattr(c, "protocol_version", None) or "2025-11-25"


def result_json(r):
    return r.model_dump(by_alias=True, exclude_none=True)


async def call(c, name, args, **kw):
    return result_json(await c.call_tool(name, args, **kw))


async def audit_text(c):
    r = await c.read_resource(AUDIT)
    return r.contents[0].text


async def settled(c, timeout=3.0):
    """The audit kinds of the newest slow_write call once it has ended (its last event is
    one of the ends), polled for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        kinds, _ = last_call(await audit_text(c), "slow_write")
        if kinds[-1] in ENDS or time.monotonic() > deadline:
            return kinds
        await anyio.sleep(0.05)


async def wait_spawned(seconds, timeout=10.0):
    """Until the worker that sleeps `seconds` runs."""
    deadline = time.monotonic() + timeout
    while not sleepers(seconds):
        if time.monotonic() > deadline:
            raise Failed(f"no worker sleeping {seconds}s within {timeout}s")
        await anyio.sleep(0.02)


async def scenario(mode, report):
    tag = f"py-{mode}"
    async with connect(mode) as c:
        report("initialize", f"protocol {version_of(c)}")
        expected = "2025-11-25" if mode in ("legacy", "session") else "2026-07-28"
        check(version_of(c) == expected, f"negotiated {version_of(c)}, expected {expected}")

        # tools/list: every input schema is a valid Draft 2020-12 schema that accepts a
        # good call and refuses a bad one.
        tools = {t.name: result_json(t) for t in (await c.list_tools()).tools}
        for need in ("session_create", "session_get", "write_text", "cat", "counter", "slow_write"):
            check(need in tools, f"tools/list lacks {need}")
        for name, t in tools.items():
            for key in ("inputSchema", "outputSchema"):
                if key in t:
                    try:
                        Draft202012Validator.check_schema(t[key])
                    except SchemaError as e:
                        raise Failed(f"{name}.{key} is not a Draft 2020-12 schema: {e.message}")
        v = Draft202012Validator(tools["write_text"]["inputSchema"])
        check(v.is_valid({"session": "s", "text": "x", "out": "o"}), "a good call fails the schema")
        check(not v.is_valid({"session": "s", "out": "o"}), "a call without text passes the schema")
        check(not v.is_valid({"session": "s", "text": 1, "out": "o"}), "text=1 passes the schema")
        report("tools/list", f"{len(tools)} tools, schemas valid (Draft 2020-12)")

        # A write call that publishes.
        sid = f"{tag}-s"
        r = await call(c, "session_create", {"id": sid, "state": {"k": [1, "x"]}})
        check(not r.get("isError"), f"session_create: {r}")
        text = f"hello from {tag}"
        r = await call(c, "write_text", {"session": sid, "text": text, "out": f"{tag}.txt"})
        check(not r.get("isError"), f"write_text: {r}")
        check(workspace_file(f"{tag}.txt") == text, "write_text did not publish its file")
        report("write call", f"{tag}.txt published")

        # A read call.
        r = await call(c, "cat", {"path": f"{tag}.txt"})
        got = "".join(b.get("text", "") for b in r["content"])
        check(text in got, f"cat returned {got!r}")
        report("read call", "cat returns the published text")

        # State round trip.
        r = await call(c, "session_get", {"session": sid})
        s0 = r["structuredContent"]
        check(s0["state"] == {"k": [1, "x"]}, f"initial state {s0}")
        for _ in range(2):
            r = await call(c, "counter", {"session": sid, "by": 2})
            check(not r.get("isError"), f"counter: {r}")
        s1 = (await call(c, "session_get", {"session": sid}))["structuredContent"]
        check(s1["state"] == {"k": [1, "x"], "counter": 4}, f"state after two counters: {s1}")
        check(s1["version"] == s0["version"] + 2, f"versions {s0['version']} -> {s1['version']}")
        report("state round trip", f"version {s0['version']} -> {s1['version']}, counter 4")

        # The audit resource.
        uris = [str(x.uri) for x in (await c.list_resources()).resources]
        check(AUDIT in uris, f"resources/list: {uris}")
        evs = json.loads(await audit_text(c))
        commits = [e for e in evs if e["kind"] == "commit" and e["tool"] == "write_text"]
        check(commits, "no commit event of write_text in the audit")
        report("audit resource", f"{len(evs)} events, write_text committed")

        # An in-flight cancel: the caller abandons the call (anyio cancel scope); the SDK
        # sends notifications/cancelled; the worker is killed, nothing is published.
        secs = unique_seconds(1)
        out = f"{tag}-cancelled.txt"
        t0 = time.monotonic()
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                async def cancel_when_running():
                    await wait_spawned(secs)
                    scope.cancel()
                tg.start_soon(cancel_when_running)
                await call(c, "slow_write", {"session": sid, "seconds": secs, "out": out})
                raise Failed("slow_write completed although cancelled")
        check(scope.cancelled_caught, "the call was not cancelled")
        kinds, pid = last_call(await audit_text(c), "slow_write")
        worker_gone(secs, pid)
        kinds = await settled(c)
        not_published(kinds, out)
        s2 = (await call(c, "session_get", {"session": sid}))["structuredContent"]
        check(s2["version"] == s1["version"], f"a cancelled call moved the version: {s2}")
        report("in-flight cancel", f"worker killed, audit {kinds}, {time.monotonic() - t0:.1f}s")

        # A client-side timeout: the same, from read_timeout_seconds.
        secs = unique_seconds(2)
        out = f"{tag}-timeout.txt"
        try:
            await call(c, "slow_write", {"session": sid, "seconds": secs, "out": out},
                       read_timeout_seconds=1.0)
            raise Failed("slow_write completed despite a 1 s client timeout")
        except Failed:
            raise
        except Exception as e:  # the SDK's timeout error
            detail = type(e).__name__
        kinds, pid = last_call(await audit_text(c), "slow_write")
        worker_gone(secs, pid)
        kinds = await settled(c)
        not_published(kinds, out)
        report("client timeout", f"{detail}; worker killed, audit {kinds}")

        # A protocol error: an unknown tool is -32602; the connection keeps serving.
        try:
            await c.call_tool("no_such_tool", {})
            raise Failed("an unknown tool was called")
        except Failed:
            raise
        except Exception as e:
            code = getattr(getattr(e, "error", None), "code", None) or getattr(e, "code", None)
            check(code == -32602, f"unknown tool: {e!r} (code {code})")
        check(len((await c.list_tools()).tools) == len(tools), "no tools/list after the error")
        report("protocol error", "unknown tool -> -32602, connection still serves")

    # A client killed mid-call: its calls are cancelled, nothing is published.
    secs = unique_seconds(3)
    out = f"{tag}-killed.txt"
    victim = subprocess.Popen(
        [sys.executable, __file__, "victim", mode, str(secs), out, sid],
        stdout=subprocess.DEVNULL,
    )
    # The victim is a new Python process that imports the SDK: slow on a loaded machine.
    await wait_spawned(secs, timeout=60.0)
    victim.kill()
    victim.wait()
    async with connect(mode) as c:
        kinds, pid = last_call(await audit_text(c), "slow_write")
        worker_gone(secs, pid, within=3.0)
        kinds = await settled(c)
        not_published(kinds, out)
        report("client killed", f"worker killed, audit {kinds}")

        # The daemon killed mid-call: the client gets an error within 2 s.
        secs = unique_seconds(4)
        failed = {}

        async def doomed():
            try:
                await call(c, "slow_write", {"session": sid, "seconds": secs, "out": f"{tag}-d.txt"})
                failed["result"] = "completed"
            except Exception as e:
                failed["at"] = time.monotonic()
                failed["error"] = repr(e)[:200]

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(doomed)
                await wait_spawned(secs)
                killed_at = time.monotonic()
                os.kill(int(os.environ["AIRLOCK_DAEMON_PID"]), signal.SIGKILL)
        check("at" in failed, f"the call did not fail: {failed}")
        dt = failed["at"] - killed_at
        check(dt < 2.0, f"the error came {dt:.2f}s after the daemon died")
        report("daemon killed", f"error after {dt:.2f}s: {failed['error'][:80]}")


async def victim(mode, secs, out, sid):
    async with connect(mode) as c:
        await c.call_tool("slow_write", {"session": sid, "seconds": float(secs), "out": out})


def main():
    if sys.argv[1] == "victim":
        anyio.run(victim, *sys.argv[2:6])
        return
    mode = sys.argv[1]
    t = [time.monotonic()]

    def report(step, detail):
        now = time.monotonic()
        print(json.dumps({"step": step, "ok": True, "ms": int((now - t[0]) * 1000), "detail": detail}),
              flush=True)
        t[0] = now

    try:
        anyio.run(scenario, mode, report)
    except BaseException as e:  # noqa: BLE001 - every failure is reported as a step
        while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
            e = e.exceptions[0]
        print(json.dumps({"step": "FAILED", "ok": False, "ms": 0, "detail": f"{type(e).__name__}: {e}"}),
              flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
