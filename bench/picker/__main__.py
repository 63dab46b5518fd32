"""python -m bench.picker ...: the picker service benchmark (see bench/picker/service.py)."""
from bench.picker.service import main

main()
