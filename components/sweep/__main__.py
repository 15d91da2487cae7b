from components.sweep.cli import app

app(prog_name="python -m components.sweep")
