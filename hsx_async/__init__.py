"""hsx: turn a running SGLang server into a hidden-state dataset for EAGLE-3 training."""

__version__ = "0.1.0"
