import os
import sys

# Tests run on CPU; keep XLA quiet and deterministic.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))
