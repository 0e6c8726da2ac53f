"""Accuracy: the paper's protocol (`aot bench accuracy`), and what an int8 backbone costs each task.

    sweep      `aot bench accuracy`: a grid per (data set, method), its best point retrained over seeds, resumable run
               by run
    plan       what a sweep runs: its configuration, its grids, its runs and their ids, a run's record
    report     its reports: accuracy.md, accuracy.png, accuracy-curves.png
    int8       what an int8 backbone costs each task, and what re-fitting wins back
               (`python -m aot.benchmarks.accuracy.int8`)
    int8_data  the regression and pair data sets it trains on (`python -m aot.benchmarks.accuracy.int8_data`)
"""
