"""Files that run inside the code sandbox (vlrft/isolation/sandbox.py binds this directory,
read-only, into it). Standard library only: nothing of vlrft or the trainer's environment is
there. `run_program.py` runs a model-written program; `run_tests.py` is the harness that runs
a row's tests against it from a separate sandbox; `plain_values.py` is the value format they
exchange; `child_limits.py` sets each one's resource limits."""
