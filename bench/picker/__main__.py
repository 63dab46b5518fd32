"""python -m bench.picker ...: the picker service benchmark (see bench/picker/run.py)."""
from bench.picker.run import main

main()
