"""Executors: the ModelExecutor interface and its implementations. No gRPC here."""
