"""Servers started on this machine, without Docker: what `aot serve` runs, and what the tests and benchmarks start.

    server       LocalServer: the nvidia-pytriton wheel's tritonserver under a supervisor, its health port
    triton_setup what that binary needs before it starts: its backends folder, the steps' Python, libpython
    fleet        `aot serve --replicas N`: N servers on one repository behind HAProxy
    s3_server    a local S3-compatible store (SeaweedFS's `weed`) for a task store in object storage
    processes    stopping a helper's process group (HAProxy, SeaweedFS): SIGTERM, then SIGKILL
"""
