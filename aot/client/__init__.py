"""Calling a served repository over gRPC with a task id (`from aot import Client`): no torch, no training code.

    client      Client: infer, infer_many, embed, tasks; retries of what a retry can fix
    retry       the transport: gRPC channel options, which failures found no server, the waits between tries
    errors      InferenceError and its classes (TaskNotFound, InvalidInput, TaskUnavailable, Unavailable,
                PermissionDenied): what a failed request tells its caller
"""
