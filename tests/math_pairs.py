"""Hand-checked (reference, boxed answer) pairs for the math verifier (SPEC 12): the tests' and the
benchmark's (`python -m benchmarks.math_verifier`) one list. Each pair was checked by hand: EQUIVALENT
pairs denote the same mathematical object, NEAR_MISSES do not (however close they look), and every
ADVERSARIAL answer must score 0.0 within the verifier's bounds without running anything."""

EQUIVALENT = [
    # fractions and decimals
    ("\\frac{1}{2}", "0.5"), ("\\frac{1}{2}", "1/2"), ("\\frac{1}{2}", "\\dfrac{1}{2}"), ("\\frac{1}{2}", "\\tfrac{1}{2}"),
    ("\\frac{1}{2}", "\\frac12"), ("\\frac{1}{2}", "\\frac{2}{4}"), ("0.5", "\\frac{1}{2}"), ("\\frac{3}{4}", "0.75"),
    ("-\\frac{3}{4}", "-0.75"), ("-\\frac{3}{4}", "\\frac{-3}{4}"), ("\\frac{5}{6}", "\\frac{10}{12}"),
    ("1.25", "\\frac{5}{4}"), ("0.125", "\\frac{1}{8}"), ("2.50", "2.5"), ("3", "3.0"), ("3", "3.00"),
    ("100", "100.0"), ("1000", "1,000"), ("1000000", "1,000,000"), ("-7", "-7"), ("12", "012"),
    ("\\frac{1}{3}", "\\frac{1}{3}"), ("\\frac{a}{b}", "a/b"), ("-2", "- 2"), ("\\frac{7}{2}", "3.5"),
    # radicals
    ("2\\sqrt{2}", "\\sqrt{8}"), ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"), ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("3\\sqrt{3}", "\\sqrt{27}"), ("\\sqrt{12}", "2\\sqrt{3}"), ("\\sqrt[3]{8}", "2"), ("2+\\sqrt{3}", "\\sqrt{3}+2"),
    ("\\frac{1+\\sqrt{5}}{2}", "\\frac{\\sqrt{5}+1}{2}"), ("\\sqrt{4}", "2"),
    # intervals
    ("[1,2)", "[1, 2)"), ("(-\\infty, 3]", "(-\\infty,3]"), ("(0,\\infty)", "(0, \\infty)"), ("[-1,1]", "[-1, 1]"),
    ("(-\\infty,0)\\cup(1,\\infty)", "(-\\infty, 0) \\cup (1, \\infty)"), ("[2,5]", "[2,5]"),
    # sets
    ("\\{1,2,3\\}", "\\{3,2,1\\}"), ("\\{1,2\\}", "\\{2, 1\\}"), ("1,2", "2,1"), ("\\{-1, 1\\}", "\\{1,-1\\}"),
    # units, degrees, currency, text
    ("5", "5\\text{ cm}"), ("5\\text{ cm}", "5"), ("90", "90^\\circ"), ("90^\\circ", "90"), ("5", "\\$5"),
    ("5", "\\text{5}"), ("10", "10\\,\\text{m}"),
    # percent (math-verify reads "25\\%" as 25, the number the percent sign stands beside)
    ("25\\%", "25"), ("25", "25\\%"), ("25\\%", "25\\%"), ("50%", "50"), ("12.5\\%", "12.5"),
    # expressions, equations, constants
    ("x^2+1", "1+x^2"), ("a+b", "b+a"), ("2x", "x \\cdot 2"), ("(x+1)^2", "x^2+2x+1"), ("x=3", "3"),
    ("3", "x=3"), ("y = 2x + 1", "y=1+2x"), ("10^{3}", "1000"), ("2^{10}", "1024"), ("\\pi", "\\pi"),
    ("2\\pi", "2 \\pi"), ("\\frac{\\pi}{2}", "\\frac{1}{2}\\pi"), ("\\infty", "\\infty"), ("6", "3!"),
    ("\\binom{5}{2}", "10"), ("(1,2)", "(1, 2)"),
]

NEAR_MISSES = [
    ("\\frac{1}{2}", "\\frac{1}{3}"), ("\\frac{1}{2}", "0.51"), ("3", "3.01"), ("2", "-2"), ("-2", "2"),
    ("\\sqrt{2}", "2"), ("2\\sqrt{2}", "\\sqrt{6}"), ("(1,2]", "[1,2]"), ("[1,2)", "(1,2)"),
    ("\\{1,2,3\\}", "\\{1,2\\}"), ("\\{1,2\\}", "\\{1,2,3\\}"), ("x^2+1", "x^2-1"), ("a+b", "a-b"),
    ("1000", "100"), ("1000", "10000"), ("\\pi", "3.14"), ("\\frac{3}{4}", "\\frac{4}{3}"), ("12", "21"),
    ("0", "1"), ("\\frac{1}{2}", "2"), ("x=3", "x=4"), ("2", "2, 3"), ("\\infty", "-\\infty"),
    ("(0,\\infty)", "[0,\\infty)"), ("5", "five"), ("1", "0.999"), ("7", "7.5"), ("\\sqrt{3}", "\\sqrt[3]{3}"),
    ("2^{10}", "1000"), ("10", "10^{2}"), ("-\\frac{1}{2}", "\\frac{1}{2}"), ("\\frac{1}{2}", "\\frac{1}{2}x"),
    ("1,2", "1,3"), ("x+1", "x"), ("\\frac{1}{2}", "\\frac{1}{2} + 10^{-3}"), ("12", "-12"), ("25\\%", "2.5"),
]

# Answers a hostile or broken policy might box. Each must score 0.0 (reference "2"), bounded in time and size.
ADVERSARIAL = [
    "9^{9^{9^{9}}}",
    "10^{10^{10^{10}}}",
    "2^{2^{2^{2^{2^{2}}}}}",
    "(10^{10^{6}})!",
    "10^{-10^{10}}",
    "{" * 300 + "1" + "}" * 300,
    "\\sqrt{" * 300 + "2" + "}" * 300,
    "(" * 400 + "1" + ")" * 400,
    "\\frac{1}{" * 150 + "1" + "}" * 150,
    "\\def\\x{1}\\x",
    "\\newcommand{\\x}{2}\\x",
    "\\input{/etc/passwd}",
    "__import__('os').system('touch /tmp/replay_rloo_math_pwned')",
    "exec(\"open('/tmp/replay_rloo_math_pwned', 'w')\")",
    "1+" * 450 + "3",
    "x" * 999,
    "1" * 5000,
    "\\sum_{k=1}^{10^{12}} k",
    "\\prod_{n=1}^{10^{9}} n",
    "\\frac{1}{0}",
    "0/0",
    "\\int_0^1 e^{x^2} dx",
]
