// A small promise-based client for modelexec.v1 over @grpc/grpc-js, on top of the code
// that ts-proto generates from ../../protos into src/gen/ (`npm run generate`).
import { credentials, Metadata, type ChannelCredentials, type ServiceError, status } from "@grpc/grpc-js";

import {
  type DecodeInput,
  DecodeRequest,
  type DecodeResponse,
  GetInfoRequest,
  type GetInfoResponse,
  GetStatusRequest,
  type GetStatusResponse,
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

/** A failed call: the gRPC status code, its name and the server's message. */
export class ExecutorError extends Error {
  constructor(
    readonly code: status,
    readonly codeName: string,
    readonly details: string,
  ) {
    super(`${codeName}: ${details}`);
    this.name = "ExecutorError";
  }
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

  /** Runs a prompt (or the next chunk of one). Without `kvCache` the server creates a cache. */
  prefill(input: Partial<PrefillInput>): Promise<PrefillResponse> {
    return this.unary(this.stub.prefill, PrefillRequest.fromPartial({ input }));
  }

  /** Appends `input.tokenId` to the cache `input.kvCache` (the handle the last call returned). */
  decode(input: Partial<DecodeInput>): Promise<DecodeResponse> {
    return this.unary(this.stub.decode, DecodeRequest.fromPartial({ input }));
  }

  /** Frees a cache; idempotent (`released` is false the second time). */
  releaseCache(cacheId: string): Promise<ReleaseCacheResponse> {
    return this.unary(this.stub.releaseCache, ReleaseCacheRequest.create({ cacheId }));
  }

  close(): void {
    this.stub.close();
  }

  private unary<Req, Res>(method: Unary<Req, Res>, request: Req): Promise<Res> {
    const metadata = new Metadata();
    if (this.token) metadata.set("authorization", `Bearer ${this.token}`);
    const deadline = new Date(Date.now() + this.timeoutMs);
    return new Promise((resolve, reject) => {
      method.call(this.stub, request, metadata, { deadline }, (error, response) => {
        if (error) reject(new ExecutorError(error.code, status[error.code] ?? String(error.code), error.details));
        else resolve(response);
      });
    });
  }
}
