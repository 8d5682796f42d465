"""hydra/sweeper=dtf: hyperparameter search with Optuna, trials side by side, pruned while they train."""
