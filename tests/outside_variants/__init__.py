"""Variants written outside src/: a package, with its config folder (conf/) for Hydra's search path."""
