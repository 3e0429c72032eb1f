"""`rsgl bench simulate`: the real scheduling core on a virtual clock (see simulate.py)."""
