"""python -m minipar.convert (minipar/convert/cli.py)."""
from minipar.convert.cli import main

main()
