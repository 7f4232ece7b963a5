"""`python -m src.run --help` (and `replay-rloo --help`): what a newcomer needs, read from conf/.

Hydra's own help page prints the whole composed config (the prompt template included) and lists
`sweep` as if it were a plain group. This page lists instead each config group with its options
and one line each (the start of the option's YAML comment), the default marked; the
studies (`+sweep=<name>`, which add to the config, hence the `+`); and the commands a newcomer
runs first. Hydra's page stays reachable with `--hydra-help`, the composed config with `--cfg job`.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from src.paths import CONFIG_DIR

# Groups that are not choices of a training run: studies get their own section, `local` holds a
# site's git-ignored cluster settings, `ziprc` belongs to `python -m src.ziprc`.
NOT_RUN_GROUPS = ("sweep", "local", "ziprc")
LINE_WIDTH = 120  # long descriptions are cut with an ellipsis

FIRST_COMMANDS = [
    ("python -m src.run", "one run: the tiny CPU policy, fresh-only RLOO, evaluated before and after"),
    ("python -m src.run buffer=age2 clip=tight", "one Replay-RLOO cell (rho=1, L=2, c=1); any key: buffer.ratio=2"),
    ("make sweep-ratio DRY_RUN=1", "a study's plan (python -m src.run -m +sweep=ratio runs it)"),
    ("make report SWEEP=ratio", "tables (markdown, CSV, LaTeX) and figures (PNG, PDF) into reports/ratio/"),
    ("make ui PORT=5001", "the MLflow UI on this project's runs; prints its URL"),
]


def describe(option_file: Path) -> str:
    """The option's description: its YAML file's leading comment, without Hydra's `@package` header."""
    lines = []
    for line in option_file.read_text().splitlines():
        text = line.strip()
        if not text.startswith("#"):
            break  # the comment block is over
        text = text.lstrip("#").strip()
        if text and not text.startswith("@package"):
            lines.append(text)
    return " ".join(lines)  # the display cuts it to one line


def distinguishing_values(option_files: list[Path]) -> dict[str, str]:
    """Per option, the top-level values that differ between a group's options (clip: `ceiling=10`)."""
    loaded = {path.stem: OmegaConf.to_container(OmegaConf.load(path)) for path in option_files}
    keys = {key for values in loaded.values() for key, value in values.items()
            if key != "name" and not isinstance(value, (dict, list))}
    differing = sorted(key for key in keys if len({str(values.get(key)) for values in loaded.values()}) > 1)
    return {stem: " ".join(f"{key}={values[key]}" for key in differing if key in values)
            for stem, values in loaded.items()}


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def group_defaults(config_dir: Path = CONFIG_DIR) -> dict[str, str]:
    """The option each group takes by default, from config.yaml's defaults list."""
    defaults = {}
    for entry in OmegaConf.to_container(OmegaConf.load(config_dir / "config.yaml"))["defaults"]:
        if isinstance(entry, dict):
            for group, option in entry.items():
                if not group.startswith("override "):
                    defaults[group] = str(option)
    return defaults


def options(folder: Path) -> list[Path]:
    """A config group's options: its YAML files, except `base.yaml`, which its options share (not one itself)."""
    return sorted(path for path in folder.glob("*.yaml") if path.stem != "base")


def groups(config_dir: Path = CONFIG_DIR) -> dict[str, list[tuple[str, str]]]:
    """Each run config group with its options and their one-line descriptions, in folder order."""
    found = {}
    for folder in sorted(path for path in config_dir.iterdir() if path.is_dir()):
        found_options = options(folder)
        if folder.name in NOT_RUN_GROUPS or not found_options:
            continue
        described = {path.stem: describe(path) for path in found_options}
        values = distinguishing_values(found_options)
        alike = len(set(described.values())) < len(described)  # the comment alone does not tell them apart
        found[folder.name] = [(stem, f"[{values[stem]}] {what}" if alike and values[stem] else what)
                              for stem, what in described.items()]
    return found


def studies(config_dir: Path = CONFIG_DIR) -> list[tuple[str, str]]:
    return [(path.stem, describe(path)) for path in sorted((config_dir / "sweep").glob("*.yaml"))]


def help_text(config_dir: Path = CONFIG_DIR) -> str:
    defaults = group_defaults(config_dir)
    out = ["replay-rloo: rollout reuse in verifier-based LLM RL (Hydra app; also `python -m src.run`)", "",
           "usage: python -m src.run [-m] [GROUP=OPTION ...] [KEY=VALUE ...] [+sweep=STUDY]", "",
           "First commands:"]
    width = max(len(command) for command, _ in FIRST_COMMANDS)
    out += [f"  {command:<{width}}  {what}" for command, what in FIRST_COMMANDS]
    out += ["", "Config groups (GROUP=OPTION; * marks the default):"]
    for group, options in groups(config_dir).items():
        out.append(f"  {group}/")
        name_width = max(len(name) for name, _ in options) + 2
        for name, what in options:
            mark = "*" if defaults.get(group) == name else " "
            out.append(_shorten(f"    {mark}{name:<{name_width}}{what}", LINE_WIDTH))
    out += ["", "Studies (add with +sweep=STUDY and -m; `make sweep-STUDY` does both):"]
    found = studies(config_dir)
    name_width = max((len(name) for name, _ in found), default=0) + 2
    out += [_shorten(f"    {name:<{name_width}}{what}", LINE_WIDTH) for name, what in found]
    out += ["", "More:",
            "  KEY=VALUE sets any knob (trainer.steps=50, buffer.ratio=2); a mistyped key is refused with the",
            "  close matches. --cfg job prints the composed config, --hydra-help Hydra's own options,",
            "  python -m src.eval --help evaluates saved policies. README.md explains every group."]
    return "\n".join(out) + "\n"


def wants_help(argv: list[str]) -> bool:
    return any(arg in ("--help", "-h") for arg in argv)
