"""Errors a user can act on.

Every failure caused by input (a file, a flag, a request) raises a subclass of `LuceboxError` whose
message says what is wrong and where; the CLI prints it as one `error: ...` line and exits with 2.
"""


class LuceboxError(Exception):
    """A failure the user can fix; the message is shown as is, without a traceback."""


class GGUFError(LuceboxError):
    """A GGUF file is malformed or does not fit what is asked of it.

    The message always names the file and, where there is one, the metadata key or tensor at fault.
    Raised for: bad magic, a truncated or inconsistent header, tensor data beyond the end of the file,
    an unknown architecture, an unsupported tensor type, a missing or mis-shaped tensor, and a metadata
    value of the wrong type.
    """


class PluginError(LuceboxError):
    """No installed plugin provides what was asked (a model family, backend, drafter...)."""


class TemplateError(LuceboxError):
    """A chat template failed to render, or tried to reach outside its sandbox."""
