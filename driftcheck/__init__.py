"""driftcheck: does the model compute the same numbers on the new accelerator?"""
from driftcheck.errors import DriftcheckError, TraceError
from driftcheck.scenario import Scenario

__version__ = "0.1.0"

__all__ = ["DriftcheckError", "Scenario", "TraceError", "trace", "__version__"]


def __getattr__(name: str):  # lazy: `import driftcheck` stays cheap and torch_tpu-free
    if name == "trace":
        from driftcheck.tracer import trace

        return trace
    raise AttributeError(name)
