"""SAS block-sparse decode attention for SGLang."""
__version__ = "0.1.0"
