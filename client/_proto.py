"""The generated protobuf messages and gRPC stubs of modelexec.v1, wherever they live.

In the checkout they are the top-level `generated` package beside `client/`; in the
installed `modelexec-client` distribution (pyproject.toml) they ship inside it, as
`modelexec_client.proto`, so that the installed client owns no generic top-level name.
"""

if __package__ == "client":  # the checkout
    from generated.modelexec.v1 import executor_pb2, executor_pb2_grpc
else:  # installed as modelexec_client
    from .proto import executor_pb2, executor_pb2_grpc

__all__ = ["executor_pb2", "executor_pb2_grpc"]
