"""`aot bench overhead`: the paper's inference-overhead comparison (section 4.4, Figure 3), every method timed as the
computation a server would run on one shared encoder, no server around it.

    comparison          the run: every method side by side in rotating rounds, its ratios to vanilla and reports
    cases               what both engines share: the configuration, the models, the cases, the Method interface,
                        the rotating timer
    torch_engine        the methods in PyTorch (`--engine torch`, the default)
    onnxruntime_engine  vanilla and AoT through the exported graphs a server runs (`--engine onnxruntime`)
"""
