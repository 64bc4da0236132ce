"""python -m minipar.plot (minipar/plot/curves.py)."""
import sys

from minipar.plot import main

sys.exit(main())
