"""The recipes (recipes/*.yaml): the config group `recipe`, registered by dtf.config.store."""
