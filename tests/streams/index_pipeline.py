"""The index pipeline tests' helpers: they live with the attack benchmarks that use them too."""

from benchmarks._attack import *  # noqa: F403
from benchmarks._attack import __all__  # noqa: F401
