"""The grpc.aio server hosting one executor: handlers, conversion, errors, health, reflection."""
