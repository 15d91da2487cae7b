"""The demo model: the HunyuanImage-3 architecture at a small size, trained by the project on the
procedural scenes of components/data/sample.py (see train.py; `--model demo` loads it)."""
