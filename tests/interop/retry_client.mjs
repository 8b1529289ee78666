// Retrying safely through the TypeScript SDK, driven by tests/integration/idempotency.rs.
//
// One logical call of `counter` under one idempotency key (`_meta` in callTool's params).
// Each attempt is a connection of its own through `airlock connect`; when the connection is
// lost before the result (the test kills the bridge after the daemon has the request), the
// script reconnects and resends with the same key, until it has a result (at most 5
// attempts). Prints one JSON line: the attempts made and the result it got.
// Environment: AIRLOCK_BIN, AIRLOCK_SOCKET, IDEMPOTENCY_KEY, SESSION.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const key = process.env.IDEMPOTENCY_KEY;

async function attempt() {
  const transport = new StdioClientTransport({
    command: process.env.AIRLOCK_BIN,
    args: ["connect", "--socket", process.env.AIRLOCK_SOCKET],
  });
  const client = new Client({ name: "retry-client", version: "1" });
  await client.connect(transport);
  try {
    return await client.callTool({
      name: "counter",
      arguments: { session: process.env.SESSION, by: 1 },
      _meta: { "airlock/idempotencyKey": key },
    });
  } finally {
    await client.close().catch(() => {});
  }
}

let tries = 0;
let result;
for (;;) {
  tries += 1;
  try {
    result = await attempt();
    break;
  } catch (e) {
    console.error(`attempt ${tries}: lost (${e}); resending with the same key`);
    if (tries >= 5) throw e;
  }
}
console.log(JSON.stringify({ tries, is_error: result.isError ?? false, structured: result.structuredContent }));
