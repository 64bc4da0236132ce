"""python -m minipar.explain (minipar/explain/cli.py)."""
import sys

from minipar.explain import main

sys.exit(main())
