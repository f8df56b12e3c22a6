import os

# Tests run on the CPU unless a GPU test asks otherwise; keep XLA single-threaded
# enough to be predictable on the 2-core CI machine.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
