"""The Triton python models an export copies into a repository (aot.exporter.configs writes their configs): thin
adapters over aot.serving, one folder per served model with `1/model.py` (initialize / execute / finalize).

    fused       `aot` and `vanilla` of the CPU configs and of the torch engine's GPU configs: tokenize, look up,
                encode and answer a whole batch in one process
    tokenizer   the native GPU ensembles' first step: text -> token ids
    backbone    the encoder as a step of its own, with the AoT lookup inside (ONNX Runtime on CPU, the torch
                engine): what the separate-steps ensembles chain; on a GPU the native ensembles run the graph
                in Triton's own ONNX Runtime or TensorRT backend instead
    aot_lookup  the native GPU ensemble's lookup: token ids + task version -> rows of P
    head        the native GPU ensembles' last step: each request's task head and answer
    task_list   `aot tasks`: what the server serves
"""
