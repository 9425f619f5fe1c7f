"""The one error of HF checkpoint interop, apart from trainer/hf.py so that its helper modules (hf_rope) raise it
without importing hf.py, which imports them."""


class HFFormatError(ValueError):
    """An HF directory or config cannot be mapped onto our model; the message names the field."""
