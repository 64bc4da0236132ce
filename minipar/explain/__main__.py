"""python -m minipar.explain (minipar/explain/pictures.py)."""
import sys

from minipar.explain import main

sys.exit(main())
