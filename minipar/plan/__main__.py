"""python -m minipar.plan: the planner's table (minipar/plan/table.py)."""
from minipar.plan import main

main()
