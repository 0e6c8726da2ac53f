"""The torch engine: the serving floor's backbone in PyTorch, for a repository exported with `--format torch`.

It builds on aot.serving (numpy only) and adds torch and transformers, which only the torch backbone step imports;
training builds on it in turn (the biased encoder is one class, so the served step adds exactly what training
added).

    encoder     the frozen encoder with P^i[x] added before every layer (BiasedEncoder), and loading it
    engine      the served backbone: bias gather + add + encoder on CPU or CUDA (fp16, CUDA graphs per bucket),
                with the task pool's rows in device memory; importing it registers the engine `torch` with the
                serving floor (aot.serving.engine), which never imports this package
    heads       the device heads: the served tasks' pooled heads in device memory, run inside the engine's forward
"""
