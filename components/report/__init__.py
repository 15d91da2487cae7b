"""The sweep report: one self-contained HTML page (render.py, plots.py, template.py) and the step
program `python -m components.report --sweep-dir DIR`."""
