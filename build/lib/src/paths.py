"""Fixed locations inside the project, so commands work from any working directory."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = PROJECT_ROOT / "conf"


def resolve_policy_path(name_or_path: str) -> str:
    """A hub name stays as it is; a relative folder is looked up from the project root."""
    candidate = Path(name_or_path)
    if not candidate.is_absolute() and (PROJECT_ROOT / candidate).exists():
        return str(PROJECT_ROOT / candidate)
    return name_or_path
