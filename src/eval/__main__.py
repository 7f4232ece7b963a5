"""`python -m src.eval`: evaluate a trained policy on the held-out prompts (src/eval/standalone.py); the command
line is checked first, before torch and MLflow load (src/eval/command.py)."""

import sys

from src.eval.command import check_before_imports

check_before_imports(sys.argv[1:])

from src.eval.standalone import main  # noqa: E402  (after the checks: it loads torch and MLflow)

raise SystemExit(main())
