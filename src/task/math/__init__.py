"""Competition math (`task=math`, SPEC 12): data.py (files and presets), generate.py (the built-in set),
verify.py (extraction and the bounded math-verify verifier, worker.py its process), failures.py (the
categories), task.py (`MathTask`, the task interface)."""

from src.task.math.task import MathTask

__all__ = ["MathTask"]
