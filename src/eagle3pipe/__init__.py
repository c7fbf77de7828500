"""eagle3pipe: a declarative, content-addressed pipeline for EAGLE-3 draft models."""
__version__ = "0.1.0"
