"""Calling a served repository over gRPC with a task id (`from aot import Client`): no torch, no training code.

    client      Client: infer, infer_many (infer_stream: the same answers in order as they come), embed, tasks
    batch       one infer_many call: packs, answers in input order, retries within one window, its stats
    pacing      how hard a call presses the server: requests in flight, texts per request, when to send next
    retry       the transport: gRPC channel options, which failures are sent again, the waits between tries
    errors      InferenceError and its classes (TaskNotFound, InvalidInput, TaskUnavailable, Unavailable,
                PermissionDenied): what a failed request tells its caller
"""
