"""`python -m src.run --help` (and `replay-rloo --help`): what a newcomer needs, read from conf/.

Hydra's own help page prints the whole composed config (the prompt template included) and lists
`sweep` as if it were a plain group. This page lists instead each config group with its options
and one line each (the start of the option's YAML comment), the default marked; the
studies (`+sweep=<name>`, which add to the config, hence the `+`); and the commands a newcomer
runs first. Hydra's page stays reachable with `--hydra-help`, the composed config with `--cfg job`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from omegaconf import OmegaConf

from src.paths import CONFIG_DIR
from src.validate.schema import group_defaults

# Groups that are not choices of a training run: studies get their own section, `local` holds a
# site's git-ignored cluster settings, `ziprc` belongs to `python -m src.ziprc`, `experiment` holds the
# papers' settings and `reproduce` their claims in miniature (a line under More: points at docs/reproductions.md).
NOT_RUN_GROUPS = ("sweep", "local", "ziprc", "experiment", "reproduce")
LINE_WIDTH = 120  # long descriptions are cut with an ellipsis

FIRST_COMMANDS = [
    ("python -m src.run trainer=smoke", "checks an install end to end in under a minute (2 steps, 4 evaluation samples)"),
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
            "  KEY=VALUE sets any knob (trainer.steps=50, buffer.ratio=2); a mistyped key or option (clip=tigth)",
            "  is refused with the close matches. --cfg job prints the composed config, --hydra-help Hydra's own options,",
            "  +experiment=seed001-async (-tiny: on the CPU) sets a paper's experiment (docs/reproductions.md);",
            "  make reproduce-seed000 (... seed004) tests a paper's claim in miniature, over training seeds;",
            "  python -m src.eval --help evaluates saved policies; docs/configuration.md and docs/knobs.md explain it all."]
    return "\n".join(out) + "\n"


def wants_help(argv: list[str]) -> bool:
    return any(arg in ("--help", "-h") for arg in argv)


def wants_version(argv: list[str]) -> bool:
    return "--version" in argv


# --------------------------------------------------------------------------- the knob reference (docs/knobs.md)
KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w-]*):(?P<rest>.*)$")


def yaml_comments(path: Path, prefix: str) -> dict[str, str]:
    """Each dotted key of a YAML file with the comment on its line (`key: value  # what it is`)."""
    found, stack, last = {}, [], None  # stack: (indent, key) of the enclosing mappings
    for line in path.read_text().splitlines():
        match = KEY_LINE.match(line)
        if line.lstrip().startswith("#"):
            if last and found[last] and line.index("#") > 0:  # an indented comment line continues the key's
                found[last] += " " + line.split("#", 1)[1].strip()
            continue
        last = None
        if not match:
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        comment = match["rest"].split(" #", 1)[1].strip() if " #" in match["rest"] else ""
        last = prefix + ".".join(key for _, key in stack)
        found[last] = comment
    return found


def knob_sources(config_dir: Path = CONFIG_DIR) -> dict[str, dict[str, tuple[object, str]]]:
    """key -> {option file: (its value, its comment)} over every run group's options (as src.validate.schema reads them)."""
    from src.validate.schema import _leaves

    sources: dict[str, dict[str, tuple[object, str]]] = {}
    for path in sorted(config_dir.rglob("*.yaml")):
        relative = path.relative_to(config_dir)
        if relative.parts[0] in ("sweep", "local", "hydra", "experiment", "reproduce") or relative.name == "ziprc_main.yaml":
            continue  # studies, site settings, Hydra's own groups and the papers' experiments (docs/reproductions.md,
            # which set the groups' keys); ZIP-RC's entry config has its own page
        text = path.read_text()
        top = len(relative.parts) == 1 or "@package _global_" in text.split("\n", 1)[0]
        prefix = "" if top else f"{relative.parts[0]}."
        tree = {key: value for key, value in (OmegaConf.to_container(OmegaConf.load(path)) or {}).items()
                if key not in ("defaults", "hydra")}
        comments = yaml_comments(path, prefix)
        for key, value in _leaves(tree, prefix).items():
            option = path.stem if len(relative.parts) == 1 else f"{relative.parts[0]}/{path.stem}"
            sources.setdefault(key, {})[option] = (value, comments.get(key, ""))
    return sources


def _value(value: object) -> str:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return _shorten(" ".join(text.split()), 40).replace("|", "\\|")


def component_knobs(config_dir: Path = CONFIG_DIR) -> dict:
    """key -> Knob declared by the classes the variant groups' options name (the first option's, by file name)."""
    from src.variant import VARIANT_GROUPS, described

    found = {}
    for group in VARIANT_GROUPS:
        for path in sorted((config_dir / group).glob("*.yaml")):
            node = OmegaConf.load(path)
            if "_target_" in node:
                for name, knob in described(node).knobs.items():
                    found.setdefault(f"{group}.{name}", knob)
    return found


def _knob(key: str, components: dict):
    from src.validate.schema import KNOBS, LIST_KNOBS

    return KNOBS.get(key) or components.get(key) or (LIST_KNOBS[key][0] if key in LIST_KNOBS else None)


def _range(key: str, components: dict) -> str:
    from src.validate.schema import LIST_KNOBS

    knob = _knob(key, components)
    if knob is None:
        return ""
    if knob.kind not in ("int", "float"):
        return knob.kind + (" or null" if knob.nullable else "")
    low = "(-inf" if knob.low == -math.inf else ("(" if knob.low_open else "[") + f"{knob.low:g}"
    high = "inf)" if knob.high == math.inf else f"{knob.high:g}" + (")" if knob.high_open else "]")
    kind = f"list of {knob.kind}" if key in LIST_KNOBS else knob.kind
    return f"{kind} {low}, {high}" + (" or null" if knob.nullable else "")


def knob_reference(config_dir: Path = CONFIG_DIR) -> str:
    """docs/knobs.md: every knob a config group sets, its values per option, its checked range, its comment."""
    sources, components = knob_sources(config_dir), component_knobs(config_dir)
    out = ["# Every knob", "",
           "Every key a config group sets, by group: the value each option gives it (`option: value`, or one value",
           "when every option that sets it agrees), the range `src/validate/schema.py` checks, and the comment on its line",
           "in `conf/`. Set any of them on the command line: `python -m src.run trainer.steps=50 buffer.ratio=2`;",
           "`python -m src.run --cfg job` prints the composed values. Written by `python -m src.help --knobs`;",
           "`tests/commands/test_commands.py` checks that it lists every knob.", ""]
    for group in sorted({key.split(".", 1)[0] for key in sources}):
        out += [f"## {group}", "", "| knob | value | checked | what it sets |", "| --- | --- | --- | --- |"]
        for key in sorted(k for k in sources if k.split(".", 1)[0] == group):
            by_option = sources[key]
            values = {_value(value) for value, _ in by_option.values()}
            if all(str(value) == option.split("/")[-1] for option, (value, _) in by_option.items()):
                values = {"the option's name"}
            shown = values.pop() if len(values) == 1 else ", ".join(
                f"{option.split('/')[-1]}: {_value(value)}" for option, (value, _) in by_option.items())
            knob = _knob(key, components)
            what = next((comment for _, comment in by_option.values() if comment), knob.why if knob else "")
            out.append(f"| `{key}` | {shown} | {_range(key, components)} | {what.replace('|', chr(92) + '|')} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    import sys

    usage = "usage: python -m src.help --knobs   (writes the knob reference, docs/knobs.md, to stdout)\n"
    if sys.argv[1:] in (["--help"], ["-h"], ["--version"]):
        from src.paths import project_version

        sys.stdout.write(usage if "--version" not in sys.argv else f"replay-rloo {project_version()}\n")
        sys.exit(0)
    if sys.argv[1:] != ["--knobs"]:
        sys.exit(usage.strip())
    sys.stdout.write(knob_reference())
