"""Training: one job of many tasks against one run per task.

    many       `aot bench train-many`: `aot train --tasks` against one `aot train` per task (or torchrun ranks),
               each a fresh process: wall times, dev scores, memory peaks, load averages
"""
