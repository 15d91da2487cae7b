"""Accuracy sweeps: a YAML spec expanded into configs (spec.py), run and evaluated against a
reference (runner.py), the precision budget (budget.py) and the `ardit sweep` / `ardit report`
commands (cli.py)."""
