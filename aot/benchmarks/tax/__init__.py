"""`aot bench tax`: the serving tax, the CPU every server process spends per request beyond the engine's.

    onnx_engine   `--engine onnx` (the default): the exported graphs alone against the served ones, by process; how
                  a server's processes and their CPU time are read from /proc
    torch_engine  `--engine torch`: the GPU configs' request path (the fused step) on this CPU with a negligible
                  encoder, by process
    torch_report  its reports (tax-torch.json / .md, issue 52's targets for this machine)
"""
