"""Skip markers shared by test files, each saying what is missing."""

import pytest

from vlrft.isolation.sandbox import isolation_problem

# Running model-written code needs the bubblewrap sandbox (.ci/run installs it); without it
# code recipes refuse to run, which test_code_recipe.py tests.
needs_sandbox = pytest.mark.skipif(isolation_problem() is not None,
                                   reason=f"no OS sandbox here: {isolation_problem()} (apt install bubblewrap)")
