"""The Triton python models an export copies into a repository (aot.exporter.configs writes their configs): thin
adapters over aot.serving, one folder per served model with `1/model.py` (initialize / execute / finalize).

    fused       the CPU configs' one step: tokenize, look up, encode and answer a whole batch in one process
    tokenizer   the GPU ensembles' first step: text -> token ids
    backbone    the GPU ensembles' encoder (ONNX Runtime or the torch engine), with the AoT lookup
    aot_lookup  the native GPU ensemble's lookup: token ids + task version -> rows of P
    head        the GPU ensembles' last step: each request's task head and answer
    task_list   `aot tasks`: what the server serves
"""
