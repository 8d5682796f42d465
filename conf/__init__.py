"""dtf's Hydra config tree. Importing it (as Hydra does to read it) registers the schemas its
options extend, so the tree composes with nothing else imported."""

from dtf.config import store

store.register()
