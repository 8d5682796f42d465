"""dtf: configuration-driven distributed training for PyTorch on Hydra."""

__version__ = "0.1.0"


# The Python API (dtf.api; dtf.evaluate and dtf.report beside it), imported on first use: ranks and the
# command line import this package and must not pay for composing machinery they do not use.
_API = {
    "run": "dtf.api",
    "run_function": "dtf.api",
    "sweep": "dtf.api",
    "validate": "dtf.api",
    "evaluate": "dtf.eval",
    "report": "dtf.train.function",  # dtf.report(name, total, count), from inside a training function
    "RunStopped": "dtf.api",
    "UserError": "dtf.errors",
}
__all__ = ["RunStopped", "UserError", "__version__", "evaluate", "report", "run", "run_function", "sweep", "validate"]


def __getattr__(name: str) -> object:
    import importlib

    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'dtf' has no attribute {name!r}")
