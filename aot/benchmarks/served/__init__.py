"""End to end through the real local tritonserver: `aot bench serve` and the benches that compare what it serves.

    serve     `aot bench serve`: memory and latency with N tasks, AoT against the vanilla ensemble; its closed loop
              and texts are what every served bench drives a server with
    kinds     `aot bench kinds`: tasks of mixed kinds against classifiers on one server
    infinity  `aot bench infinity`: `aot serve` against Infinity on the same texts
    fleet     the local fleet's figures (`python -m aot.benchmarks.served.fleet`, docs/deploy-fleet.md)
"""
