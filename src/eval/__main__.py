"""`python -m src.eval`: evaluate a trained policy on the held-out prompts (src/eval/standalone.py)."""

from src.eval.standalone import main

raise SystemExit(main())
