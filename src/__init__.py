"""Replay-RLOO: rollout reuse in verifier-based RL. Every entry point is `python -m src.<module>`."""

import importlib.util as _util
import sys as _sys

# A bare `python` (not the venv's) would fail at its first import with a traceback: one line instead.
_MISSING = [name for name in ("omegaconf", "hydra") if _util.find_spec(name) is None]
if _MISSING:
    _sys.stderr.write(f"error: {_sys.executable} lacks this project's packages ({', '.join(_MISSING)}): run it "
                      "with .venv/bin/python (make install builds it), or enter the venv first: "
                      "source .venv/bin/activate\n")
    raise SystemExit(2)
