"""Training: tasks on a frozen encoder with AoT P-Tuning and the baseline methods.

Importing any part of the package fills the method registry (method_registry): every method of methods registers
itself as it is imported, so a task artifact naming a method can always be read.

    api              train_task: data, model, trainer and artifact in one call (`aot train`)
    data             task data: built-in real data sets, plain folders, GLUE and SuperGLUE folders
    kinds            per kind of task: tensors, loss, predictions, score, answers
    method_registry  the methods by name (MethodSpec), filled by methods as they are imported
    methods          AoT P-Tuning (FC, Kronecker), adapters, PEFT baselines, fine-tuning
    backbone         the frozen encoder: resolving a name or folder, loading it and its tokenizer
    model            the task model: encoder, method body, head and loss
    factory          a method's task model built by name, and a saved one loaded
    trainer          the training loop, a step at a time (TaskRun)
    job              many tasks trained in one job on one encoder (`aot train --tasks`, train_tasks)
    job_spec         a job's task specs checked, over the job's defaults
    job_prepare      a job's tasks checked before anything trains: refused alone, or kept from an earlier run
    job_state        a job's records and checkpoints beside its artifacts (resuming)
    mixed_step       one step of several tasks in shared passes of the encoder
    task_random      each task's random numbers its own in a shared pass
    sharding         a job's tasks shared out among torchrun ranks or indexed shards
    metrics          the scores of each metric
    artifact         the task artifact: a trained task's folder, written atomically
    predict          `aot predict`: a task artifact answering texts in PyTorch
    multitask        MultiTaskModel: AoT tasks sharing batches on one encoder
    pair_collator    PairCollator: text pairs into batches
    evaluate         `aot evaluate`: a task scored on a labelled file
    inspect          `aot inspect`: the tokens with the largest bias per layer
    quantized        the int8 backbone as the CPU configs run it, in PyTorch
    refit            `aot train --fit-to`: a task re-fitted to a repository's int8 backbone
"""

import aot.training.methods  # noqa: F401  (registration)
