"""Training: tasks on a frozen encoder with AoT P-Tuning and the baseline methods.

Importing any part of the package fills the method registry (training.method_registry): every method of
training.methods registers itself as it is imported, so a task artifact naming a method can always be read.
"""

import training.methods  # noqa: F401  (registration)
