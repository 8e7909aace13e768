"""driftcheck: does the model compute the same numbers on the new accelerator?"""
from driftcheck.errors import DriftcheckError, TraceError
from driftcheck.scenario import Scenario
from driftcheck.version import __version__

__all__ = ["DriftcheckError", "Scenario", "TraceError", "__version__", "trace"]


def __getattr__(name: str):  # lazy: `import driftcheck` stays cheap and torch_tpu-free
    if name == "trace":
        from driftcheck.record.tracer import trace

        return trace
    raise AttributeError(name)
