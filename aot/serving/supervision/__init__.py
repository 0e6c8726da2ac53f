"""The supervision of a running tritonserver: started, watched, repaired, stopped, and honest about readiness. It
imports nothing of the task store (its /ready check of the store is handed in: aot/serving/__main__.py).

    main            the container's entry point: the server under a supervisor, its control API closed
    lifecycle       one tritonserver from start to reaped (the container and aot.local.server.LocalServer)
    quiesce         a graceful stop's end: new requests refused, the accepted finished, no open connection holding it
    connections     a stopping server's open HTTP connections, closed by its supervisor
    sweeper         a server's stubs end with it: reaped by its owner, or by a sweeper process when the owner was killed
    supervisor      the Supervisor: dead, stopped, hung or grown python steps found and repaired
    health          /ready and /live on the health port
    probes          liveness probes of the python steps, and the verdict "hung"
    reloads         bringing a broken step back through the repository API
    instance_groups replacing one instance of a step while its siblings serve
    procfs          what /proc says of the server's processes and its python-backend stubs
    triton_api      the supervisor's calls to tritonserver's HTTP API, with the admin key
    admin_key       the deployment's admin key: the control API closed to clients
"""
