"""The results table for a paper: LaTeX `booktabs`, sized to fit one column of a two-column page.

The table keeps what a reader compares (the cell, its fresh-evaluation budget, pass@1, the largest-k
pass@k and the reward, each `mean ± half-width`); the full table is the CSV and report.md. Its width is
estimated from Computer Modern glyph widths (matplotlib's mathtext with the `cm` font set, the fonts
LaTeX uses) at `\\small` (9 pt) plus the column padding, so no LaTeX install is needed. A table wider than
one column becomes a `table*` (both columns) instead of overflowing.
"""

from __future__ import annotations

import re

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.font_manager import FontProperties
from matplotlib.mathtext import MathTextParser

from analysis.tables import format_count, k_label

COLUMN_WIDTH_PT = 241.0  # \columnwidth of a common two-column layout (IEEE, ACM: 241 pt)
FONT_SIZE_PT = 9.0  # \small in a 10 pt document
TABCOLSEP_PT = 4.0  # the table sets \tabcolsep to this: each column gets it on both sides
# LaTeX for the characters the tables use: escapes first, then the Unicode symbols as math.
LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                 "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
LATEX_SYMBOLS = {"±": r"$\pm$", "ρ": r"$\rho$", "≥": r"$\geq$", "δ": r"$\delta$", "τ": r"$\tau$", "×": r"$\times$"}


def latex_escape(text: str) -> str:
    """Cell text as LaTeX: special characters escaped, `code` as \\texttt, ± ρ ≥ as math."""
    out = "".join(LATEX_ESCAPES.get(char, char) for char in str(text))
    for symbol, latex in LATEX_SYMBOLS.items():
        out = out.replace(symbol, latex)
    return re.sub(r"`([^`]*)`", r"\\texttt{\1}", out)


def text_width_pt(text: str, size_pt: float = FONT_SIZE_PT) -> float:
    """The typeset width of plain cell text (before escaping) in Computer Modern at `size_pt`."""
    # '$' would open math mode in mathtext: measured as an 'S', a glyph of about its width.
    math = "".join(LATEX_SYMBOLS.get(char, char) for char in str(text).replace("$", "S")).replace("%", r"\%")
    with matplotlib.rc_context({"mathtext.fontset": "cm"}):
        width, *_ = MathTextParser("path").parse(math, dpi=720, prop=FontProperties(family="cmr10", size=size_pt))
    return width / 10


def table_width_pt(headers: list[str], rows: list[list[str]]) -> float:
    """Estimated width of a tabular of these cells: the widest cell of each column plus its padding."""
    widths = [max(text_width_pt(cell) for cell in column) for column in zip(headers, *rows)]
    return sum(widths) + 2 * TABCOLSEP_PT * len(headers)


def compact_value(mean: float, hw: float = np.nan) -> str:
    """'.412 ± .031' (no leading zero, as tables of shares usually print); '-' without a mean."""
    if pd.isna(mean):
        return "-"
    def short(value: float) -> str:
        return f"{value:.3f}".replace("0.", ".", 1) if abs(value) < 1 else f"{value:.2f}"
    return short(mean) + (f"±{short(hw)}" if not pd.isna(hw) else "")


def results_cells(results: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the paper table: grid runs by their (ρ, L, c), variants by their label."""
    top = k_label(results) if results["k_max"].dropna().nunique() <= 1 else "pass@k"
    headers = ["Cell", "Evals", "pass@1", top, "Reward"]
    rows = [[row["coordinates"] if row["plain"] and row["rho"] > 0 else row["variant"],
             format_count(row["fresh_evaluations"]), compact_value(row["pass@1"], row["pass@1_hw"]),
             compact_value(row["pass@k_max"], row["pass@k_max_hw"]), compact_value(row["reward"], row["reward_hw"])]
            for _, row in results.iterrows()]
    return headers, rows


def latex_table(headers: list[str], rows: list[list[str]], caption: str, label: str) -> str:
    """A `booktabs` table at \\small, numbers right-aligned; a `table*` when one column is too narrow for it."""
    def numeric(column: int) -> bool:
        cells = [str(row[column]).strip("`") for row in rows]
        return bool(cells) and all(re.match(r"^[-\d.,≥ ]", cell) for cell in cells)

    wide = table_width_pt(headers, rows) > COLUMN_WIDTH_PT
    float_env = "table*" if wide else "table"
    spec = "".join("r" if numeric(i) else "l" for i in range(len(headers)))
    lines = [rf"\begin{{{float_env}}}[t]", r"\centering", r"\small", rf"\setlength{{\tabcolsep}}{{{TABCOLSEP_PT:g}pt}}",
             rf"\caption{{{latex_escape(caption)}}}", rf"\label{{{label}}}",
             rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(latex_escape(h) for h in headers) + r" \\", r"\midrule"]
    lines += [" & ".join(latex_escape(cell) for cell in row) + r" \\" for row in rows]
    lines += [r"\bottomrule", r"\end{tabular}", rf"\end{{{float_env}}}", ""]
    return "\n".join(lines)


def results_latex(results: pd.DataFrame) -> str:
    """The main results table as LaTeX (`\\usepackage{booktabs}` in the preamble)."""
    headers, rows = results_cells(results)
    protocols = ", ".join(sorted(set(results["protocol"]))) if not results.empty else "none"
    caption = (f"Held-out results ({protocols} protocol): mean ± 95 % t half-width over evaluation repeats; "
               "Cell is (ρ, L, c) or the variant; Evals are fresh verifier evaluations.")
    return latex_table(headers, rows, caption, "tab:results")
