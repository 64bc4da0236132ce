"""python -m minipar.train (minipar/train/trainer.py)."""
from minipar.train import main

main()
