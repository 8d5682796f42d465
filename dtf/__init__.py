"""dtf: configuration-driven distributed training for PyTorch on Hydra."""

__version__ = "0.1.0"


# The Python API (dtf.api), imported on first use: ranks and the command line import this package
# and must not pay for composing machinery they do not use.
_API = {
    "run": "dtf.api",
    "run_function": "dtf.api",
    "sweep": "dtf.api",
    "validate": "dtf.api",
    "evaluate": "dtf.eval",
    "RunStopped": "dtf.api",
    "UserError": "dtf.errors",
}
__all__ = ["RunStopped", "UserError", "__version__", "evaluate", "report", "run", "run_function", "sweep", "validate"]


def __getattr__(name: str) -> object:
    import importlib

    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    if name == "report":  # dtf.report(name, total, count): the module dtf.report is callable (its end says why)
        return importlib.import_module("dtf.report")
    raise AttributeError(f"module 'dtf' has no attribute {name!r}")
