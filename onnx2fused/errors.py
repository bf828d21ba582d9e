"""Errors the user sees as one line on stderr with exit code 2."""


class ConversionError(Exception):
    """Bad or unsupported input, or a failed build/validation: the message is the whole story."""


class BuildError(ConversionError):
    """A compiler failed; the message names the log file that holds its output."""


class ValidationError(ConversionError):
    """The fused model's outputs differ from stock ONNX Runtime beyond the precision's tolerance."""
