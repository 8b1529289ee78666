"""Retrying safely through the Python SDK (mcp), driven by tests/integration/idempotency.rs.

One logical call of `counter` under one idempotency key (`meta=` on call_tool). Each attempt
is a connection of its own through `airlock connect`; when the connection is lost before the
result (the test kills the bridge after the daemon has the request), the script reconnects
and resends with the same key, until it has a result (at most 5 attempts). Prints one JSON
line: the attempts made and the result it got.
Environment: AIRLOCK_BIN, AIRLOCK_SOCKET, IDEMPOTENCY_KEY, SESSION.
"""

import asyncio
import json
import os
import sys

from mcp import Client, StdioServerParameters

SERVER = StdioServerParameters(command=os.environ["AIRLOCK_BIN"],
                               args=["connect", "--socket", os.environ["AIRLOCK_SOCKET"]])
KEY = os.environ["IDEMPOTENCY_KEY"]
ARGS = {"session": os.environ["SESSION"], "by": 1}


async def attempt():
    async with Client(SERVER) as client:
        return await client.call_tool("counter", ARGS, meta={"airlock/idempotencyKey": KEY})


async def main():
    tries = 0
    while True:
        tries += 1
        try:
            result = await attempt()
            break
        except Exception as e:  # the connection was lost before the result
            print(f"attempt {tries}: lost ({e!r}); resending with the same key", file=sys.stderr)
            if tries >= 5:
                raise
    print(json.dumps({"tries": tries, "is_error": bool(result.is_error),
                      "structured": result.structured_content}))


asyncio.run(main())
