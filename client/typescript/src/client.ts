// A small promise-based client for modelexec.v1 over @grpc/grpc-js, on top of the code
// that ts-proto generates from ../../protos into src/gen/ (`npm run generate`).
import { BinaryReader } from "@bufbuild/protobuf/wire";
import { credentials, Metadata, type ChannelCredentials, type ServiceError, status } from "@grpc/grpc-js";

import {
  type DecodeInput,
  type DeepPartial,
  DecodeRequest,
  type DecodeResponse,
  ExportKvRequest,
  type ExportKvResponse,
  GetInfoRequest,
  type GetInfoResponse,
  GetStatusRequest,
  type GetStatusResponse,
  HandleDetail,
  ImportKvRequest,
  type ImportKvResponse,
  type KvCacheHandle,
  ListCachesRequest,
  type ListCachesResponse,
  ModelExecutorServiceClient,
  type PrefillInput,
  PrefillRequest,
  type PrefillResponse,
  ReleaseCacheRequest,
  type ReleaseCacheResponse,
} from "./gen/modelexec/v1/executor";

export * from "./gen/modelexec/v1/executor";

/** Same default as the server and the Python client: 256 MiB each way (gRPC's own is 4 MiB). */
export const DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024;

export interface ExecutorClientOptions {
  /** Per-call deadline in seconds (default 30). */
  timeoutSeconds?: number;
  /** Bearer token sent as `authorization: Bearer <token>` (servers started with auth). */
  token?: string;
  /** Channel credentials (default: plaintext). */
  credentials?: ChannelCredentials;
  maxMessageBytes?: number;
}

/**
 * A failed call: the gRPC status code, its name and the server's message, plus the
 * google.rpc.ErrorInfo the server attaches (`reason` such as "STALE_CACHE_HANDLE" or
 * "KV_CACHE_EXHAUSTED", and `metadata` such as "cache_length" or "blocks_needed"); the
 * reason is "" and the metadata empty when the status carries none.
 */
export class ExecutorError extends Error {
  constructor(
    readonly code: status,
    readonly codeName: string,
    readonly details: string,
    readonly reason: string = "",
    readonly metadata: Readonly<Record<string, string>> = {},
  ) {
    super(`${codeName}: ${details}${reason ? ` [${reason}]` : ""}`);
    this.name = "ExecutorError";
  }
}

/** Options of the stepping calls (`prefill`, `decode`). */
export interface StepOptions {
  /**
   * Return the handle without its block ids (HANDLE_DETAIL_COMPACT): they grow with the cache
   * (2048 at 32K tokens in 16-token blocks), and the executor reads only `cacheId` and the
   * block table's `sequenceLength` of a handle sent back. `heldBlocks` still counts them.
   */
  compactHandles?: boolean;
}

/** Options of `exportKv`: positions [start, end) of the cache (default all of it). */
export interface ExportKvOptions {
  /** First position to export (default 0). */
  start?: number;
  /** One past the last position (default the cache's length). */
  end?: number;
  /** Upper bound on one chunk's key + value bytes; 0 or absent: the server's 1 MiB. */
  maxChunkBytes?: number;
  /** Deadline of the whole stream in seconds (default the client's timeoutSeconds). */
  timeoutSeconds?: number;
}

/** Options of `releaseCache`. */
export interface ReleaseCacheOptions {
  /**
   * Release only if the cache holds exactly this many tokens, else FAILED_PRECONDITION
   * (reason STALE_CACHE_HANDLE, metadata `cache_length`): a mover releases the source
   * only if no step has grown it since its last export.
   */
  expectedLength?: number;
}

function handleDetail(options: StepOptions): HandleDetail {
  return options.compactHandles ? HandleDetail.HANDLE_DETAIL_COMPACT : HandleDetail.HANDLE_DETAIL_UNSPECIFIED;
}

function cacheIdOf(cache: KvCacheHandle | string): string {
  return typeof cache === "string" ? cache : cache.cacheId;
}

/** The ImportKv message that forwards one ExportKv message: the description becomes the
 * start (naming the cache to create, "" for a server-chosen id), a chunk stays a chunk. */
export function importKvRequest(message: ExportKvResponse, cacheId?: string): ImportKvRequest {
  if (message.description !== undefined) {
    return ImportKvRequest.fromPartial({ start: { description: message.description, cacheId: cacheId ?? "" } });
  }
  if (message.chunk !== undefined) return ImportKvRequest.fromPartial({ chunk: message.chunk });
  throw new TypeError("importKv: an ExportKv message with neither a description nor a chunk");
}

/** reason and metadata of the google.rpc.ErrorInfo in a status's `grpc-status-details-bin`
 * trailer (a google.rpc.Status whose details are google.protobuf.Any), if there is one. */
function errorInfo(trailers: Metadata | undefined): { reason: string; metadata: Record<string, string> } | undefined {
  const raw = trailers?.get("grpc-status-details-bin")[0];
  if (!(raw instanceof Uint8Array)) return undefined;
  try {
    const statusReader = new BinaryReader(raw);
    while (statusReader.pos < statusReader.len) {
      const [field, wireType] = statusReader.tag();
      if (field !== 3) {
        statusReader.skip(wireType, field);
        continue;
      }
      const any = new BinaryReader(statusReader.bytes()); // google.protobuf.Any
      let typeUrl = "";
      let value: Uint8Array | undefined;
      while (any.pos < any.len) {
        const [f, w] = any.tag();
        if (f === 1) typeUrl = any.string();
        else if (f === 2) value = any.bytes();
        else any.skip(w, f);
      }
      if (!typeUrl.endsWith("/google.rpc.ErrorInfo") || value === undefined) continue;
      const info = new BinaryReader(value); // reason = 1, domain = 2, map<string, string> metadata = 3
      const out = { reason: "", metadata: {} as Record<string, string> };
      while (info.pos < info.len) {
        const [f, w] = info.tag();
        if (f === 1) out.reason = info.string();
        else if (f === 3) {
          const entry = new BinaryReader(info.bytes());
          let key = "";
          let val = "";
          while (entry.pos < entry.len) {
            const [ef, ew] = entry.tag();
            if (ef === 1) key = entry.string();
            else if (ef === 2) val = entry.string();
            else entry.skip(ew, ef);
          }
          out.metadata[key] = val;
        } else info.skip(w, f);
      }
      return out;
    }
  } catch {
    // A malformed trailer: the status code and message still say what failed.
  }
  return undefined;
}

function isServiceError(error: unknown): error is ServiceError {
  return error instanceof Error && typeof (error as Partial<ServiceError>).code === "number" && "details" in error;
}

/** The ExecutorError of a failed call; anything else (already an ExecutorError, a bug in
 * the caller's own iterable) is returned as it is. */
export function toExecutorError(error: unknown): unknown {
  if (error instanceof ExecutorError || !isServiceError(error)) return error;
  const info = errorInfo(error.metadata);
  return new ExecutorError(error.code, status[error.code] ?? String(error.code), error.details, info?.reason,
    info?.metadata);
}

type Unary<Req, Res> = (
  request: Req,
  metadata: Metadata,
  options: { deadline: Date },
  callback: (error: ServiceError | null, response: Res) => void,
) => unknown;

export class ExecutorClient {
  private readonly stub: ModelExecutorServiceClient;
  private readonly timeoutMs: number;
  private readonly token?: string;

  /** `target`: "host:port" or "unix:///path/to/socket". */
  constructor(target: string, options: ExecutorClientOptions = {}) {
    const limit = options.maxMessageBytes ?? DEFAULT_MAX_MESSAGE_BYTES;
    this.stub = new ModelExecutorServiceClient(target, options.credentials ?? credentials.createInsecure(), {
      "grpc.max_send_message_length": limit,
      "grpc.max_receive_message_length": limit,
    });
    this.timeoutMs = (options.timeoutSeconds ?? 30) * 1000;
    this.token = options.token;
  }

  /** Resolves once the channel is connected (or rejects after timeoutSeconds). */
  waitForReady(timeoutSeconds?: number): Promise<void> {
    const deadline = new Date(Date.now() + (timeoutSeconds !== undefined ? timeoutSeconds * 1000 : this.timeoutMs));
    return new Promise((resolve, reject) => this.stub.waitForReady(deadline, (err) => (err ? reject(err) : resolve())));
  }

  getInfo(): Promise<GetInfoResponse> {
    return this.unary(this.stub.getInfo, GetInfoRequest.create());
  }

  getStatus(): Promise<GetStatusResponse> {
    return this.unary(this.stub.getStatus, GetStatusRequest.create());
  }

  /**
   * Runs a prompt (or the next chunk of one). Without `kvCache` the server creates a cache.
   * Nested messages may be partial too (`logitsPolicy: { argmax: {} }`): fields a later
   * contract adds do not break a caller's literals.
   */
  prefill(input: DeepPartial<PrefillInput>, options: StepOptions = {}): Promise<PrefillResponse> {
    return this.unary(this.stub.prefill, PrefillRequest.fromPartial({ input, handleDetail: handleDetail(options) }));
  }

  /** Appends `input.tokenId` to the cache `input.kvCache` (the handle the last call returned). */
  decode(input: DeepPartial<DecodeInput>, options: StepOptions = {}): Promise<DecodeResponse> {
    return this.unary(this.stub.decode, DecodeRequest.fromPartial({ input, handleDetail: handleDetail(options) }));
  }

  /**
   * Frees a cache; idempotent (`released` is false the second time). With
   * `expectedLength`, only if the cache holds exactly that many tokens (else
   * FAILED_PRECONDITION, reason STALE_CACHE_HANDLE, and the cache stays).
   */
  releaseCache(cache: KvCacheHandle | string, options: ReleaseCacheOptions = {}): Promise<ReleaseCacheResponse> {
    const request = ReleaseCacheRequest.create({ cacheId: cacheIdOf(cache) });
    if (options.expectedLength !== undefined) request.expectedLength = options.expectedLength;
    return this.unary(this.stub.releaseCache, request);
  }

  /**
   * The ExportKv stream of a cache: its description first, then its K and V in chunks.
   * The call starts when iteration does; stopping early (break, return) cancels it, and a
   * failed call throws an ExecutorError from the loop. Pass it straight to another
   * server's `importKv` to move the cache without holding it in memory.
   */
  async *exportKv(cache: KvCacheHandle | string, options: ExportKvOptions = {}): AsyncGenerator<ExportKvResponse> {
    const request = ExportKvRequest.create({ cacheId: cacheIdOf(cache), maxChunkBytes: options.maxChunkBytes ?? 0 });
    if (options.start !== undefined) request.startPosition = options.start;
    if (options.end !== undefined) request.endPosition = options.end;
    const call = this.stub.exportKv(request, this.metadata(), { deadline: this.deadline(options.timeoutSeconds) });
    // The loop below reports errors; this keeps one that comes after it stopped (the
    // cancel in `finally`) from being an unhandled 'error' event.
    call.on("error", () => {});
    try {
      for await (const message of call as AsyncIterable<ExportKvResponse>) yield message;
    } catch (error) {
      throw toExecutorError(error);
    } finally {
      call.cancel(); // a no-op once the stream has ended
    }
  }

  /**
   * Creates a cache from the messages of an ExportKv stream: another client's `exportKv`
   * (streamed through as it arrives, with flow control) or messages kept in an array.
   * `cacheId` names the cache to create (default: server-chosen); a stream that starts
   * past position 0 extends that cache instead. All or nothing on the server. When the
   * messages fail (e.g. the export's own error) the import is cancelled and that error
   * rejects; when the import fails first, it rejects at once and the messages' iterator
   * is closed when its next message comes (which cancels an export).
   */
  importKv(
    messages: AsyncIterable<ExportKvResponse> | Iterable<ExportKvResponse>,
    cacheId?: string,
    options: { timeoutSeconds?: number } = {},
  ): Promise<ImportKvResponse> {
    return new Promise((resolve, reject) => {
      let settled = false;
      let wake: (() => void) | undefined;
      const call = this.stub.importKv(this.metadata(), { deadline: this.deadline(options.timeoutSeconds) },
        (error, response) => {
          settled = true;
          wake?.();
          if (error) reject(toExecutorError(error));
          else resolve(response);
        });
      call.on("error", () => {}); // the callback reports the call's errors
      call.on("drain", () => wake?.());
      const pump = async (): Promise<void> => {
        for await (const message of messages) {
          if (settled) break; // closes the messages' iterator
          if (!call.write(importKvRequest(message, cacheId)) && !settled) {
            await new Promise<void>((resume) => (wake = resume));
            wake = undefined;
          }
        }
        if (!settled) call.end();
      };
      pump().catch((error: unknown) => {
        settled = true;
        reject(toExecutorError(error));
        call.cancel();
      });
    });
  }

  /** The caller's live caches, in creation order: all of them, or those of `cacheIds` that are live. */
  listCaches(cacheIds: string[] = []): Promise<ListCachesResponse> {
    return this.unary(this.stub.listCaches, ListCachesRequest.create({ cacheIds }));
  }

  close(): void {
    this.stub.close();
  }

  private metadata(): Metadata {
    const metadata = new Metadata();
    if (this.token) metadata.set("authorization", `Bearer ${this.token}`);
    return metadata;
  }

  private deadline(timeoutSeconds?: number): Date {
    return new Date(Date.now() + (timeoutSeconds !== undefined ? timeoutSeconds * 1000 : this.timeoutMs));
  }

  private unary<Req, Res>(method: Unary<Req, Res>, request: Req): Promise<Res> {
    return new Promise((resolve, reject) => {
      method.call(this.stub, request, this.metadata(), { deadline: this.deadline() }, (error, response) => {
        if (error) reject(toExecutorError(error));
        else resolve(response);
      });
    });
  }
}
