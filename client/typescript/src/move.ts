// Demo: move a KV cache from one executor to another, one JSON line per step.
//
//   npm run move -- SOURCE TARGET [--prompt 1,2,3,...] [--max-chunk-bytes N] [--timeout 30]
//                               [--small-target ADDRESS]
//
// A prefill on SOURCE; its ExportKv stream piped into ImportKv on TARGET (as cache
// "moved"), and the same messages, kept in an array, imported again (a replay); one
// decode step with the same token on both copies, whose full logits must be equal;
// ListCaches on TARGET; ReleaseCache of the source with a wrong and then the right
// expectedLength; then the errors of exporting an unknown cache and, with --small-target
// (a server whose KV pool cannot hold the cache), of an import refused while the export
// streams into it. MODELEXEC_TOKEN, when set, is sent as a bearer token to all. Exit status 0 on success, 1 on any unexpected
// failure (the error goes to stderr as a JSON line).
import { createHash } from "node:crypto";

import {
  DataType,
  ExecutorClient,
  ExecutorError,
  type ExportKvResponse,
  type KvCacheHandle,
  type LogitsOutput,
} from "./client";

interface Args {
  source: string;
  target: string;
  prompt: number[];
  maxChunkBytes: number;
  timeoutSeconds: number;
  smallTarget?: string;
}

const TARGET_ID = "moved";
const FULL_FP32 = { full: { dtype: DataType.DATA_TYPE_FLOAT32 } };

function parseArgs(argv: string[]): Args {
  const args: Args = { source: "", target: "", prompt: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], maxChunkBytes: 0, timeoutSeconds: 30 };
  const positional: string[] = [];
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--prompt") args.prompt = argv[++i].split(",").map((s) => Number.parseInt(s, 10));
    else if (arg === "--max-chunk-bytes") args.maxChunkBytes = Number(argv[++i]);
    else if (arg === "--timeout") args.timeoutSeconds = Number(argv[++i]);
    else if (arg === "--small-target") args.smallTarget = argv[++i];
    else if (arg === "-h" || arg === "--help") {
      console.log("usage: npm run move -- SOURCE TARGET [--prompt 1,2,3] [--max-chunk-bytes N] [--timeout SECONDS] " +
                  "[--small-target ADDRESS]");
      process.exit(0);
    } else positional.push(arg);
  }
  if (positional.length !== 2) throw new Error(`expected SOURCE and TARGET addresses, got ${JSON.stringify(positional)}`);
  [args.source, args.target] = positional;
  if (args.prompt.length === 0 || args.prompt.some((t) => !Number.isInteger(t) || t < 0)) {
    throw new Error(`--prompt: expected comma-separated token ids, got ${args.prompt}`);
  }
  if (!Number.isFinite(args.timeoutSeconds) || args.timeoutSeconds <= 0) {
    throw new Error(`--timeout: expected a positive number of seconds, got ${args.timeoutSeconds}`);
  }
  if (!Number.isInteger(args.maxChunkBytes) || args.maxChunkBytes < 0) {
    throw new Error(`--max-chunk-bytes: expected a non-negative integer, got ${args.maxChunkBytes}`);
  }
  return args;
}

/** JSON with bigint (uint64 fields) as decimal strings, as protobuf's JSON mapping does. */
function emit(record: object): void {
  console.log(JSON.stringify(record, (_key, value) => (typeof value === "bigint" ? value.toString() : value)));
}

function handle(h: KvCacheHandle | undefined) {
  return { cacheId: h?.cacheId, sequenceLength: h?.blockTable?.sequenceLength, blockSize: h?.blockTable?.blockSize };
}

/** The full logits row: its SHA-256 (to compare bitwise), its argmax and its first values. */
function logits(l: LogitsOutput | undefined) {
  const data = l?.logits?.data ?? Buffer.alloc(0);
  const row = new Float32Array(data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength));
  let argmax = 0;
  for (let i = 1; i < row.length; i++) if (row[i] > row[argmax]) argmax = i;
  return {
    sha256: createHash("sha256").update(data).digest("hex"),
    vocab: row.length,
    argmax,
    head: Array.from(row.slice(0, 4)),
  };
}

/** The messages of a stream as they pass, counted. */
async function* counted(stream: AsyncIterable<ExportKvResponse>, seen: { chunks: number; bytes: number }) {
  for await (const message of stream) {
    if (message.chunk) {
      seen.chunks += 1;
      seen.bytes += message.chunk.key.length + message.chunk.value.length;
    }
    yield message;
  }
}

function failure(err: unknown) {
  if (err instanceof ExecutorError) return { error: err.codeName, code: err.code, reason: err.reason, metadata: err.metadata };
  throw err;
}

async function main(): Promise<void> {
  const args = parseArgs(process.argv.slice(2));
  const options = { timeoutSeconds: args.timeoutSeconds, token: process.env.MODELEXEC_TOKEN || undefined };
  const source = new ExecutorClient(args.source, options);
  const target = new ExecutorClient(args.target, options);
  const small = args.smallTarget ? new ExecutorClient(args.smallTarget, options) : undefined;
  // What this run made, released at the end however it ends (a release of a released id is a no-op).
  const made: { client: ExecutorClient; cacheId: string }[] = [];
  try {
    await Promise.all([source.waitForReady(), target.waitForReady()]);

    const prefill = await source.prefill({ inputIds: args.prompt, logitsPolicy: { argmax: {} } });
    const original = prefill.output?.kvCache;
    if (!original) throw new Error("the prefill returned no cache handle");
    made.push({ client: source, cacheId: original.cacheId });
    emit({ step: "prefill", ...handle(original), tokenId: prefill.output?.logits?.tokenId });

    // The export kept in an array: its description, then its chunks.
    const messages: ExportKvResponse[] = [];
    for await (const message of source.exportKv(original, { maxChunkBytes: args.maxChunkBytes })) messages.push(message);
    const description = messages[0]?.description;
    emit({
      step: "export",
      messages: messages.length,
      chunks: messages.filter((m) => m.chunk).length,
      chunkBytes: messages.reduce((n, m) => n + (m.chunk ? m.chunk.key.length + m.chunk.value.length : 0), 0),
      description: {
        cacheId: description?.cacheId,
        startPosition: description?.startPosition,
        endPosition: description?.endPosition,
        cacheLength: description?.cacheLength,
        tokenIds: description?.tokenIds,
        numChunks: description?.numChunks,
        totalBytes: description?.totalBytes,
        modelId: description?.fingerprint?.modelId,
      },
    });

    // Streamed: each message goes on to the target as it arrives from the source.
    const seen = { chunks: 0, bytes: 0 };
    const imported = await target.importKv(
      counted(source.exportKv(original, { maxChunkBytes: args.maxChunkBytes }), seen), TARGET_ID);
    made.push({ client: target, cacheId: TARGET_ID });
    emit({ step: "import", ...handle(imported.kvCache), importedTokens: imported.importedTokens,
           replayed: imported.replayed, streamedChunks: seen.chunks, streamedBytes: seen.bytes, timing: imported.timing });

    // The same export again, from the array: a retry of a completed import writes nothing.
    const replay = await target.importKv(messages, TARGET_ID);
    emit({ step: "replay", ...handle(replay.kvCache), importedTokens: replay.importedTokens, replayed: replay.replayed });

    // One decode step on each copy: the same token, the same full logits.
    const token = prefill.output?.logits?.tokenId ?? 0;
    const [onSource, onTarget] = await Promise.all([
      source.decode({ tokenId: token, kvCache: original, logitsPolicy: FULL_FP32 }),
      target.decode({ tokenId: token, kvCache: imported.kvCache, logitsPolicy: FULL_FP32 }),
    ]);
    const a = logits(onSource.output?.logits);
    const b = logits(onTarget.output?.logits);
    emit({ step: "decode", tokenId: token, source: { ...handle(onSource.output?.kvCache), ...a },
           target: { ...handle(onTarget.output?.kvCache), ...b }, equal: a.sha256 === b.sha256 });

    const listed = await target.listCaches();
    const named = await target.listCaches([TARGET_ID, "no-such-cache"]);
    emit({
      step: "list",
      caches: listed.caches.map((c) => ({ cacheId: c.cacheId, sequenceLength: c.sequenceLength, numBlocks: c.numBlocks,
                                          loraAdapter: c.loraAdapter, idleSeconds: c.idleSeconds })),
      named: named.caches.map((c) => c.cacheId),
    });

    // The source grew by the decode: releasing it as if it still held the prompt is refused.
    const grown = onSource.output?.kvCache?.blockTable?.sequenceLength ?? 0;
    try {
      await source.releaseCache(original, { expectedLength: args.prompt.length });
      emit({ step: "stale-release", released: true });
    } catch (err) {
      emit({ step: "stale-release", expectedLength: args.prompt.length, ...failure(err) });
    }
    const released = await source.releaseCache(original, { expectedLength: grown });
    emit({ step: "release", expectedLength: grown, released: released.released, freedBlocks: released.freedBlocks });

    // Errors of the stream: an export of a cache the server does not have fails in the
    // loop that reads it, and an import fed by it rejects with that error.
    try {
      for await (const _ of source.exportKv("no-such-cache")) void _;
      emit({ step: "export-missing", failed: false });
    } catch (err) {
      emit({ step: "export-missing", ...failure(err) });
    }
    try {
      await target.importKv(source.exportKv("no-such-cache"), "never");
      emit({ step: "import-missing", failed: false });
    } catch (err) {
      emit({ step: "import-missing", ...failure(err) });
    }

    if (small) {
      // The import fails on the target; the export it was reading is cancelled with it.
      const again = await source.prefill({ inputIds: args.prompt, logitsPolicy: { argmax: {} } });
      made.push({ client: source, cacheId: again.output?.kvCache?.cacheId ?? "" });
      try {
        await small.importKv(source.exportKv(again.output?.kvCache ?? "", { maxChunkBytes: args.maxChunkBytes }));
        emit({ step: "import-exhausted", failed: false });
      } catch (err) {
        emit({ step: "import-exhausted", ...failure(err) });
      }
      await source.releaseCache(again.output?.kvCache ?? "");
    }

    const targetRelease = await target.releaseCache(TARGET_ID);
    emit({ step: "cleanup", released: targetRelease.released, targetCaches: (await target.listCaches()).caches.length,
           sourceCaches: (await source.listCaches()).caches.length });
  } finally {
    await Promise.allSettled(made.filter((m) => m.cacheId).map((m) => m.client.releaseCache(m.cacheId)));
    source.close();
    target.close();
    small?.close();
  }
}

main().catch((err: unknown) => {
  if (err instanceof ExecutorError) {
    console.error(JSON.stringify({ error: err.codeName, code: err.code, details: err.details, reason: err.reason }));
  } else console.error(JSON.stringify({ error: String(err) }));
  process.exit(1);
});
