"""eagle-chat's core. Importing it sets the CPU threading policy before torch loads (see
core/threads.py: idle OpenMP threads sleep instead of spinning, which keeps a busy machine
from collapsing a generation)."""

from core import threads as _threads  # noqa: F401
