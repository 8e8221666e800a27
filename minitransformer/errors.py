"""The library's own exception types: a checkpoint it cannot read, and a setting it does not
know. Both subclass ValueError so callers can catch either."""


class CheckpointError(ValueError):
    """A checkpoint file or field is missing, malformed, or disagrees with config.json."""


class SettingError(ValueError):
    """An MT_* environment variable read at import (MT_BACKEND, MT_PRODUCTS, MT_LAYOUT) has a
    value the library does not know, or one this machine cannot run (MT_BACKEND=cupy without
    CuPy). Its message is one line naming the variable, the value and the values allowed;
    the command line and the scripts print it as their error line (exit status 2)."""
