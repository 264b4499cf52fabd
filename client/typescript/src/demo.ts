// Demo: prefill, decode and release against a running executor, one JSON line per step; then
// the same prompt once more with the next token constrained (an allow-list and a bias) and
// its three most likely ids asked for.
//
//   npm run demo -- localhost:50051 [--prompt 1,2,3] [--timeout 30]
//
// MODELEXEC_TOKEN, when set, is sent as a bearer token. Exit status 0 on success, 1 on
// any failed call (the error goes to stderr as a JSON line).
import { ExecutorClient, ExecutorError, type KvCacheHandle, type LogitsOutput } from "./client";

interface Args {
  target: string;
  prompt: number[];
  timeoutSeconds: number;
}

function parseArgs(argv: string[]): Args {
  const args: Args = { target: "localhost:50051", prompt: [1, 2, 3], timeoutSeconds: 30 };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--prompt") args.prompt = argv[++i].split(",").map((s) => Number.parseInt(s, 10));
    else if (arg === "--timeout") args.timeoutSeconds = Number(argv[++i]);
    else if (arg === "-h" || arg === "--help") {
      console.log("usage: npm run demo -- [TARGET] [--prompt 1,2,3] [--timeout SECONDS]");
      process.exit(0);
    } else args.target = arg;
  }
  if (args.prompt.length === 0 || args.prompt.some((t) => !Number.isInteger(t) || t < 0)) {
    throw new Error(`--prompt: expected comma-separated token ids, got ${args.prompt}`);
  }
  if (!Number.isFinite(args.timeoutSeconds) || args.timeoutSeconds <= 0) {
    throw new Error(`--timeout: expected a positive number of seconds, got ${args.timeoutSeconds}`);
  }
  return args;
}

/** JSON with bigint (uint64 fields) as decimal strings, as protobuf's JSON mapping does. */
function emit(record: object): void {
  console.log(JSON.stringify(record, (_key, value) => (typeof value === "bigint" ? value.toString() : value)));
}

function handle(h: KvCacheHandle | undefined) {
  return {
    cacheId: h?.cacheId,
    sequenceLength: h?.blockTable?.sequenceLength,
    blockIds: h?.blockTable?.blockIds,
    heldBlocks: h?.blockTable?.heldBlocks,
    blockSize: h?.blockTable?.blockSize,
  };
}

function logits(l: LogitsOutput | undefined) {
  return { tokenId: l?.tokenId, logprob: l?.logprob };
}

async function main(): Promise<void> {
  const args = parseArgs(process.argv.slice(2));
  const client = new ExecutorClient(args.target, {
    timeoutSeconds: args.timeoutSeconds,
    token: process.env.MODELEXEC_TOKEN || undefined,
  });
  let made: string | undefined;  // released at the end if the run stopped before its release
  try {
    await client.waitForReady();
    const info = (await client.getInfo()).info;
    emit({ step: "info", modelId: info?.modelId, vocabSize: info?.vocabSize, numLayers: info?.numLayers });

    const prefill = await client.prefill({ inputIds: args.prompt, logitsPolicy: { argmax: {} } });
    const afterPrefill = prefill.output?.kvCache;
    made = afterPrefill?.cacheId;
    emit({ step: "prefill", ...handle(afterPrefill), ...logits(prefill.output?.logits), timing: prefill.timing });

    // Its handle compact: the block ids left out, only their count (heldBlocks) returned.
    const decode = await client.decode(
      { tokenId: prefill.output?.logits?.tokenId ?? 0, kvCache: afterPrefill, logitsPolicy: { argmax: {} } },
      { compactHandles: true },
    );
    const afterDecode = decode.output?.kvCache;
    emit({ step: "decode", ...handle(afterDecode), ...logits(decode.output?.logits), timing: decode.timing });

    const release = await client.releaseCache(afterDecode?.cacheId ?? "");
    made = undefined;
    emit({ step: "release", cacheId: afterDecode?.cacheId, released: release.released, freedBlocks: release.freedBlocks });

    // Only ids 7, 8 and 9 may come next, 8 with 5 added to its logit.
    const constrained = await client.prefill({
      inputIds: args.prompt,
      logitsPolicy: { argmax: { topLogprobs: 3 }, adjustments: { allowedTokenIds: [7, 8, 9], logitBias: { 8: 5 } } },
    });
    made = constrained.output?.kvCache?.cacheId;
    const out = constrained.output?.logits;
    emit({ step: "constrained", ...logits(out), topTokenIds: out?.topTokenIds, topLogprobs: out?.topLogprobs });
    await client.releaseCache(made ?? "");
    made = undefined;

    const pool = (await client.getStatus()).status?.kvPool;
    emit({ step: "status", totalBlocks: pool?.totalBlocks, freeBlocks: pool?.freeBlocks, activeCaches: pool?.activeCaches });
  } finally {
    if (made) await client.releaseCache(made).catch(() => undefined);
    client.close();
  }
}

main().catch((err: unknown) => {
  if (err instanceof ExecutorError) {
    console.error(JSON.stringify({ error: err.codeName, code: err.code, details: err.details, reason: err.reason }));
  } else console.error(JSON.stringify({ error: String(err) }));
  process.exit(1);
});
