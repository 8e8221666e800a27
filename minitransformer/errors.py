"""The one exception type of the loader: a checkpoint that is missing, malformed, or
inconsistent with its config. It subclasses ValueError so callers can catch either."""


class CheckpointError(ValueError):
    """A checkpoint file or field is missing, malformed, or disagrees with config.json."""
